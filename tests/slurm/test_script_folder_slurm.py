"""A user's script as it is, on the real local Slurm cluster (issue 21), in the patterns of published
scripts: relative ``./data`` and ``./ckpt.pt`` in the folder ``submit`` ran in, a requeue that runs
the snapshot taken at submission although the code changed meanwhile, a second submit that resumes
from the first one's checkpoint, a bare ``accelerate.Accelerator()`` on CPU nodes (world 4 with the
shim's ACCELERATE_USE_CPU=1; 4 independent copies, said so, when the user turns it off) and
torchrun with 2 workers per node on 2 CPU nodes (world 4)."""

from __future__ import annotations

import contextlib
import importlib
import json
import re
import textwrap
import time
from pathlib import Path

import pytest

from cyclone_kit.backends.slurm import SlurmBackend
from cyclone_kit.core.errors import CycloneError
from cyclone_kit.slurm.states import JobState
from tests.helpers.cli import REPO, run_cli
from tests.helpers.slurm_jobs import rank_lines, worker_outputs

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

#: Hang guard for one job (not a performance bound): a requeued job waits cred_expire (10 s here) and more before
#: its second segment; torch/accelerate imports of 4 ranks on 2 busy cores take ~60 s.
WAIT_S = 420

#: A script in the published pattern: ./data and ./ckpt.pt relative to where it was submitted, a sibling
#: package, no cyclone_kit. The first segment of a job asked to (./requeue-me) checkpoints and requeues itself.
SCRIPT = textwrap.dedent("""
    import json, os, socket, subprocess, time
    from pathlib import Path

    segment = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    if segment > 0 and Path("./wait-for-edit").exists():   # the test's moment: the code changed before this import
        while not Path("./edited").exists():
            time.sleep(0.1)

    import helpers

    rank = int(os.environ["RANK"])
    n = int(Path("./data/n.txt").read_text())
    Path(f"./out-{segment}-rank{rank}.json").write_text(json.dumps(
        {"cwd": os.getcwd(), "file": __file__, "version": helpers.VERSION, "host": socket.gethostname()}))
    if rank == 0:
        ckpt = Path("./ckpt.pt")
        done = int(ckpt.read_text()) if ckpt.exists() else 0
        ckpt.write_text(str(done + n))
        print(f"folder_script: segment {segment} resumed from {done}, saved {done + n}", flush=True)
        if segment == 0 and Path("./requeue-me").exists():
            while not all(Path(f"./out-0-rank{r}.json").exists() for r in range(int(os.environ["WORLD_SIZE"]))):
                time.sleep(0.1)   # every rank has recorded the first segment before it is ended
            Path("./requeue-me").unlink()   # first: the requeue's SIGTERM may end this rank at once
            subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=True)
            time.sleep(600)   # Slurm ends this segment (the requeue) and starts the job again
""")


def _submit(cwd: Path, *argv: str, env: dict[str, str] | None = None) -> tuple[str, Path]:
    own, script_args = (argv[:argv.index("--")], argv[argv.index("--"):]) if "--" in argv else (argv, ())
    proc = run_cli("submit", *own, "--profile", "local", "--time", "00:10:00", "--runs-dir", str(cwd / "runs"),
                   *script_args, cwd=cwd, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = re.search(r"^submitted job (\d+)$", proc.stdout, re.M)
    run_dir = re.search(r"^run dir: (.+)$", proc.stdout, re.M)
    assert job and run_dir, proc.stdout
    return job.group(1), Path(run_dir.group(1))


def _wait(job_id: str, run_dir: Path) -> str:
    """Wait for the job to end COMPLETED; returns its logs (cancelled when the wait fails)."""
    backend = SlurmBackend(timeout=30)
    try:
        info = backend.wait(job_id, timeout=WAIT_S)
    finally:
        with contextlib.suppress(CycloneError):  # a job left running by a failed wait
            backend.cancel(job_id)
    logs = "\n".join(p.read_text(errors="replace") for p in sorted((run_dir / "logs").glob("*")) if p.is_file())
    assert info.state is JobState.COMPLETED, f"job {job_id} {info.state}\n{logs[-6000:]}"
    return logs


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _project(folder: Path) -> Path:
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "n.txt").write_text("5\n")
    (folder / "helpers").mkdir()
    (folder / "helpers" / "__init__.py").write_text("VERSION = 1\n")
    (folder / "train.py").write_text(SCRIPT)
    return folder


@pytest.mark.timeout(3 * WAIT_S)
def test_a_script_works_in_its_submit_folder_through_a_requeue_and_a_second_submit(slurm_cluster: dict[str, str],
                                                                                   tmp_path: Path) -> None:
    proj = _project(tmp_path / "proj")
    (proj / "requeue-me").write_text("")
    (proj / "wait-for-edit").write_text("")  # the second segment imports its package only after the edit below
    job_id, run_dir = _submit(proj, "train.py", "--nodes", "2", "--ntasks-per-node", "1")
    deadline = time.monotonic() + WAIT_S
    while not (proj / "out-0-rank0.json").exists() or (proj / "requeue-me").exists():
        assert time.monotonic() < deadline, f"job {job_id}: the first segment did not start"
        time.sleep(0.2)
    # the code changes while the job is requeued: its second segment still runs what was submitted
    (proj / "helpers" / "__init__.py").write_text("VERSION = 2\n")
    (proj / "edited").write_text("")
    _wait(job_id, run_dir)
    first = [json.loads((proj / f"out-{seg}-rank{r}.json").read_text()) for seg in (0, 1) for r in (0, 1)]
    print(f"requeued job {job_id}: {first}")
    assert {(o["cwd"], o["version"], o["file"]) for o in first} == {
        (str(proj), 1, str(proj / "train.py"))}  # the snapshot ran (VERSION 1), __file__ is the script's own
    assert {o["host"] for o in first} == {"c1", "c2"}
    assert (proj / "ckpt.pt").read_text() == "10"  # the requeued segment resumed from the first one's checkpoint
    assert not (run_dir / "ckpt.pt").exists() and not (run_dir / "failure.json").exists()
    starts = [r for r in _records(run_dir / "shim.jsonl") if r["kind"] == "start"]
    spec = json.loads((run_dir / "spec.json").read_text())["script"]
    assert [s["restart_count"] for s in starts] == [0, 1] and spec["chdir"] == str(proj)
    assert {s["sha256"] for s in starts} == {spec["sha256"]}  # the recorded hash is the one that ran
    assert f"cd {proj}" in (run_dir / "job.sbatch").read_text()

    # a second submit from the same folder resumes from the first job's checkpoint, with the new code
    job2, run2 = _submit(proj, "train.py", "--nodes", "2", "--ntasks-per-node", "1")
    logs = _wait(job2, run2)
    assert "folder_script: segment 0 resumed from 10, saved 15" in logs
    assert json.loads((proj / "out-0-rank0.json").read_text())["version"] == 2


