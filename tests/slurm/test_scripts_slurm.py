"""User scripts, unchanged, as real jobs on the local Slurm cluster: ``submit SCRIPT.py --nodes 2
--ntasks-per-node 2 -- ARGS`` trains with world size 4 on c1 and c2 through the launch shim (srun,
torchrun and horovod launchers), and a strong sweep of a script ends in a time-to-solution report."""

from __future__ import annotations

import csv
import importlib.util
import json
import re
import textwrap
from pathlib import Path

import pytest

from cyclone_kit.backends.slurm import SlurmBackend
from cyclone_kit.slurm.states import JobState
from tests.helpers.cli import REPO, run_cli
from tests.helpers.slurm_jobs import cancel_quietly, job_processes, parse_submit_output, rank_lines, worker_outputs

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

EXAMPLES = REPO / "examples"
#: Hang guard for one job (not a performance bound): >= 5x the slowest seen here (Lightning, 4 ranks on
#: 2 busy cores: ~50 s). pytest's own limit is longer, so the guard fires first with the job's logs.
WAIT_S = 420


def _submit_and_wait(tmp_path: Path, script: str, *options: str, args: tuple[str, ...] = ()) -> tuple[str, Path, str]:
    """Submit ``script`` on the local profile, wait for the end; (job id, run dir, the job's output)."""
    result = run_cli("submit", str(EXAMPLES / script), "--profile", "local", "--time", "00:10:00",
                     "--runs-dir", str(tmp_path), *options, "--", *args, timeout=60)
    assert result.returncode == 0, result.stderr
    job_id, run_dir = parse_submit_output(result.stdout)
    backend = SlurmBackend(timeout=30)
    try:
        info = backend.wait(job_id, timeout=WAIT_S)
    finally:
        cancel_quietly(backend, job_id)
    logs = "\n".join(p.read_text(errors="replace") for p in sorted((run_dir / "logs").glob("*")) if p.is_file())
    assert info.state is JobState.COMPLETED, f"job {job_id} {info.state}\n{logs[-6000:]}"
    return job_id, run_dir, logs


