"""A user script on the public API, on the real local Slurm cluster (issue 14, "done when" bullet 2).

examples/ddp_ck.py runs as a 2-node x 1-task job (srun, gloo) from a hand-written sbatch script,
the way a user would write one. Both ranks wait after optimizer step HOLD_STEP
(tests/helpers/slow_parts.py, on the job's PYTHONPATH) until the test's requeue signal has reached
them (``scancel --signal=USR2``: what ``#SBATCH --signal=USR2@LEAD`` makes Slurm do before the
time limit), so the signal lands mid-run at any machine speed. Both ranks stop after the same step, rank 0 checkpoints and runs
``scontrol requeue``; Slurm starts the job again (SLURM_RESTART_COUNT=1), ``ck.load_checkpoint()``
resumes it and it completes: every optimizer step logged exactly once across both segments.

The same again through ``cyclone-kit submit examples/ddp_ck.py`` (the generated script, the launch
shim in front of the script on every rank), with ``checkpoint.poll_s=0`` from the command line.

Both jobs are submitted at once by one module-scoped fixture and run side by side on c1 and c2 (1 CPU
of each node's 4 per job), each held and signalled on its own hold files: a test's wall time was mostly
its job's requeue round trip (the stop, Slurm's requeue, the second segment's start), and the two
round trips now overlap (issue 27: 66-77 s for the file, one job after the other).
"""

from __future__ import annotations

import datetime
import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from cyclone_kit.backends.slurm import SlurmBackend
from cyclone_kit.core.proc import run_command
from cyclone_kit.runtime import checkpoint as ckpt
from cyclone_kit.slurm.states import JobState
from tests.helpers.cli import REPO, run_cli
from tests.helpers.slow_parts import hold_files, slow_parts_env
from tests.helpers.slurm_jobs import cancel_quietly, parse_submit_output, read_records, wait_for

#: pytest-timeout of a test, the first with the module fixture's two jobs: the waits of each job (first steps, a
#: requeue, a resume) are each bounded below it.
pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(1800)]

STEPS = 40
#: both ranks wait after this optimizer step of the first segment until the signal reached them
HOLD_STEP = 3


def signal_while_held(job_id: str, run_dir: Path, holds: Any) -> None:
    """Once both ranks are held after HOLD_STEP, send the requeue signal; let them go once both got it."""
    try:
        wait_for(lambda: holds.at(HOLD_STEP, range(2)), 300, f"both ranks held after step {HOLD_STEP}", poll=0.1)
        run_command(["scancel", "--signal=USR2", job_id], timeout=30)
        wait_for(lambda: holds.signalled(range(2)), 120, "the signal to reach both ranks", poll=0.1)
    finally:
        holds.go()  # never leave a rank held (a failed wait above would leave it waiting forever)
    wait_for(lambda: [r for r in read_records(run_dir) if r["kind"] == "end"], 120, "the stop", poll=0.2)


def sbatch_script(run_dir: Path) -> str:
    """A plain user-written batch script: srun one task per node, the requeue signal, requeue allowed."""
    return textwrap.dedent(f"""\
        #!/bin/bash
        #SBATCH --job-name=ddp-ck
        #SBATCH --nodes=2
        #SBATCH --ntasks-per-node=1
        #SBATCH --cpus-per-task=1
        #SBATCH --partition=cpu
        #SBATCH --time=10
        #SBATCH --output={run_dir}/logs/%x-%j.out
        #SBATCH --error={run_dir}/logs/%x-%j.err
        #SBATCH --open-mode=append
        #SBATCH --signal=USR2@60
        #SBATCH --requeue
        set -eo pipefail
        export CYCLONE_RUN_DIR={run_dir}
        export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)"
        export MASTER_PORT="$({sys.executable} -m cyclone_kit.core.ports 15000 16000 "$SLURM_JOB_ID")"
        echo "job $SLURM_JOB_ID restart ${{SLURM_RESTART_COUNT:-0}}"
        srun --kill-on-bad-exit=1 {sys.executable} {REPO / "examples" / "ddp_ck.py"} --steps {STEPS} --batch-size 32
    """)