ACCELERATE = textwrap.dedent("""
    import json, os, socket, time
    from pathlib import Path
    from accelerate import Accelerator   # bare: no cpu=True, as published examples write it

    acc = Accelerator()
    Path(f"./acc-rank{os.environ['RANK']}.json").write_text(json.dumps(
        {"index": acc.process_index, "processes": acc.num_processes, "type": str(acc.distributed_type),
         "host": socket.gethostname()}))
    acc.wait_for_everyone()   # as a training loop's collectives would (a no-op for independent copies)
    # Independent copies still built one gloo group of the 4 ranks (torchrun's variables): a copy that ends
    # while a slower one is still connecting resets it ("Connection reset by peer", seen in CI). Stay until
    # every rank has got past Accelerator(), as a real training run of any length would.
    while not all(Path(f"./acc-rank{r}.json").exists() for r in range(int(os.environ["WORLD_SIZE"]))):
        time.sleep(0.1)
""")


@pytest.mark.timeout(2 * WAIT_S + 120)
@pytest.mark.parametrize("use_cpu", ["", "0"])
def test_a_bare_accelerator_on_cpu_nodes_joins_the_ranks_or_is_reported_as_independent_copies(
        use_cpu: str, slurm_cluster: dict[str, str], tmp_path: Path) -> None:
    try:
        importlib.import_module("accelerate")
    except Exception as exc:
        pytest.skip(f"accelerate not importable ({type(exc).__name__}: {exc})")
    (tmp_path / "acc.py").write_text(ACCELERATE)
    job_id, run_dir = _submit(tmp_path, "acc.py", "--nodes", "2", "--ntasks-per-node", "2",
                              env={"ACCELERATE_USE_CPU": use_cpu} if use_cpu else None)
    _wait(job_id, run_dir)
    seen = [json.loads((tmp_path / f"acc-rank{r}.json").read_text()) for r in range(4)]
    end = _records(run_dir / "shim.jsonl")[-1]
    status = run_cli("status", str(run_dir), cwd=tmp_path, timeout=60)
    print(f"bare Accelerator, ACCELERATE_USE_CPU={use_cpu or '(cyclone_kit: 1)'}: job {job_id} {seen}; {end}")
    if not use_cpu:  # the shim set ACCELERATE_USE_CPU=1: one world of 4 over gloo
        assert [(s["index"], s["processes"]) for s in seen] == [(0, 4), (1, 4), (2, 4), (3, 4)]
        assert end["process_group_world"] == 4 and "warning" not in end
        assert "independent copies" not in status.stdout
    else:  # the user turned it off: 4 copies, each alone, and every record says so
        assert [(s["index"], s["processes"]) for s in seen] == [(0, 1)] * 4
        assert end["warning"].startswith("4 ranks ran as 4 independent copies")
        assert "4 ranks ran as 4 independent copies" in status.stdout, status.stdout
        metrics_end = _records(run_dir / "metrics.jsonl")[-1]
        assert metrics_end["warning"] == end["warning"]  # the time-to-solution record carries it to the report


@pytest.mark.timeout(WAIT_S + 120)
def test_torchrun_with_two_workers_per_cpu_node_trains_with_world_4(slurm_cluster: dict[str, str],
                                                                      tmp_path: Path) -> None:
    job_id, run_dir = _submit(tmp_path, str(REPO / "examples" / "plain_ddp.py"), "--launcher", "torchrun",
                              "--nodes", "2", "--ntasks-per-node", "2", "--cpus-per-task", "2", "--", "--steps", "6")
    logs = _wait(job_id, run_dir)
    outputs = worker_outputs(run_dir, job_id)   # one file per worker: the workers of a node share a pipe
    ranks = sorted(rank for text in outputs for rank in rank_lines(text, "plain_ddp"))
    print(f"torchrun 2 x 2 workers on cpu nodes: job {job_id}, ranks {ranks} from {len(outputs)} worker files")
    assert len(outputs) == 4, logs[-4000:]
    assert [(r, w) for r, w, _ in ranks] == [(0, 4), (1, 4), (2, 4), (3, 4)], logs[-4000:]
    assert {h for _, _, h in ranks} == {"c1", "c2"}
    text = (run_dir / "job.sbatch").read_text()
    assert "--nproc-per-node=2" in text and "#SBATCH --ntasks-per-node=1" in text
    start, end = _records(run_dir / "shim.jsonl")
    assert (start["world_size"], start["launcher"], end["status"], end["process_group_world"]) == (
        4, "torchrun", "completed", 4)
