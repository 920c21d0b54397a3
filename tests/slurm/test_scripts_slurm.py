"""User scripts, unchanged, as real jobs on the local Slurm cluster: ``submit SCRIPT.py --nodes 2
--ntasks-per-node 2 -- ARGS`` trains with world size 4 on c1 and c2 through the launch shim (srun,
torchrun and horovod launchers), and a strong sweep of a script ends in a time-to-solution report.

The examples' jobs, torchrun's and the failing script's are submitted at once by one module-scoped fixture:
a script's job takes its nodes' 4 CPUs (shared among its tasks), so the cpu partition's jobs still run one
after the other, each as soon as the one before ends, while torchrun's job runs on the gpu partition beside
them (issue 27: 85-107 s for the file, each job submitted after the one before had been waited for).
"""

from __future__ import annotations

import csv
import importlib.util
import json
import re
import textwrap
from pathlib import Path
from typing import Any

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


def _submit(tmp_path: Path, script: Path, *options: str, args: tuple[str, ...] = ()) -> tuple[str, Path]:
    """Submit ``script`` on the local profile; (job id, run dir)."""
    result = run_cli("submit", str(script), "--profile", "local", "--time", "00:10:00",
                     "--runs-dir", str(tmp_path), *options, "--", *args, timeout=60)
    assert result.returncode == 0, result.stderr
    return parse_submit_output(result.stdout)


def _logs(run_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted((run_dir / "logs").glob("*")) if p.is_file())


def _completed(job: tuple[str, Path, Any]) -> tuple[str, Path, str]:
    """(job id, run dir, the job's output) of a job that must have ended COMPLETED."""
    job_id, run_dir, info = job
    logs = _logs(run_dir)
    assert info.state is JobState.COMPLETED, f"job {job_id} {info.state}\n{logs[-6000:]}"
    return job_id, run_dir, logs


#: example -> (the module it needs, submit's options, its arguments)
EXAMPLE_JOBS = {
    "plain_ddp.py": (None, (), ("--steps", "8")),
    "lightning_example.py": ("lightning", (), ("--max-steps", "4")),
    "accelerate_example.py": ("accelerate", (), ("--steps", "4")),
    "horovod_example.py": ("horovod.torch", ("--launcher", "horovod"), ("--steps", "4")),
}
FAILS = textwrap.dedent("""
    import threading
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method="env://")
    dist.barrier()
    if dist.get_rank() == 2:
        raise ValueError("boom on rank two")
    threading.Event().wait()   # the other ranks wait for ever: only srun can end them
    print("must not happen")
""")
#: pytest-timeout of the first test of the fixture's jobs: each job's wait is bounded by WAIT_S, one after the other
JOBS_TIMEOUT_S = (len(EXAMPLE_JOBS) + 2) * WAIT_S + 180


def _unimportable(module: str | None) -> str:
    """Why ``module`` does not import ("" when it does, or when there is none)."""
    if module is None:
        return ""
    try:
        importlib.import_module(module)
    except Exception as exc:
        return f"{module} not importable ({type(exc).__name__}: {exc})"
    return ""


#: job name -> the job's live processes once the fixture saw it end
left: dict[str, dict[int, Any]] = {}


@pytest.fixture(scope="module")
def jobs(slurm_cluster: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, Path, Any]]:
    """Submit every example's job (where its framework imports), torchrun's and the failing script's at once;
    wait for each; name -> (job id, run dir, final JobInfo). Each job's live processes once its end was seen:
    ``left[name]``."""
    backend = SlurmBackend(timeout=30)
    submitted: dict[str, tuple[str, Path]] = {}
    try:
        for example, (needs, options, args) in EXAMPLE_JOBS.items():
            if not _unimportable(needs):  # else its test skips, saying why
                submitted[example] = _submit(tmp_path_factory.mktemp(example[:-3]), EXAMPLES / example, "--nodes",
                                             "2", "--ntasks-per-node", "2", *options, args=args)
        # torchrun starts one process per GPU: the gpu partition's fake GPUs, 2 per node (CPU training, gloo)
        submitted["torchrun"] = _submit(tmp_path_factory.mktemp("torchrun"), EXAMPLES / "plain_ddp.py", "--partition",
                                        "gpu", "--nodes", "2", "--gpus-per-node", "2", "--launcher", "torchrun",
                                        args=("--steps", "8"))
        script = tmp_path_factory.mktemp("fails") / "fails.py"
        script.write_text(FAILS)
        submitted["fails"] = _submit(script.parent / "runs", script, "--time", "00:05:00", "--nodes", "2",
                                     "--ntasks-per-node", "2")
        out = {}
        for name, (job_id, run_dir) in submitted.items():  # the failing script's last: it runs last, its wait ends
            out[name] = (job_id, run_dir, backend.wait(job_id, timeout=WAIT_S))  # when it ends
            left[name] = job_processes(job_id)  # its processes left the moment its end was seen
        return out
    finally:
        for job_id, _ in submitted.values():
            cancel_quietly(backend, job_id)


def _shim(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "shim.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.timeout(JOBS_TIMEOUT_S)
@pytest.mark.parametrize("example", list(EXAMPLE_JOBS))
def test_example_trains_with_world_size_4_on_two_nodes(example: str, jobs: dict[str, tuple[str, Path, Any]]) -> None:
    if why := _unimportable(EXAMPLE_JOBS[example][0]):
        pytest.skip(why)
    job_id, run_dir, logs = _completed(jobs[example])
    ranks = rank_lines(logs, example[:-3])
    print(f"{example} on Slurm: job {job_id}, ranks {ranks}")
    assert ranks == [(0, 4, "c1"), (1, 4, "c1"), (2, 4, "c2"), (3, 4, "c2")], logs[-4000:]
    start, end = _shim(run_dir)
    assert (start["world_size"], start["num_nodes"], start["hostnames"], start["slurm_job_id"]) == (
        4, 2, ["c1", "c2"], job_id)
    assert (end["status"], end["exit_code"]) == ("completed", 0)
    assert "cyclone_kit.runtime.launch" in (run_dir / "job.sbatch").read_text()


@pytest.mark.timeout(JOBS_TIMEOUT_S)
def test_plain_ddp_under_the_torchrun_launcher(jobs: dict[str, tuple[str, Path, Any]]) -> None:
    job_id, run_dir, logs = _completed(jobs["torchrun"])
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


@pytest.mark.timeout(JOBS_TIMEOUT_S)
def test_a_script_failing_on_one_rank_fails_the_job_with_the_root_cause_and_no_rank_left(
        jobs: dict[str, tuple[str, Path, Any]]) -> None:
    job_id, run_dir, info = jobs["fails"]
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
    assert left["fails"] == {}
