"""`sweep --backend slurm` on the local Slurm cluster: 1, 2 and 2x2 CPU ranks, then the report job.

Issue 5's "done when": the points (sized for 2 nodes x 2 CPU tasks) complete and the report job,
which depends on all of them, writes the table.

Both studies (the strong one through sbatch, the weak one through submitit) are started at once by one
module-scoped fixture, each ``sweep --wait`` a CLI process of its own: each study is a chain of jobs,
one point after the other, and its wall time mostly its jobs' starts and ends, which the two chains now
spend side by side (the cpu partition holds a point of each at once: at most 2 + 2 of each node's 4 CPUs;
issue 27: 60-89 s for the file, one study after the other).

The strong study also answers issue 17's `status` and `logs` on a study: the study directory shows every
point and the report job, and the report job's id finds its study (until issue 27 test_status_logs ran a
2-point study of its own for that: 3 Slurm jobs, ~30 CPU-s). One `status STUDY` is taken as soon as
submitted.json exists, while the jobs wait or run; the rest once both ``sweep --wait`` ended.
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from cyclone_kit.backends.slurm import SlurmBackend
from tests.helpers.cli import REPO, run_cli
from tests.helpers.slurm_jobs import wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
#: Hang guard (not a performance bound): a sweep of 3 serial jobs and the report job takes ~1 min
#: here; >= 5x for a slower machine. pytest's limit is set above it so the guard reports first.
HANG_S = 600
#: hang guard of one `status`/`logs` call
CLI_S = 60
#: the fixture's guards together (the sweeps, the early `status`, 4 CLI calls after them), and a margin
LIMIT_S = HANG_S + 5 * CLI_S + 60
#: jobs/strong_scaling.toml's study name: its points' jobs are STRONG-ws<N>, its report job STRONG-report
STRONG = "strong-tiny"


def _weak_sweep(folder: Path) -> Path:
    """The shipped weak study less its 2-node point (issue 27: 4 rank starts; 2 nodes x 2 tasks through submitit is
    test_submitit_slurm's job, the 2-node point of a study the strong study's)."""
    shipped = (REPO / "jobs" / "weak_scaling.toml").read_text()
    two_node = "    { nodes = 2, ntasks_per_node = 2 },\n"
    assert two_node in shipped
    sweep = folder / "weak_scaling.toml"
    sweep.write_text(shipped.replace(two_node, ""))
    return sweep


@pytest.fixture(scope="module")
def studies(slurm_cluster: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run both ``sweep --wait`` at once; name -> (exit code, its output, its study directory).

    "strong-cli": what `status` and `logs` said of the strong study (CompletedProcesses): "early", its
    `status STUDY` once submitted.json existed (the jobs may have ended by then, or not); after both sweeps ended
    "status" (`status STUDY`), "by_id" (`status REPORT_ID`), "report_logs" and "study_logs".
    """
    tmp = tmp_path_factory.mktemp("sweeps")
    argv = {"strong": (str(REPO / "jobs" / "strong_scaling.toml"), "--backend", "slurm", "--set", "train.steps=12",
                       "--set", "train.log_every=4"),
            "weak": (str(_weak_sweep(tmp)), "--backend", "submitit", "--set", "train.steps=8")}
    env = {"strong": {}, "weak": {"CYCLONE_SUBMITIT_EXECUTOR": "slurm"}}
    procs = {}
    for name, args in argv.items():
        with open(tmp / f"{name}.out", "w") as out:  # a file, not a pipe: neither CLI waits for a reader
            procs[name] = subprocess.Popen([sys.executable, "-m", "cyclone_kit", "sweep", *args, "--runs-dir",
                                            str(tmp / name), "--wait"], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                           env={**os.environ, "PYTHONUNBUFFERED": "1", **env[name]}, text=True)
    deadline = time.monotonic() + HANG_S
    out: dict[str, Any] = {}
    cli: dict[str, Any] = {}
    out["strong-cli"] = cli
    try:
        # the strong study's jobs are all submitted once its submitted.json exists (written whole, at once)
        submitted = wait_for(lambda: next((tmp / "strong").glob("*/submitted.json"), None)
                             or procs["strong"].poll() is not None, HANG_S, "the strong study's submitted.json")
        if isinstance(submitted, Path):
            cli["early"] = run_cli("status", str(submitted.parent), timeout=CLI_S)  # while the jobs wait or run
        for name, proc in procs.items():
            try:
                code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            output = (tmp / f"{name}.out").read_text()
            found = list((tmp / name).iterdir()) if (tmp / name).exists() else []
            assert len(found) == 1, output
            out[name] = (code, output, found[0])
        study = out["strong"][2]
        report = (json.loads((study / "submitted.json").read_text()).get("report") if "early" in cli else None) or {}
        if report.get("job_id"):  # else test_study_directory_and_report_job_id fails on the sweep's output
            cli["status"] = run_cli("status", str(study), timeout=CLI_S)
            cli["by_id"] = run_cli("status", report["job_id"], "--runs-dir", str(tmp / "strong"), timeout=CLI_S)
            cli["report_logs"] = run_cli("logs", report["job_id"], "--runs-dir", str(tmp / "strong"), timeout=CLI_S)
            cli["study_logs"] = run_cli("logs", str(study), timeout=CLI_S)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
        backend = SlurmBackend()
        for study in (tmp / name for name in argv):
            for submitted in study.glob("*/submitted.json"):
                runs = json.loads(submitted.read_text())
                for job_id in [r["job_id"] for r in runs["runs"]] + [runs["report"]["job_id"]]:
                    backend.cancel(job_id)  # a no-op for finished jobs
    return out


