"""Issue 4's first "done when": the sbatch route end to end on the local Slurm cluster.

`submit jobs/smoke.toml --profile local --partition cpu --nodes 2 --ntasks-per-node 2` renders
job.sbatch, sbatch runs it, srun starts 4 ranks on c1 and c2, the metrics say so, and `status`
shows COMPLETED. Its `--dry-run` printed, byte for byte, the script Slurm then held for the job
(``scontrol write batch_script``), the run directory's name aside (issue 30).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cyclone_kit.backends.slurm import SlurmBackend
from cyclone_kit.core.proc import run_command
from cyclone_kit.slurm.states import JobState
from tests.helpers.cli import REPO, run_cli

pytestmark = [pytest.mark.slurm]
#: Hang guard (not a performance bound): the 4-rank 10-step job takes ~15 s here, >= 10x.
HANG_S = 240


def test_submit_smoke_on_two_nodes_completes_with_world_size_four(slurm_cluster: dict[str, str], tmp_path: Path) -> None:
    argv = ("submit", str(REPO / "jobs" / "smoke.toml"), "--profile", "local", "--partition", "cpu",
            "--nodes", "2", "--ntasks-per-node", "2", "--runs-dir", str(tmp_path), "--set", "train.steps=10")
    dry = run_cli(*argv, "--dry-run", timeout=HANG_S)
    assert dry.returncode == 0 and not list(tmp_path.iterdir()), dry.stderr
    result = run_cli(*argv, timeout=HANG_S)
    assert result.returncode == 0, result.stderr
    job_id = re.search(r"submitted job (\d+)", result.stdout).group(1)
    run_dir = Path(re.search(r"run dir: (.+)", result.stdout).group(1).strip())
    assert (run_dir / "job.sbatch").is_file() and (run_dir / "job_id").read_text().strip() == job_id
    held = run_command(["scontrol", "write", "batch_script", job_id, "-"], timeout=60).stdout
    shown = re.search(r"^export CYCLONE_RUN_DIR=(\S+)$", dry.stdout, re.M)
    assert shown, dry.stdout
    assert dry.stdout.replace(shown.group(1), str(run_dir)) == held == (run_dir / "job.sbatch").read_text()
    backend = SlurmBackend()
    try:
        info = backend.wait(job_id, timeout=HANG_S)
    finally:
        backend.cancel(job_id)
    assert info.state is JobState.COMPLETED, info
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    start = next(r for r in records if r["kind"] == "start")
    assert (start["world_size"], start["num_nodes"], start["hostnames"], start["slurm_job_id"]) == (4, 2, ["c1", "c2"], job_id)
    assert records[-1]["kind"] == "end" and records[-1]["status"] == "completed" and records[-1]["steps"] == 10
    assert sorted(p.name for p in (run_dir / "ranks").glob("rank-*.json")) == [f"rank-{r:05d}.json" for r in range(4)]
    status = run_cli("status", str(run_dir))
    assert status.returncode == 0 and re.search(rf"^{job_id}\s+smoke\s+COMPLETED\s+2\s", status.stdout, re.M), status.stdout
