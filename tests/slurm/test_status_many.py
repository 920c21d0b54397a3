"""Issue 22: `status --runs-dir` of many runs asks Slurm once (one squeue, one sacct) and shows every run.

50 run directories record the 50 tasks of one held array job; one more records an id Slurm has
never seen. Wrappers named squeue and sacct, first on PATH, count their calls and run the real
commands behind them. `status` must call squeue once and sacct once (for the one id squeue does
not know), and print a row for each of the 51 runs.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from cyclone_kit.core.proc import run_command
from cyclone_kit.rundir.layout import RunDir
from tests.helpers.cli import run_cli

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

RUNS = 50
UNKNOWN_ID = "999999"


def counting_wrappers(bin_dir: Path, log: Path) -> dict[str, str]:
    """``squeue`` and ``sacct`` wrappers in ``bin_dir`` that log each call to ``log``; PATH for them."""
    bin_dir.mkdir()
    for name in ("squeue", "sacct"):
        real = shutil.which(name)
        assert real is not None, f"{name} not on PATH"
        wrapper = bin_dir / name
        wrapper.write_text(f'#!/bin/sh\necho "{name} $*" >> "{log}"\nexec "{real}" "$@"\n')
        wrapper.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def test_status_of_51_runs_asks_squeue_once_and_shows_every_run(slurm_cluster: dict[str, str],
                                                                tmp_path: Path) -> None:
    held = run_command(["sbatch", "--parsable", "--hold", f"--array=0-{RUNS - 1}", "--job-name=ck-status-many",
                        "--output=/dev/null", "--time=00:05:00", "--wrap=true"], cwd=tmp_path, timeout=30)
    array_id = held.stdout.strip().split(";")[0]
    try:
        runs = tmp_path / "runs"
        ids = [f"{array_id}_{i}" for i in range(RUNS)] + [UNKNOWN_ID]
        for i, job_id in enumerate(ids):
            rd = RunDir.create(runs, f"point{i:02d}", json.dumps({"name": f"point{i:02d}"}) + "\n")
            rd.write_submission(job_id, "slurm")
        log = tmp_path / "calls.log"
        env = counting_wrappers(tmp_path / "bin", log)
        result = run_cli("status", "--runs-dir", str(runs), env=env, cwd=tmp_path, timeout=120)
        calls = log.read_text().splitlines() if log.exists() else []
        assert [c.split()[0] for c in calls].count("squeue") == 1, calls
        assert [c.split()[0] for c in calls].count("sacct") <= 1, calls  # only for the id squeue does not know
        assert result.returncode == 0, result.stdout + result.stderr
        rows = {line.split()[0]: line for line in result.stdout.splitlines() if line.split()}
        assert all(job_id in rows for job_id in ids), result.stdout  # every run, none cut off
        assert all("PENDING" in rows[f"{array_id}_{i}"] for i in range(RUNS))
        assert "from the run directory" in rows[UNKNOWN_ID]
    finally:
        run_command(["scancel", array_id], check=False, timeout=30)
