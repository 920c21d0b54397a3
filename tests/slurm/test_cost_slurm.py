"""Issue 15.2 on the local cluster: a real job's device-hours come from sacct (AllocTRES x Elapsed).

Needs Slurm accounting (scripts/local-slurm.sh start --with-accounting); skipped, with the reason,
when sacct says the accounting storage is disabled.

The cpu and the gpu partition's jobs are submitted at once by one module-scoped fixture and run side by
side (their nodes differ): each test's wall time was mostly its job's start, end and slurmdbd's record of
it, now spent beside the other's (issue 27: 16-46 s for the file, one job after the other).
"""

from __future__ import annotations

import re
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from cyclone_kit.analysis.report import write_report
from cyclone_kit.backends.slurm import SlurmBackend
from cyclone_kit.core.proc import run_command
from cyclone_kit.slurm.accounting import accounting_disabled, parse_sacct_usage, sacct_usage_argv
from cyclone_kit.slurm.parse import parse_scontrol_fields
from cyclone_kit.slurm.states import JobState
from tests.helpers.cli import REPO, run_cli

pytestmark = [pytest.mark.slurm]

#: Only bounds a failure (slurmdbd never recording the job); the test waits for the record itself.
_RECORD_DEADLINE_S = 180


def _accounting_or_skip() -> None:
    probe = run_command(["sacct", "--noheader", "--parsable2", "--allocations", "--starttime=now-1minutes"],
                        check=False, timeout=30)
    if not probe.ok and accounting_disabled(probe.stderr + probe.stdout):
        pytest.skip("Slurm accounting storage is disabled on this cluster "
                    "(start it with scripts/local-slurm.sh start --with-accounting)")
    assert probe.ok, probe.stderr


@pytest.fixture(scope="module")
def jobs(slurm_cluster: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, Path, Any]]:
    """Submit the cpu and the gpu job at once, wait for both; partition -> (job id, run dir, final JobInfo)."""
    _accounting_or_skip()
    backend = SlurmBackend()
    submitted: dict[str, tuple[str, Path]] = {}
    try:
        for partition in ("cpu", "gpu"):
            runs = tmp_path_factory.mktemp(f"cost-{partition}")
            gpus = ["--gpus-per-node", "2"] if partition == "gpu" else []  # the gpu nodes' (fake) GPUs
            result = run_cli("submit", str(REPO / "jobs" / "smoke.toml"), "--profile", "local", "--partition",
                             partition, "--nodes", "1", "--ntasks-per-node", "2", *gpus, "--runs-dir", str(runs),
                             "--set", "train.steps=10", timeout=60)
            assert result.returncode == 0, result.stderr
            submitted[partition] = (re.search(r"submitted job (\d+)", result.stdout).group(1),
                                    Path(re.search(r"run dir: (.+)", result.stdout).group(1).strip()))
        return {p: (job_id, run_dir, backend.wait(job_id, timeout=240)) for p, (job_id, run_dir) in submitted.items()}
    finally:
        for job_id, _ in submitted.values():
            backend.cancel(job_id)


@pytest.mark.parametrize("partition", ["cpu", "gpu"])
def test_sacct_device_hours_equal_devices_times_elapsed(jobs: dict[str, tuple[str, Path, Any]], tmp_path: Path,
                                                         partition: str) -> None:
    job_id, run_dir, info = jobs[partition]
    assert info.state is JobState.COMPLETED, info

    # The controller's own start and end times of the job (independent of slurmdbd).
    fields = parse_scontrol_fields(run_command(["scontrol", "show", "job", "-o", job_id], timeout=30).stdout)
    elapsed = (datetime.fromisoformat(fields["EndTime"]) - datetime.fromisoformat(fields["StartTime"])).total_seconds()
    # slurmdbd stores the end of the job shortly after it ends: wait for that record.
    deadline = time.monotonic() + _RECORD_DEADLINE_S
    while True:
        usage = parse_sacct_usage(run_command(sacct_usage_argv([job_id]), timeout=30).stdout)
        if usage and usage[-1].end:
            break
        assert time.monotonic() < deadline, f"sacct has no finished record of job {job_id}: {usage}"
        time.sleep(0.5)

    report = write_report([run_dir], tmp_path / "report")
    runs = pd.read_csv(tmp_path / "report" / "runs.csv")
    assert report.accounting_note == ""
    row = runs.iloc[0]
    # cpu: no GPU in AllocTRES, the 2 ranks are the devices; gpu: AllocTRES gres/gpu=2.
    assert usage[-1].gpus == (2 if partition == "gpu" else 0), usage[-1]
    assert row["device_hours_source"] == "sacct" and int(row["devices"]) == 2
    assert abs(row["device_hours"] * 3600 / 2 - elapsed) <= 1.0, (row["device_hours"], elapsed)
    assert row["elapsed_s"] == usage[-1].elapsed_s
    md = (tmp_path / "report" / "report.md").read_text()
    assert "Device-hours per run (runs.csv, device_hours): 1 from sacct." in md