def _shim(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "shim.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.timeout(WAIT_S + 180)
@pytest.mark.parametrize(("example", "needs", "options", "args"), [
    ("plain_ddp.py", None, (), ("--steps", "8")),
    ("lightning_example.py", "lightning", (), ("--max-steps", "4")),
    ("accelerate_example.py", "accelerate", (), ("--steps", "4")),
    ("horovod_example.py", "horovod.torch", ("--launcher", "horovod"), ("--steps", "4")),
])
def test_example_trains_with_world_size_4_on_two_nodes(example: str, needs: str | None, options: tuple[str, ...],
                                                       args: tuple[str, ...], slurm_cluster: dict[str, str],
                                                       tmp_path: Path) -> None:
    if needs is not None:
        try:
            importlib.import_module(needs)
        except Exception as exc:
            pytest.skip(f"{needs} not importable ({type(exc).__name__}: {exc})")
    job_id, run_dir, logs = _submit_and_wait(tmp_path, example, "--nodes", "2", "--ntasks-per-node", "2", *options,
                                             args=args)
    ranks = rank_lines(logs, example[:-3])
    print(f"{example} on Slurm: job {job_id}, ranks {ranks}")
    assert ranks == [(0, 4, "c1"), (1, 4, "c1"), (2, 4, "c2"), (3, 4, "c2")], logs[-4000:]
    start, end = _shim(run_dir)
    assert (start["world_size"], start["num_nodes"], start["hostnames"], start["slurm_job_id"]) == (
        4, 2, ["c1", "c2"], job_id)
    assert (end["status"], end["exit_code"]) == ("completed", 0)
    assert "cyclone_kit.runtime.launch" in (run_dir / "job.sbatch").read_text()


@pytest.mark.timeout(WAIT_S + 180)
def test_plain_ddp_under_the_torchrun_launcher(slurm_cluster: dict[str, str], tmp_path: Path) -> None:
    # torchrun starts one process per GPU: the gpu partition's fake GPUs, 2 per node (CPU training, gloo)
    job_id, run_dir, logs = _submit_and_wait(tmp_path, "plain_ddp.py", "--partition", "gpu", "--nodes", "2",
                                             "--gpus-per-node", "2", "--launcher", "torchrun",
                                             args=("--steps", "8"))
    outputs = worker_outputs(run_dir, job_id)   # one file per worker: the workers of a node share a pipe
    ranks = sorted(rank for text in outputs for rank in rank_lines(text, "plain_ddp"))
    print(f"plain_ddp under torchrun on Slurm: job {job_id}, ranks {ranks} from {len(outputs)} worker files")
    assert len(outputs) == 4, logs[-4000:]
    assert [(r, w) for r, w, _ in ranks] == [(0, 4), (1, 4), (2, 4), (3, 4)], logs[-4000:]
    assert {h for _, _, h in ranks} == {"g1", "g2"}
    assert "torch.distributed.run" in (run_dir / "job.sbatch").read_text()
    start, end = _shim(run_dir)
    assert (start["world_size"], start["launcher"], end["status"]) == (4, "torchrun", "completed")


@pytest.mark.timeout(2 * WAIT_S + 180)
def test_strong_sweep_of_a_script_on_slurm_ends_in_scaling_csv(slurm_cluster: dict[str, str], tmp_path: Path) -> None:
    sweep = tmp_path / "sweep.toml"
    sweep.write_text(textwrap.dedent(f"""
        [sweep]
        name = "tts-slurm"
        mode = "strong"
        global_batch_size = 128
        world_sizes = [1, 2]
        serial = true

        [base.script]
        path = {json.dumps(str(EXAMPLES / "plain_ddp.py"))}
        args = ["--steps", "6", "--batch-size", "{{per_device_batch_size}}"]
        [base.resources]
        profile = "local"
        time = "00:10:00"
    """))
    result = run_cli("sweep", str(sweep), "--runs-dir", str(tmp_path / "runs"), "--wait", timeout=2 * WAIT_S)
    study = Path(re.search(r"^study dir: (.+)$", result.stdout, re.M).group(1))
    assert result.returncode == 0, result.stdout + result.stderr
    with open(study / "report" / "scaling.csv") as f:
        rows = list(csv.DictReader(f))
    print(f"script sweep on Slurm: {[(r['world_size'], r['per_device_batch_size'], r['speedup']) for r in rows]}")
    assert [(r["world_size"], r["per_device_batch_size"], r["global_batch_size"], r["strategy"]) for r in rows] == [
        ("1", "128", "128", "time-to-solution"), ("2", "64", "128", "time-to-solution")]


@pytest.mark.timeout(WAIT_S + 180)
def test_a_script_failing_on_one_rank_fails_the_job_with_the_root_cause_and_no_rank_left(
        slurm_cluster: dict[str, str], tmp_path: Path) -> None:
    script = tmp_path / "fails.py"
    script.write_text(textwrap.dedent("""
        import threading
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method="env://")
        dist.barrier()
        if dist.get_rank() == 2:
            raise ValueError("boom on rank two")
        threading.Event().wait()   # the other ranks wait for ever: only srun can end them
        print("must not happen")
    """))
    result = run_cli("submit", str(script), "--profile", "local", "--time", "00:05:00", "--nodes", "2",
                     "--ntasks-per-node", "2", "--runs-dir", str(tmp_path / "runs"), timeout=60)
    assert result.returncode == 0, result.stderr
    job_id, run_dir = parse_submit_output(result.stdout)
    backend = SlurmBackend(timeout=30)
    try:
        info = backend.wait(job_id, timeout=WAIT_S)
    finally:
        cancel_quietly(backend, job_id)
    assert info.state is not JobState.COMPLETED
    status = run_cli("status", str(run_dir), timeout=60)
    print(f"failing script on Slurm: job {job_id} {info.state}; status:\n{status.stdout}{status.stderr}")
    assert "rank 2 on c2" in status.stdout + status.stderr and "ValueError: boom on rank two" in status.stdout + status.stderr
    record = json.loads((run_dir / "ranks" / "error-rank-00002.json").read_text())
    assert record["type"] == "ValueError" and "fails.py" in record["traceback"]
    failure = json.loads((run_dir / "failure.json").read_text())  # written by the rank that raised (issue 21)
    assert (failure["rank"], failure["host"], failure["first"]["type"]) == (2, "c2", "ValueError"), failure
    logs = "\n".join(p.read_text(errors="replace") for p in (run_dir / "logs").glob("*"))
    assert "must not happen" not in logs
    assert job_processes(job_id) == {}
