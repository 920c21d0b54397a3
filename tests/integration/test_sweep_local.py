"""A real local strong-scaling study (1 and 2 processes) and its report, through the `sweep` CLI."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tests.helpers.cli import REPO, run_cli

#: Hang guard (not a performance bound): the two-point study and its report take ~30 s here.
HANG_S = 400


def _sweep_file(tmp_path: Path, mode: str = "strong") -> Path:
    """A tiny study whose base job is jobs/smoke.toml (read from the sweep file's `base` path)."""
    path = tmp_path / "study.toml"
    batch = "global_batch_size = 32\n" if mode == "strong" else ""
    path.write_text(
        f'[sweep]\nname = "it-{mode}"\nmode = "{mode}"\n{batch}base = "{REPO / "jobs" / "smoke.toml"}"\n'
        "points = [{nodes = 1, ntasks_per_node = 1}, {nodes = 1, ntasks_per_node = 2}]\n"
        "[base.train]\nsteps = 12\nlog_every = 4\nval_samples = 64\n"
        "[base.checkpoint]\nevery_steps = 0\n"
    )
    return path


def _study(runs: Path) -> Path:
    (study,) = [p for p in runs.iterdir() if p.is_dir() and not p.name.startswith(".")]
    return study


@pytest.mark.slow
@pytest.mark.timeout(HANG_S + 60)
def test_local_strong_study_and_report(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    result = run_cli("sweep", str(_sweep_file(tmp_path)), "--backend", "local", "--runs-dir", str(runs), "--quiet",
                     timeout=HANG_S)
    assert result.returncode == 0, result.stderr
    study = _study(runs)
    assert study.name.startswith("it-strong-")
    sweep = json.loads((study / "sweep.json").read_text())
    assert (sweep["schema"], sweep["kind"], sweep["study"], sweep["mode"]) == (1, "sweep", "it-strong", "strong")
    assert [(p["world_size"], p["per_device_batch_size"]) for p in sweep["points"]] == [(1, 32), (2, 16)]
    submitted = json.loads((study / "submitted.json").read_text())
    assert [r["status"] for r in submitted["runs"]] == ["completed", "completed"]
    for point in sweep["points"]:
        start = json.loads((study / point["run_dir"] / "metrics.jsonl").read_text().splitlines()[0])
        assert (start["world_size"], start["per_device_batch_size"], start["global_batch_size"]) == (
            point["world_size"], point["per_device_batch_size"], 32)
    with open(study / "report" / "scaling.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["study"], r["mode"], r["world_size"]) for r in rows] == [("it-strong", "strong", "1"),
                                                                        ("it-strong", "strong", "2")]
    assert float(rows[0]["speedup"]) == 1.0 and float(rows[1]["samples_per_s"]) > 0
    assert (study / "report" / "report.html").is_file()
    # issue 17: status and logs answer for the study directory (every point, then the report)
    status = run_cli("status", str(study), timeout=60)
    assert status.returncode == 0, status.stdout + status.stderr
    table = status.stdout.splitlines()
    assert table[0] == f"study {study}" and table[1].split() == ["JOBID", "NAME", "STATE", "NODES", "ELAPSED", "REASON"]
    assert [line.split()[2] for line in table[2:]] == ["COMPLETED", "COMPLETED", "COMPLETED"], status.stdout
    assert table[-1].split()[:3] == ["-", "it-strong-report", "COMPLETED"], status.stdout
    logs = run_cli("logs", str(study), timeout=60)
    assert logs.returncode == 0, logs.stderr
    for point in sweep["points"]:
        assert f"==> {point['run_dir']}/logs/rank-0.out <==" in logs.stdout, logs.stdout[:2000]


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    result = run_cli("sweep", str(REPO / "jobs" / "strong_scaling.toml"), "--dry-run", "--runs-dir", str(runs))
    assert result.returncode == 0, result.stderr
    assert "p2-ws4-n2x2" in result.stdout and "#SBATCH --nodes=2" in result.stdout
    assert "cyclone_kit report" in result.stdout
    assert not runs.exists()


@pytest.mark.parametrize(("text", "message"), [
    ('[sweep]\nname = "x"\nmode = "strong"\nglobal_batch_size = 3\nbase = "{smoke}"\n'
     "points = [{{nodes = 1, ntasks_per_node = 2}}]\n", "does not divide over world size 2"),
    ('[sweep]\nname = "x"\nmode = "weak"\nbase = "{smoke}"\nworld_sizes = [1]\nspeed = 2\n',
     "unknown key(s) in [sweep]: speed"),
    ('[sweep]\nname = "x"\nmode = "weak"\nbase = "{smoke}"\npoints = [{{nodes = 3, ntasks_per_node = 1}}]\n',
     "--nodes=3 but partition 'cpu'"),
    ('[sweep\nname = "x"\n', "malformed TOML"),
])
def test_bad_sweeps_exit_2_with_one_line_and_write_nothing(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text.format(smoke=REPO / "jobs" / "smoke.toml"))
    runs = tmp_path / "runs"
    result = run_cli("sweep", str(path), "--backend", "local", "--runs-dir", str(runs))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "HINT:" in lines[0]
    assert not runs.exists() or not any(runs.iterdir())
