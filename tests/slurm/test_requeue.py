"""Requeue on the wall-time limit, on the real local Slurm cluster (issue 4, "done when" bullet 3).

Two jobs/smoke.toml jobs run side by side on 2 nodes x 1 task. Neither depends on how fast the
machine trains (issues 12, 27):

* the requeued job (max_requeues=3, a long time limit) is stopped by the test itself, at a moment
  the test makes: both ranks wait after optimizer step HOLD_STEP (tests/helpers/slow_parts.py) until
  ``scancel --signal=USR2`` (exactly what the ``#SBATCH --signal=USR2@LEAD`` would send) has reached
  them, then go on. It checkpoints, runs ``scontrol requeue`` and exits; Slurm starts it again
  (SLURM_RESTART_COUNT=1, never held), it resumes from the checkpoint and completes. The step
  records (log_every=1) must show every optimizer step exactly once across both segments.
* the genuine path: the max_requeues=0 job has ``--time 3`` and ``signal_lead_s=60``, so Slurm
  itself signals it 60-120 s after the start. Each of its steps sleeps STEP_DELAY_S (a floor on
  step time that costs no core: the cores stay free for the other job and tier), so its step count
  cannot be finished by then on any machine. It checkpoints, ends "preempted" and is not requeued.
  Its steps until the signal are most of what it costs: at 0.3 s a step they were 200-400 (its job 23 CPU-s,
  sacct TotalCPU), at 2 s they are 30-60 (12 CPU-s; issue 27). The bound of its progress watchdog (36 s
  with smoke.toml's 60 s process-group timeout) and the signal's 60 s lead stay far above a 2 s step.

Both take about 2 minutes together, most of it the wait for Slurm's own signal.
"""

from __future__ import annotations

import datetime
import time
from pathlib import Path
from typing import Any

import pytest

from cyclone_kit.backends.slurm import SlurmBackend
from cyclone_kit.core.proc import run_command
from cyclone_kit.runtime import checkpoint as ck
from cyclone_kit.slurm.parse import parse_scontrol_job, select_job
from cyclone_kit.slurm.states import JobState
from tests.helpers.slow_parts import hold_files, slow_parts_env
from tests.helpers.slurm_jobs import cancel_quietly, read_records, submit_smoke, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

#: the requeued job's steps: a multiple of smoke.toml's checkpoint.every_steps (10), so its last checkpoint is
#: the last step's either way; 20 (was 40) leaves the second segment >= 14 steps (issue 27)
STEPS = 20
#: the requeued job's ranks wait after this optimizer step until the test's signal reached both
HOLD_STEP = 3
#: the genuine #SBATCH --signal path: Slurm signals 60-120 s after the start (it may signal up to
#: 60 s early); at STEP_DELAY_S or more per step these steps take at least 5 hours
GENUINE_STEPS = 10_000
STEP_DELAY_S = 2.0
COMMON = ("--nodes", "2", "--ntasks-per-node", "1")
DRIVEN = (*COMMON, "--time", "15")
GENUINE = (*COMMON, "--time", "3")
SETS = ("train.log_every=1", "checkpoint.poll_s=0")
#: hang guards only (a broken job); every wait is for an event
HANG_S = 900


def _ends(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_records(run_dir) if r["kind"] == "end"]


def _restarts(job_id: str) -> int:
    """Slurm's own restart counter (``Restarts=`` of scontrol show job)."""
    text = run_command(["scontrol", "show", "job", job_id], timeout=30).stdout
    info = select_job(job_id, parse_scontrol_job(text))
    assert info is not None, text
    fields = dict(item.split("=", 1) for item in text.split() if "=" in item)
    return int(fields["Restarts"])


def _when(record: dict[str, Any]) -> datetime.datetime:
    return datetime.datetime.fromisoformat(record["time"])