@pytest.mark.timeout(LIMIT_S)
def test_strong_scaling_study_on_slurm(studies: dict[str, Any]) -> None:
    code, output, study = studies["strong"]
    assert code == 0, output
    submitted = json.loads((study / "submitted.json").read_text())
    sweep = json.loads((study / "sweep.json").read_text())
    assert [p["world_size"] for p in sweep["points"]] == [1, 2, 4]
    # serial = true: each point waits for the previous one
    ids = [r["job_id"] for r in submitted["runs"]]
    # issue 13: the chain is an sbatch argument (--dependency=afterany:ID), never text spliced into job.sbatch
    assert submitted["runs"][1]["after"] == [ids[0]] and submitted["runs"][2]["after"] == [ids[1]]
    assert "--dependency" not in (study / "p1-ws2-n1x2" / "job.sbatch").read_text()
    assert f"--dependency=afterany:{':'.join(ids)}\n" in (study / "report.sbatch").read_text()
    start = json.loads((study / "p2-ws4-n2x2" / "metrics.jsonl").read_text().splitlines()[0])
    assert (start["world_size"], start["num_nodes"], start["hostnames"]) == (4, 2, ["c1", "c2"])
    assert start["slurm_job_id"] == ids[2]
    with open(study / "report" / "scaling.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["world_size"]) for r in rows] == [1, 2, 4]
    assert [int(r["per_device_batch_size"]) for r in rows] == [64, 32, 16]
    assert all(float(r["samples_per_s"]) > 0 for r in rows)
    assert (study / "report" / "report.html").is_file()
    assert list((study / "logs").glob("report-*.out"))


@pytest.mark.timeout(LIMIT_S)
def test_study_directory_and_report_job_id(studies: dict[str, Any]) -> None:
    """`status` and `logs` of the strong study: by its directory, and by its report job's id."""
    code, output, study = studies["strong"]
    cli = studies["strong-cli"]
    assert code == 0 and "study_logs" in cli, output
    submitted = json.loads((study / "submitted.json").read_text())
    points = [(r["name"], r["job_id"]) for r in submitted["runs"]]
    report_id = submitted["report"]["job_id"]
    early, status, by_id = cli["early"], cli["status"], cli["by_id"]
    report_logs, study_logs = cli["report_logs"], cli["study_logs"]
    print(early.stdout, status.stdout, by_id.stdout, report_logs.stdout[-800:], sep="\n")
    assert early.returncode == 0, early.stdout + early.stderr
    assert re.search(rf"^{report_id}\s+{STRONG}-report\s", early.stdout, re.M), early.stdout
    if re.search(rf"^{report_id}\s+{STRONG}-report\s+PENDING\s", early.stdout, re.M):
        assert f"job {report_id} is PENDING (Dependency): waits until the jobs it depends on" in early.stdout
    assert status.returncode == 0 and status.stdout.startswith(f"study {study}"), status.stdout + status.stderr
    for name, job_id in points:
        assert re.search(rf"^{job_id}\s+{STRONG}-ws\d\s+COMPLETED\s", status.stdout, re.M), (name, status.stdout)
    assert re.search(rf"^{report_id}\s+{STRONG}-report\s+COMPLETED\s", status.stdout, re.M), status.stdout
    assert by_id.returncode == 0 and f"report job of study {study}" in by_id.stdout, by_id.stdout + by_id.stderr
    assert re.search(rf"^{report_id}\s+{STRONG}-report\s+COMPLETED\s", by_id.stdout, re.M), by_id.stdout
    assert report_logs.returncode == 0, report_logs.stderr
    assert re.search(r"^==> logs/report-\S+\.out <==$", report_logs.stdout, re.M), report_logs.stdout
    assert study_logs.returncode == 0, study_logs.stderr
    for name, _ in points:
        assert f"==> {name}/logs/" in study_logs.stdout, (name, study_logs.stdout[:2000])
    assert "==> logs/report-" in study_logs.stdout


@pytest.mark.timeout(LIMIT_S)
def test_weak_scaling_study_through_submitit(studies: dict[str, Any]) -> None:
    code, output, study = studies["weak"]
    assert code == 0, output
    submitted = json.loads((study / "submitted.json").read_text())
    assert submitted["backend"] == "submitit"
    for point in json.loads((study / "sweep.json").read_text())["points"]:
        start = json.loads((study / point["run_dir"] / "metrics.jsonl").read_text().splitlines()[0])
        assert (start["launcher"], start["world_size"], start["per_device_batch_size"]) == (
            "submitit", point["world_size"], 32)
    with open(study / "report" / "scaling.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["mode"], int(r["world_size"]), int(r["global_batch_size"])) for r in rows] == [
        ("weak", 1, 32), ("weak", 2, 64)]
