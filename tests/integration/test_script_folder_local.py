"""A user's script as it is, run here with ``cyclone-kit run`` (issue 21): it works in the folder it was
started from (relative ``./data`` and ``./ckpt.pt``), a second run resumes from the first one's
checkpoint, every run runs the snapshot taken at its start (``--resume`` included) unless
``--live-code``, ``--chdir`` moves the working directory, a world of 2 that never forms a process
group is reported as 2 independent copies, and one that does is not."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tests.helpers.cli import REPO, run_cli

#: A script in the published pattern: relative ./data and ./ckpt.pt, a sibling package, no cyclone_kit.
SCRIPT = textwrap.dedent("""
    import os
    from pathlib import Path

    import helpers

    rank = int(os.environ["RANK"])
    n = int(Path("./data/n.txt").read_text())
    ckpt = Path("./ckpt.pt")
    # rank 0 resumes from the last run's checkpoint (the ranks do not meet: no other rank may look)
    done = (int(ckpt.read_text()) if ckpt.exists() else 0) if rank == 0 else None
    Path(f"./out-rank{rank}.json").write_text(
        f'{{"cwd": "{os.getcwd()}", "file": "{__file__}", "version": {helpers.VERSION}, "done": {done or 0}, "n": {n}}}')
    if rank == 0:
        ckpt.write_text(str(done + n))
""")


def _project(folder: Path, version: int = 1) -> Path:
    """A project folder: train.py, its helpers package and ./data."""
    (folder / "data").mkdir(parents=True, exist_ok=True)
    (folder / "data" / "n.txt").write_text("5\n")
    (folder / "helpers").mkdir(exist_ok=True)
    (folder / "helpers" / "__init__.py").write_text(f"VERSION = {version}\n")
    (folder / "train.py").write_text(SCRIPT)
    return folder


def _run(cwd: Path, *argv: str) -> tuple[str, Path]:
    proc = run_cli("run", *argv, "--runs-dir", str(cwd / "runs"), cwd=cwd, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("run dir: ") == 1 and proc.stdout.count("starting ") == 1, proc.stdout
    run_dir = Path(next(line for line in proc.stdout.splitlines() if line.startswith("run dir: "))[9:])
    return proc.stdout, run_dir


def _outs(folder: Path) -> list[dict]:
    return [json.loads((folder / f"out-rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.timeout(600)
def test_a_script_runs_in_its_folder_from_its_snapshot_and_resumes(tmp_path: Path) -> None:
    proj = _project(tmp_path / "proj")
    stdout, first = _run(proj, "train.py", "--nproc", "2")
    outs = _outs(proj)
    print(f"first run: {outs}")
    assert [(o["cwd"], o["version"], o["n"]) for o in outs] == [(str(proj), 1, 5)] * 2 and outs[0]["done"] == 0
    # the snapshot ran (its sibling package is the snapshot's), and the script still sees itself where it is
    assert {o["file"] for o in outs} == {str(proj / "train.py")}
    assert sorted(str(p.relative_to(first / "script")) for p in (first / "script").rglob("*.py")) == [
        "helpers/__init__.py", "train.py"]
    assert (proj / "ckpt.pt").read_text() == "5" and not (first / "ckpt.pt").exists()
    assert (first / "logs" / "rank-0.out").exists()  # logs and records stay in the run directory
    # two ranks that never formed a process group: said by the shim's end record, run and status
    end = [json.loads(x) for x in (first / "shim.jsonl").read_text().splitlines()][-1]
    assert end["warning"].startswith("2 ranks ran as 2 independent copies") and end["process_group_world"] is None
    assert "warning: 2 ranks ran as 2 independent copies" in stdout
    status = run_cli("status", str(first), cwd=proj)
    assert "2 ranks ran as 2 independent copies" in status.stdout, status.stdout + status.stderr
    # a binary file in logs/ (TensorBoard's, say) is named by `logs`, not dumped
    (first / "logs" / "events.out.tfevents.1").write_bytes(b"\x18\x00\x00\x00\x00\x00\x00\x00\xa3\x7f brain.Event:2")
    logs = run_cli("logs", str(first), cwd=proj)
    assert "==> logs/events.out.tfevents.1 <== binary file (24 bytes), not shown" in logs.stdout, logs.stdout
    assert "\x00" not in logs.stdout and "==> logs/rank-0.err <==" in logs.stdout

    # a second run from the same folder resumes from the first one's checkpoint
    _run(proj, "train.py", "--nproc", "2")
    assert _outs(proj)[0]["done"] == 5 and (proj / "ckpt.pt").read_text() == "10"

    # the code changes; --resume of the first run runs what was submitted then, --live-code what is there now
    (proj / "helpers" / "__init__.py").write_text("VERSION = 2\n")
    _run(proj, "--resume", str(first), "--nproc", "2")
    assert [o["version"] for o in _outs(proj)] == [1, 1]
    _, live = _run(proj, "train.py", "--nproc", "2", "--live-code")
    outs = _outs(proj)
    assert [o["version"] for o in outs] == [2, 2] and {o["file"] for o in outs} == {str(proj / "train.py")}
    spec = json.loads((live / "spec.json").read_text())["script"]
    assert (spec["live"], spec["chdir"]) == (True, str(proj))


@pytest.mark.timeout(300)
def test_chdir_moves_the_working_directory(tmp_path: Path) -> None:
    proj = _project(tmp_path / "proj")
    elsewhere = _project(tmp_path / "elsewhere")
    (elsewhere / "train.py").unlink()
    _run(tmp_path, str(proj / "train.py"), "--nproc", "2", "--chdir", str(elsewhere))
    assert [o["cwd"] for o in _outs(elsewhere)] == [str(elsewhere)] * 2 and (elsewhere / "ckpt.pt").exists()
    assert not (proj / "ckpt.pt").exists()


@pytest.mark.timeout(300)
def test_a_snapshot_over_its_bound_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    proj = _project(tmp_path / "proj")
    for i in range(401):
        (proj / f"mod{i}.py").write_text("x = 1\n")
    proc = run_cli("run", "train.py", "--nproc", "1", "--runs-dir", str(proj / "runs"), cwd=proj)
    assert proc.returncode == 2 and "more than 400 Python files" in proc.stderr and "--live-code" in proc.stderr
    assert "Traceback" not in proc.stderr and not (proj / "runs").exists()


@pytest.mark.timeout(600)
def test_a_process_group_of_the_launched_world_is_not_flagged_even_when_destroyed(tmp_path: Path) -> None:
    (tmp_path / "pg.py").write_text(textwrap.dedent("""
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method="env://")
        dist.barrier()
        dist.destroy_process_group()   # gone before the script ends: the shim noted it when it was formed
    """))
    stdout, run_dir = _run(tmp_path, "pg.py", "--nproc", "2")
    end = [json.loads(x) for x in (run_dir / "shim.jsonl").read_text().splitlines()][-1]
    assert (end["status"], end["process_group_world"], end.get("warning")) == ("completed", 2, None)
    assert "independent copies" not in stdout


#: A local strong-scaling sweep of the project's train.py (worlds 1 and 2), its report off.
SWEEP = """
[sweep]
name = "folder-sweep"
mode = "strong"
global_batch_size = 8
world_sizes = [1, 2]
serial = true
report = false