@pytest.fixture(scope="module")
def jobs(slurm_cluster: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Submit both jobs at once; signal the requeued one once it trains; wait for both to end."""
    backend = SlurmBackend()
    runs = tmp_path_factory.mktemp("requeue")
    parts = tmp_path_factory.mktemp("requeue-holds")
    holds = hold_files(parts)
    requeued = submit_smoke(runs, *DRIVEN, sets=(*SETS, f"train.steps={STEPS}"),
                            env=slow_parts_env(parts, hold_step=HOLD_STEP))
    limited = submit_smoke(runs, *GENUINE, sets=(*SETS, f"train.steps={GENUINE_STEPS}", "checkpoint.signal_lead_s=60",
                                                 "checkpoint.max_requeues=0"),
                           env=slow_parts_env(tmp_path_factory.mktemp("genuine"), step_delay_s=STEP_DELAY_S))
    submitted = time.monotonic()
    try:
        wait_for(lambda: holds.at(HOLD_STEP, range(2)), HANG_S, f"both ranks held after step {HOLD_STEP}", poll=0.2)
        run_command(["scancel", "--signal=USR2", requeued[0]], timeout=60)
        signalled = time.monotonic()
        wait_for(lambda: holds.signalled(range(2)), HANG_S, "the signal to reach both ranks", poll=0.2)
        holds.go()
        wait_for(lambda: _ends(requeued[1]), HANG_S, "the first segment to stop on the signal", poll=0.2)
        requeued_info = backend.wait(requeued[0], timeout=HANG_S)
        limited_info = backend.wait(limited[0], timeout=HANG_S)
        done = time.monotonic()
    finally:
        holds.go()  # never leave a rank held (a failed wait above would leave it waiting forever)
        cancel_quietly(backend, requeued[0])
        cancel_quietly(backend, limited[0])
    print(f"requeue job {requeued[0]}: signalled {signalled - submitted:.1f} s after submission, "
          f"{requeued_info.state.value} {done - submitted:.1f} s after submission")
    return {"requeued": (*requeued, requeued_info), "limited": (*limited, limited_info)}


def test_signalled_job_checkpoints_requeues_resumes_and_completes(jobs: dict[str, Any]) -> None:
    job_id, run_dir, info = jobs["requeued"]
    records = read_records(run_dir)
    starts = [r for r in records if r["kind"] == "start"]
    ends = [r for r in records if r["kind"] == "end"]
    assert info.state is JobState.COMPLETED, info
    assert [e["status"] for e in ends] == ["preempted", "completed"], ends
    assert [s["restart_count"] for s in starts] == [0, 1], starts
    assert [s["slurm_job_id"] for s in starts] == [job_id, job_id]
    stopped_at = ends[0]["steps"]
    # checkpoint.poll_s 0: the flag raised while held goes into the next step's agreement
    assert HOLD_STEP <= stopped_at <= HOLD_STEP + 3, f"held after step {HOLD_STEP}, stopped after {stopped_at}"
    assert starts[1]["start_step"] == stopped_at, "the second segment resumed from the signal's checkpoint"
    assert ends[1]["steps"] == STEPS
    steps = [r["step"] for r in records if r["kind"] == "step"]
    assert steps == list(range(1, STEPS + 1)), "every optimizer step exactly once, in order, across the requeue"
    assert _restarts(job_id) == 1
    assert not (run_dir / "failure.json").exists(), "a clean requeue is no failure"
    assert not list((run_dir / "ranks").glob("error-rank-*.json")), "a clean requeue is no failure"
    round_trip = (_when(starts[1]) - _when(ends[0])).total_seconds()
    first_segment = (_when(ends[0]) - _when(starts[0])).total_seconds()
    print(f"job {job_id}: signalled after {first_segment:.1f} s of training at step {stopped_at}/{STEPS}; "
          f"requeue round trip (preempted end record -> next start record) {round_trip:.1f} s")
    out = "".join(p.read_text() for p in sorted((run_dir / "logs").glob("*.out")))
    assert "requeue 1 of at most 3" in out, out[-2000:]
    assert f"job {job_id} on c[1-2]" in out and "restart 1" in out, out[-2000:]
    assert next(s for s, _ in ck.list_checkpoints(run_dir / "checkpoints")) == STEPS


def test_max_requeues_zero_stops_preempted_without_requeue(jobs: dict[str, Any]) -> None:
    job_id, run_dir, info = jobs["limited"]
    records = read_records(run_dir)
    starts = [r for r in records if r["kind"] == "start"]
    ends = [r for r in records if r["kind"] == "end"]
    assert len(starts) == 1 and starts[0]["restart_count"] == 0
    assert [e["status"] for e in ends] == ["preempted"], ends
    stopped_at = ends[0]["steps"]
    assert 0 < stopped_at < GENUINE_STEPS
    assert info.state is JobState.COMPLETED, info  # a clean stop: the batch script exits 0
    assert _restarts(job_id) == 0
    assert not (run_dir / "failure.json").exists(), "a clean stop is no failure"
    out = "".join(p.read_text() for p in sorted((run_dir / "logs").glob("*.out")))
    assert "already requeued 0 time(s) (checkpoint.max_requeues=0)" in out, out[-2000:]
    state, _ = ck.load_latest(run_dir / "checkpoints")
    assert state["step"] == stopped_at, "the stop was checkpointed"
