"""`--backend submitit` against the local Slurm cluster: the training callable on 2 nodes x 2 tasks."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cyclone_kit.backends.slurm import SlurmBackend
from cyclone_kit.backends.submitit_ import SubmititBackend
from cyclone_kit.slurm.states import JobState
from tests.helpers.cli import REPO, run_cli

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
#: Hang guard (not a performance bound): the 4-rank 10-step job takes ~15-20 s here, >= 10x.
HANG_S = 240


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_submit_backend_submitit_runs_four_ranks_on_two_nodes(slurm_cluster: dict[str, str], tmp_path: Path) -> None:
    """Issue 4: `submit jobs/smoke.toml --nodes 2 --ntasks-per-node 2` through `--backend submitit`; issue 30:
    its `--dry-run` printed, byte for byte, the batch script submitit then wrote and Slurm ran."""
    argv = ("submit", str(REPO / "jobs" / "smoke.toml"), "--profile", "local", "--partition", "cpu",
            "--nodes", "2", "--ntasks-per-node", "2", "--backend", "submitit", "--runs-dir", str(tmp_path),
            "--set", "train.steps=10")
    dry = run_cli(*argv, "--dry-run", timeout=HANG_S)
    assert dry.returncode == 0 and not list(tmp_path.iterdir()), dry.stderr
    result = run_cli(*argv, timeout=HANG_S)
    assert result.returncode == 0, result.stderr
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    job_id = (run_dir / "job_id").read_text().strip()
    backend = SlurmBackend()
    try:
        info = backend.wait(job_id, timeout=HANG_S)
    finally:
        backend.cancel(job_id)
    records = _records(run_dir)
    start = next(r for r in records if r["kind"] == "start")
    assert (start["world_size"], start["hostnames"], start["launcher"], start["slurm_job_id"]) == (
        4, ["c1", "c2"], "submitit", job_id)
    assert [r for r in records if r["kind"] == "end"][-1]["status"] == "completed"
    assert info.state is JobState.COMPLETED, info
    script = next((run_dir / "submitit").glob("*_submission.sh")).read_text()
    assert "#SBATCH --nodes=2" in script and "#SBATCH --ntasks-per-node=2" in script
    assert "#SBATCH --signal=USR2@60" in script and "--cpus-per-task 1" in script
    # The dry run named its run directory for the second it ran in; the rest is the same text.
    shown = re.search(r"^export CYCLONE_RUN_DIR=(\S+)$", dry.stdout, re.M)
    assert shown, dry.stdout
    assert dry.stdout.replace(shown.group(1), str(run_dir)) == script, "the dry run is what submitit wrote"
    out = "".join(p.read_text() for p in (run_dir / "submitit").glob("*_0_log.out"))
    assert re.search(r"^cyclone_kit: job \d+ on c\[1-2\] master c1:\d+ restart 0$", out, re.M), out[-2000:]


def test_dependency_is_passed_to_sbatch(submit, tmp_path: Path) -> None:
    from cyclone_kit.config.job import load_spec
    from cyclone_kit.config.profile import load_profile
    from cyclone_kit.config.validate import resolve, spec_json
    from cyclone_kit.rundir.layout import create_run_dir

    job = resolve(load_spec(REPO / "jobs" / "smoke.toml"), load_profile("local"))
    run_dir = create_run_dir(tmp_path, "dep", {"spec.json": spec_json(job)})
    backend = SlurmBackend()
    sub = SubmititBackend(executor="slurm")
    blocker, _ = submit("true", name="blocker", begin="now+1hour")  # pending for an hour (cancelled after)
    job_id = sub.submit_run(job, run_dir, dependency=f"afterok:{blocker}")
    try:
        info = backend.status(job_id)
        assert info.state is JobState.PENDING, info
        script = next((run_dir / "submitit").glob("*_submission.sh")).read_text()
        assert f"#SBATCH --dependency=afterok:{blocker}" in script
    finally:
        backend.cancel(job_id)