[base]
name = "folder-sweep"

[base.script]
path = "proj/train.py"

[base.resources]
profile = "local"
partition = "cpu"
cpus_per_task = 1
time = "00:10:00"

[base.checkpoint]
requeue = false
"""


@pytest.mark.timeout(600)
def test_a_sweep_takes_chdir_and_live_code_for_every_point(tmp_path: Path) -> None:
    proj = _project(tmp_path / "proj")
    elsewhere = _project(tmp_path / "elsewhere")
    (elsewhere / "train.py").unlink()
    (tmp_path / "sweep.toml").write_text(SWEEP)
    (proj / "helpers" / "__init__.py").write_text("VERSION = 3\n")
    proc = run_cli("sweep", "sweep.toml", "--backend", "local", "--quiet", "--runs-dir", str(tmp_path / "runs"),
                   "--chdir", "elsewhere", "--live-code", cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    specs = [json.loads(p.read_text())["script"] for p in sorted((tmp_path / "runs").glob("*/*/spec.json"))]
    assert len(specs) == 2 and {(s["chdir"], s["live"]) for s in specs} == {(str(elsewhere), True)}, specs
    outs = _outs(elsewhere)  # the 2-rank point wrote last: it ran in elsewhere/, the live file of proj/
    assert [(o["cwd"], o["file"], o["version"]) for o in outs] == [(str(elsewhere), str(proj / "train.py"), 3)] * 2
    assert (elsewhere / "ckpt.pt").read_text() == "10" and not (proj / "ckpt.pt").exists()  # both points, in turn


def test_sweep_chdir_of_a_built_in_trainer_study_is_refused_with_one_line(tmp_path: Path) -> None:
    proc = run_cli("sweep", str(REPO / "jobs" / "strong_scaling.toml"), "--dry-run", "--chdir", str(tmp_path),
                   cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines() == ["error: --chdir is for a script job, and this job runs the built-in trainer "
                                        "HINT: give SCRIPT.py (or -m MODULE, or a spec with a [script] table), "
                                        "or drop --chdir"], proc.stderr