@pytest.fixture(scope="module")
def jobs(slurm_cluster: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Submit the hand-written job and the ``cyclone-kit submit`` job at once; signal each once held; wait for both.

    name -> (job id, run dir, final JobInfo)."""
    backend = SlurmBackend()
    holds: dict[str, Any] = {}
    submitted: dict[str, tuple[str, Path]] = {}
    try:
        # the hand-written script's job
        tmp = tmp_path_factory.mktemp("ddp-ck-sbatch")
        run_dir = tmp / "ddp-ck"
        (run_dir / "logs").mkdir(parents=True)
        (run_dir / "spec.json").write_text(json.dumps({"train": {"log_every": 1}, "checkpoint": {"poll_s": 0}}))
        script = tmp / "job.sbatch"
        script.write_text(sbatch_script(run_dir))
        holds["sbatch"] = hold_files(tmp / "parts")
        env = slow_parts_env(tmp / "parts", hold_step=HOLD_STEP)  # sbatch passes its environment on
        job_id = run_command(["sbatch", "--parsable", str(script)], timeout=60, env=env).stdout.strip().split(";")[0]
        submitted["sbatch"] = (job_id, run_dir)
        # the same script through cyclone-kit submit; --cpus-per-task 1 as in the hand-written script (a script's
        # default is its node's 4 CPUs shared among its tasks, which would leave no room for the other job)
        tmp = tmp_path_factory.mktemp("ddp-ck-cli")
        holds["cli"] = hold_files(tmp / "parts")
        result = run_cli("submit", str(REPO / "examples" / "ddp_ck.py"), "--profile", "local", "--partition", "cpu",
                         "--nodes", "2", "--ntasks-per-node", "1", "--cpus-per-task", "1", "--time", "00:10:00",
                         "--runs-dir", str(tmp), "--set", "checkpoint.poll_s=0", "--", "--steps", str(STEPS),
                         "--batch-size", "32",
                         env={"CYCLONE_LOG_EVERY": "1", **slow_parts_env(tmp / "parts", hold_step=HOLD_STEP)},
                         timeout=60)
        assert result.returncode == 0, result.stderr
        submitted["cli"] = parse_submit_output(result.stdout)
        for name, (job_id, run_dir) in submitted.items():
            signal_while_held(job_id, run_dir, holds[name])
        return {name: (job_id, run_dir, backend.wait(job_id, timeout=300))
                for name, (job_id, run_dir) in submitted.items()}
    finally:
        for name, (job_id, _) in submitted.items():
            holds[name].go()  # never leave a rank held (a failed wait for the first job skips the second's)
            cancel_quietly(backend, job_id)


def test_ddp_ck_is_signalled_checkpoints_is_requeued_and_resumes_every_step_once(jobs: dict[str, Any]) -> None:
    job_id, run_dir, info = jobs["sbatch"]
    records: list[dict[str, Any]] = read_records(run_dir)
    out = "".join(p.read_text() for p in sorted((run_dir / "logs").glob("*.out")))
    starts = [r for r in records if r["kind"] == "start"]
    ends = [r for r in records if r["kind"] == "end"]
    assert info.state is JobState.COMPLETED, (info, out[-3000:])
    assert [e["status"] for e in ends] == ["preempted", "completed"], (ends, out[-3000:])
    stopped = ends[0]["steps"]
    assert HOLD_STEP <= stopped <= HOLD_STEP + 3, f"held after step {HOLD_STEP}, stopped after {stopped}"
    assert [s["restart_count"] for s in starts] == [0, 1]
    assert [s["slurm_job_id"] for s in starts] == [job_id, job_id]
    assert [s["world_size"] for s in starts] == [2, 2] and starts[0]["hostnames"] == ["c1", "c2"]
    assert starts[1]["start_step"] == stopped, "the second segment resumed from the stop checkpoint"
    steps = [r["step"] for r in records if r["kind"] == "step"]
    assert steps == list(range(1, STEPS + 1)), "every optimizer step exactly once, in order, across the requeue"
    assert "requeue 1 of at most 3" in out and "restart 1" in out, out[-3000:]
    assert next(s for s, _ in ckpt.list_checkpoints(run_dir / "checkpoints")) == stopped
    assert not list((run_dir / "ranks").glob("error-rank-*.json")), "a clean requeue is no failure"
    when = [datetime.datetime.fromisoformat(r["time"]) for r in (ends[0], starts[1])]
    print(f"ddp_ck.py job {job_id}: stopped at step {stopped}/{STEPS} on the signal; requeue round trip "
          f"(preempted end record -> next start record) {(when[1] - when[0]).total_seconds():.1f} s")


def test_ddp_ck_submitted_by_cyclone_kit_is_requeued_and_resumes_every_step_once(jobs: dict[str, Any]) -> None:
    job_id, run_dir, info = jobs["cli"]
    steps = STEPS
    records = read_records(run_dir)
    out = "".join(p.read_text(errors="replace") for p in sorted((run_dir / "logs").glob("*")) if p.is_file())
    starts = [r for r in records if r["kind"] == "start"]
    ends = [r for r in records if r["kind"] == "end"]
    assert info.state is JobState.COMPLETED, (info, out[-3000:])
    assert [e["status"] for e in ends] == ["preempted", "completed"], (ends, out[-3000:])
    stopped = ends[0]["steps"]
    assert HOLD_STEP <= stopped <= HOLD_STEP + 3, f"held after step {HOLD_STEP}, stopped after {stopped}"
    assert [(s["restart_count"], s["world_size"], s["strategy"]) for s in starts] == [(0, 2, "script"), (1, 2, "script")]
    assert starts[1]["start_step"] == stopped
    assert [r["step"] for r in records if r["kind"] == "step"] == list(range(1, steps + 1)), "every step exactly once"
    assert "requeue 1 of at most 3" in out, out[-3000:]
    assert not list((run_dir / "ranks").glob("error-rank-*.json")), "a clean requeue is no failure"
    print(f"cyclone-kit submit examples/ddp_ck.py job {job_id}: stopped at step {stopped}/{steps}, requeued, resumed")
