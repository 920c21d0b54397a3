"""Each non-DDP strategy as a real job on the local Slurm cluster: jobs/smoke.toml on 2 nodes x 1 task.

``submit ... --set train.strategy=S``; the job must complete with the metrics contract under the
chosen strategy. Horovod runs through templates/horovod.sbatch.j2 on 2 nodes x 2 tasks (Horovod's
global, local and cross-node groups all have 2+ members): srun starts the ranks and, the build here
being Gloo-only, cyclone_kit runs Horovod's Gloo rendezvous from inside the job (runtime/hvd.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cyclone_kit.backends.slurm import SlurmBackend
from cyclone_kit.slurm.states import JobState
from tests.helpers.slurm_jobs import cancel_quietly, read_records, submit_smoke

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
#: Hang guard (not a performance bound): each 12-step 2-node job takes ~15-25 s here, >= 10x.
HANG_S = 240


@pytest.mark.parametrize("strategy", ["fsdp", "pipeline"])
def test_strategy_job_completes_on_two_nodes(strategy: str, slurm_cluster: dict[str, str], tmp_path: Path) -> None:
    backend = SlurmBackend(timeout=30)
    job_id, run_dir = submit_smoke(tmp_path, "--nodes", "2", "--ntasks-per-node", "1",
                                   sets=(f"train.strategy={strategy}", "train.steps=12"))
    try:
        info = backend.wait(job_id, timeout=HANG_S)
    finally:
        cancel_quietly(backend, job_id)
    recs = read_records(run_dir)
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted((run_dir / "logs").glob("*")) if p.is_file())
    assert info.state is JobState.COMPLETED, f"job {job_id} {info.state}\n{logs}"
    start, end = recs[0], recs[-1]
    print(f"{strategy} on Slurm: job {job_id} on {start['hostnames']}, final loss "
          f"{[r['loss'] for r in recs if r['kind'] == 'step'][-1]:.4f}, {end['samples_per_s']:.0f} samples/s")
    assert start["strategy"] == strategy and start["world_size"] == 2 and start["num_nodes"] == 2
    assert start["launcher"] == "slurm" and sorted(start["hostnames"]) == ["c1", "c2"]
    assert end["kind"] == "end" and end["status"] == "completed" and end["steps"] == 12
    assert sorted(p.name for p in (run_dir / "ranks").glob("rank-*.json")) == ["rank-00000.json", "rank-00001.json"]
    assert any((run_dir / "checkpoints").glob("ckpt-000000012.pt"))


def test_horovod_job_completes_on_two_nodes_with_ranks_from_srun(slurm_cluster: dict[str, str], tmp_path: Path) -> None:
    try:
        import horovod.torch  # noqa: F401
    except Exception as exc:
        pytest.skip(f"Horovod not importable ({type(exc).__name__}); build it with scripts/build-horovod.sh")
    backend = SlurmBackend(timeout=30)
    job_id, run_dir = submit_smoke(tmp_path, "--nodes", "2", "--ntasks-per-node", "2",
                                   sets=("train.strategy=horovod", "resources.launcher=horovod", "train.steps=12"))
    try:
        info = backend.wait(job_id, timeout=HANG_S)
    finally:
        cancel_quietly(backend, job_id)
    script = (run_dir / "job.sbatch").read_text()
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted((run_dir / "logs").glob("*")) if p.is_file())
    assert info.state is JobState.COMPLETED, f"job {job_id} {info.state}\n{logs}"
    assert "horovodrun" not in script and "srun --kill-on-bad-exit=1" in script
    recs = read_records(run_dir)
    start, end = recs[0], recs[-1]
    print(f"horovod on Slurm: job {job_id}, {start['world_size']} ranks on {start['hostnames']}, final loss "
          f"{[r['loss'] for r in recs if r['kind'] == 'step'][-1]:.4f}")
    assert (start["strategy"], start["world_size"], start["num_nodes"], start["launcher"]) == ("horovod", 4, 2, "slurm")
    assert sorted(start["hostnames"]) == ["c1", "c2"]
    assert end["kind"] == "end" and end["status"] == "completed" and end["steps"] == 12
    assert len(list((run_dir / "ranks").glob("rank-*.json"))) == 4
    assert any((run_dir / "checkpoints").glob("ckpt-000000012.pt"))
