"""Issue 31 items 1 and 3 on the real local Slurm cluster: a lost or hung node's step starts again inside
the same job (no requeue, no queue wait), on a spare node or on fewer nodes, from the newest checkpoint.

* **A node whose processes die, with a spare**: jobs/smoke.toml (tiny_cnn) on the ``wide`` partition,
  2 nodes x 1 task + 1 spare. Every rank is held after optimizer step :data:`HOLD` (tests/helpers/
  slow_parts.py) so that the fault surely falls mid-run; the test SIGKILLs the job's processes on rank 1's
  node (its slurmd keeps answering: the node never goes DOWN), then lets rank 0 go on. Its collective
  breaks, the step watcher ends the step, leaves the node out and starts the step again on the spare.
* **A hung rank, with a spare**: tests/helpers/hang_script.py (a user script on the cyclone_kit API);
  rank 1 sleeps forever before step :data:`HANG_STEP` while rank 0 waits in DDP's all-reduce: no exception,
  no exit. The progress watchdogs end the step; the watcher restarts it on the spare.
* **A lost node, no spare, ``--min-nodes 1``**: the step shrinks from 2 nodes to 1 (world 2 -> 1) and
  completes; the engine keeps the global batch (grad_accum 1 -> 2) and ``restarts.json`` says what changed.
* **A restart that cannot happen falls back to the requeue**: the lost node of the first case, with a
  spare but ``checkpoint.max_restarts=0``: the step watcher says why it does not restart in the job and
  requeues it as before (Slurm's Restarts=1, restart_count 1 in the second segment's start record); the
  second segment resumes from the newest checkpoint and completes; ``restarts.json`` holds no restart,
  only the fall-back and why, and ``status`` says so.

The first three assert the same job id completed without a requeue (``scontrol show job``: Restarts=0; every
``start`` record's restart_count is 0), that the new segment resumed from the newest checkpoint, what
``restarts.json`` and ``status`` say, and prints the time from the fault to the first step again (the
issue's target is under 60 s here; not asserted: no test depends on the machine's speed). Every wait is
for an event, with a hang guard.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from cyclone_kit.backends.slurm import SlurmBackend
from cyclone_kit.core.proc import run_command
from cyclone_kit.rundir.restarts import read_fallbacks, read_restarts, seconds_between
from cyclone_kit.slurm.states import JobState
from tests.helpers.cli import REPO, run_cli
from tests.helpers.node_faults import kill_node_processes, node_processes
from tests.helpers.slow_parts import hold_files, slow_parts_env, watchdog_out_of_reach
from tests.helpers.slurm_jobs import finish_job, parse_submit_output, read_records, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

HANG_SCRIPT = REPO / "tests" / "helpers" / "hang_script.py"
SMOKE = REPO / "jobs" / "smoke.toml"
#: Hang guard of every wait (a broken job), sized for a 5x slower machine; not a performance bound.
HANG_S = 600.0
STEPS = 30
EVERY = 5
#: The optimizer step every rank of the first segment is held after (so the kill falls mid-run).
HOLD = 12
HANG_STEP = 10
FLOOR_S = 8


def _submit(runs: Path, target: str, *args: str, env: dict[str, str] | None = None) -> tuple[str, Path]:
    result = run_cli("submit", target, "--profile", "local", "--ntasks-per-node", "1", "--time", "10",
                     "--runs-dir", str(runs), *args, env=env, timeout=HANG_S)
    assert result.returncode == 0, result.stdout + result.stderr
    return parse_submit_output(result.stdout)


def _slurm_restarts(job_id: str) -> int:
    """How often Slurm requeued the job (``scontrol show job``: Restarts=N; the job stays MinJobAge s)."""
    text = run_command(["scontrol", "show", "job", job_id], timeout=30).stdout
    match = re.search(r"\bRestarts=(\d+)", text)
    assert match, text
    return int(match.group(1))


def _progress_hosts(run_dir: Path) -> dict[int, str]:
    out = {}
    for path in (run_dir / "progress").glob("rank-*.json"):
        try:
            rec = json.loads(path.read_text())
        except ValueError:
            continue
        out[int(rec["rank"])] = str(rec["host"])
    return out


def _newest_checkpoint(run_dir: Path) -> int:
    steps = [int(m.group(1)) for p in (run_dir / "checkpoints").glob("ckpt-*.pt")
             if (m := re.fullmatch(r"ckpt-0*(\d+)\.pt", p.name))]
    return max(steps, default=0)


def _kill_node_of_rank_1(job_id: str, run_dir: Path) -> tuple[str, float, int]:
    """SIGKILL the job's processes on rank 1's node; (node, time of the kill, newest checkpoint then)."""
    hosts = wait_for(lambda: (h := _progress_hosts(run_dir)) and len(h) == 2 and h, HANG_S, "both ranks' records")
    victim = hosts[1]
    assert victim != hosts[0], hosts
    wait_for(lambda: len(node_processes(job_id, victim)) >= 2, HANG_S, f"the job's processes on {victim}")
    newest = _newest_checkpoint(run_dir)
    killed = kill_node_processes(job_id, victim)
    killed_at = time.time()
    print(f"job {job_id}: killed its processes on {victim}: {killed}; newest checkpoint then: step {newest}")
    return victim, killed_at, newest


def _check_completed_in_job(job_id: str, run_dir: Path, info: Any, steps: int) -> list[dict[str, Any]]:
    """The run completed in one job, never requeued, in 2 segments; returns its records."""
    assert info.state is JobState.COMPLETED, info
    assert _slurm_restarts(job_id) == 0, "the job was requeued"
    records = read_records(run_dir) or [json.loads(x) for x in (run_dir / "shim.jsonl").read_text().splitlines()]
    starts = [r for r in records if r["kind"] == "start"]
    ends = [r for r in records if r["kind"] == "end"]
    assert [s.get("restart_count") for s in starts] == [0, 0], starts
    assert ends[-1]["status"] == "completed" and ends[-1]["steps"] == steps, ends
    return records


def _check_status(job_id: str, run_dir: Path, name: str, first_label: str) -> str:
    status = run_cli("status", str(run_dir), timeout=HANG_S)
    print(status.stdout)
    assert status.returncode == 0, status.stdout + status.stderr
    assert f"{job_id} {name}: completed (2 segments: {first_label}, then completed)" in status.stdout, status.stdout
    assert re.search(rf"^{job_id} {name}: in-job restart 1 of at most 3: ", status.stdout, re.M), status.stdout
    assert "root cause" not in status.stdout, "the last segment completed"
    return status.stdout


def _print_recovery(job_id: str, entry: dict[str, Any], fault_at: float | None = None) -> None:
    import datetime

    seen = ""
    if fault_at is not None:
        first = datetime.datetime.fromisoformat(entry["first_step_time"]).timestamp()
        seen = f"; kill -> first step again {first - fault_at:.1f} s (the test's clock)"
    print(f"job {job_id}: fault -> first step again {entry['recovery_s']} s (restarts.json{seen}); fault -> "
          f"restart started {seconds_between(entry['fault_time'], entry['restart_time']):.1f} s; "
          f"{entry['steps_recomputed']} step(s) recomputed (target: under 60 s on the local cluster)")


def _lose_a_node_while_held(tmp_path: Path, *args: str) -> tuple[str, Path, Any, str, float, int]:
    """Submit the smoke job (ARGS), hold every rank after step HOLD, kill rank 1's node's processes, let
    rank 0 go on and wait for the job to end: (job id, run dir, its last JobInfo, the node, the kill's
    time, the newest checkpoint at the kill)."""
    backend = SlurmBackend()
    holds = hold_files(tmp_path / "slow")
    job_id, run_dir = _submit(tmp_path, str(SMOKE), *args, "--set", f"train.steps={STEPS}", "--set",
                              "train.log_every=1", "--set", f"checkpoint.every_steps={EVERY}",
                              *watchdog_out_of_reach(HANG_S),
                              env=slow_parts_env(tmp_path / "slow", hold_step=HOLD))
    try:
        wait_for(lambda: holds.at(HOLD, [0, 1]), HANG_S, f"both ranks held after step {HOLD}")
        victim, killed_at, newest = _kill_node_of_rank_1(job_id, run_dir)
        holds.go()
    finally:
        holds.go()  # never leave a rank held (a failed wait above would leave it waiting forever)
        info = finish_job(backend, job_id, HANG_S)
    return job_id, run_dir, info, victim, killed_at, newest


# --------------------------------------------------------------------------- (a) a lost node, a spare
@pytest.mark.timeout(2 * HANG_S)
def test_a_lost_node_restarts_on_the_spare_in_the_same_job(slurm_cluster: dict[str, str], tmp_path: Path) -> None:
    job_id, run_dir, info, victim, killed_at, newest = _lose_a_node_while_held(
        tmp_path, "--partition", "wide", "--nodes", "2", "--spare-nodes", "1")
    records = _check_completed_in_job(job_id, run_dir, info, STEPS)
    starts = [r for r in records if r["kind"] == "start"]
    (entry,) = read_restarts(run_dir)
    allocation = entry["allocation"]
    assert len(allocation) == 3 and entry["nodes_before"] == sorted(entry["nodes_before"], key=allocation.index)
    (spare,) = [n for n in allocation if n not in entry["nodes_before"]]
    assert (entry["cause"], entry["left_out"], entry["spares"], entry["shrunk"]) == ("rank_lost", [victim], [spare],
                                                                                    False), entry
    assert entry["nodes_after"] == sorted([*(n for n in entry["nodes_before"] if n != victim), spare],
                                          key=allocation.index), entry
    assert sorted(starts[1]["hostnames"]) == sorted(entry["nodes_after"]), starts[1]
    # from the newest checkpoint: the one there at the kill, or one rank 0 finished after it
    assert newest <= starts[1]["start_step"] < HOLD and starts[1]["start_step"] % EVERY == 0, (newest, starts[1])
    assert entry["resumed_step"] == starts[1]["start_step"] and entry["last_step"] in (HOLD - 1, HOLD), entry
    assert entry["steps_recomputed"] == entry["last_step"] - entry["resumed_step"], entry
    steps = [r["step"] for r in records if r["kind"] == "step"]
    assert steps[-1] == STEPS and sorted(set(steps)) == list(range(1, STEPS + 1)), steps
    assert entry["first_step"] == starts[1]["start_step"] + 1 and entry["recovery_s"] > 0, entry
    _print_recovery(job_id, entry, killed_at)
    out = _check_status(job_id, run_dir, "smoke", f"RANK_LOST on {victim}")
    assert f"left out {victim}, now {','.join(entry['nodes_after'])} (spare {spare})" in out, out
    assert not node_processes(job_id, spare) and not node_processes(job_id, allocation[0])


# --------------------------------------------------------------------------- (b) a hung rank, a spare
@pytest.mark.timeout(2 * HANG_S)
def test_a_hung_rank_restarts_on_the_spare_in_the_same_job(slurm_cluster: dict[str, str], tmp_path: Path) -> None:
    backend = SlurmBackend()
    job_id, run_dir = _submit(tmp_path, str(HANG_SCRIPT), "--partition", "wide", "--nodes", "2", "--spare-nodes", "1",
                              "--set", f"checkpoint.stall_floor_s={FLOOR_S}", "--", "--steps", str(STEPS),
                              "--hang-rank", "1", "--hang-step", str(HANG_STEP), env={"CYCLONE_LOG_EVERY": "1"})
    info = finish_job(backend, job_id, HANG_S)
    records = _check_completed_in_job(job_id, run_dir, info, STEPS)
    steps = [r["step"] for r in records if r["kind"] == "step"]
    assert steps == list(range(1, STEPS + 1)), "every step exactly once (the script checkpoints every step)"
    (entry,) = read_restarts(run_dir)
    failure = json.loads(next((run_dir / "ranks").glob("failure-*.json")).read_text()) \
        if not (run_dir / "failure.json").is_file() else json.loads((run_dir / "failure.json").read_text())
    assert (failure["cause"], failure["stuck"]) == ("stalled", [1]), failure
    hung = failure["host"]
    (spare,) = [n for n in entry["allocation"] if n not in entry["nodes_before"]]
    assert (entry["cause"], entry["left_out"], entry["spares"]) == ("stalled", [hung], [spare]), entry
    assert (entry["last_step"], entry["resumed_step"], entry["first_step"], entry["steps_recomputed"]) == (
        HANG_STEP - 1, HANG_STEP - 1, HANG_STEP, 0), entry
    _print_recovery(job_id, entry)
    _check_status(job_id, run_dir, "hang_script", f"STALLED on {hung}")


# --------------------------------------------------------------------------- (c) no spare: shrink 2 -> 1
@pytest.mark.timeout(2 * HANG_S)
def test_a_lost_node_shrinks_the_step_to_min_nodes_in_the_same_job(slurm_cluster: dict[str, str],
                                                                      tmp_path: Path) -> None:
    job_id, run_dir, info, victim, killed_at, newest = _lose_a_node_while_held(
        tmp_path, "--partition", "cpu", "--nodes", "2", "--min-nodes", "1")
    records = _check_completed_in_job(job_id, run_dir, info, STEPS)
    starts = [r for r in records if r["kind"] == "start"]
    (entry,) = read_restarts(run_dir)
    (kept,) = [n for n in entry["nodes_before"] if n != victim]
    assert (entry["cause"], entry["left_out"], entry["nodes_after"], entry["spares"], entry["shrunk"]) == (
        "rank_lost", [victim], [kept], [], True), entry
    assert [s["world_size"] for s in starts] == [2, 1] and starts[1]["hostnames"] == [kept], starts
    assert (entry["world_size_before"], entry["world_size_after"]) == (2, 1), entry
    # the engine keeps the global batch on the smaller world: twice the micro-batches per optimizer step
    assert [(s["global_batch_size"], s["grad_accum"]) for s in starts] == [(64, 1), (64, 2)], starts
    assert (entry["global_batch_before"], entry["global_batch_after"]) == (64, 64), entry
    assert newest <= starts[1]["start_step"] < HOLD, (newest, starts[1])
    _print_recovery(job_id, entry, killed_at)
    out = _check_status(job_id, run_dir, "smoke", f"RANK_LOST on {victim}")
    assert f"now {kept} (shrunk: world 2 -> 1 ranks, global batch 64 kept)" in out, out


# --------------------------------------------------------------------------- (d) no restart left: the requeue
@pytest.mark.timeout(2 * HANG_S)
def test_a_lost_node_with_no_restart_left_falls_back_to_the_requeue(slurm_cluster: dict[str, str],
                                                                   tmp_path: Path) -> None:
    job_id, run_dir, info, victim, _, newest = _lose_a_node_while_held(
        tmp_path, "--partition", "wide", "--nodes", "2", "--spare-nodes", "1", "--set", "checkpoint.max_restarts=0")
    assert info.state is JobState.COMPLETED, info
    assert _slurm_restarts(job_id) == 1, "the job was not requeued once"
    records = read_records(run_dir)
    starts = [r for r in records if r["kind"] == "start"]
    ends = [r for r in records if r["kind"] == "end"]
    assert [s.get("restart_count") for s in starts] == [0, 1], starts
    assert ends[-1]["status"] == "completed" and ends[-1]["steps"] == STEPS, ends
    # from the newest checkpoint: the one there at the kill, or one rank 0 finished after it
    assert newest <= starts[1]["start_step"] < HOLD and starts[1]["start_step"] % EVERY == 0, (newest, starts[1])
    steps = [r["step"] for r in records if r["kind"] == "step"]
    assert steps[-1] == STEPS and sorted(set(steps)) == list(range(1, STEPS + 1)), steps
    assert read_restarts(run_dir) == [], "no in-job restart was made"
    (fallback,) = read_fallbacks(run_dir)
    assert (fallback["cause"], fallback["hosts"], fallback["requeue"]) == ("rank_lost", [victim], 0), fallback
    failure = json.loads((run_dir / "failure.json").read_text())
    assert (failure["cause"], failure["hosts"]) == ("rank_lost", [victim]), failure
    out = "".join(p.read_text() for p in (run_dir / "logs").glob("*.err"))
    assert ("already restarted 0 time(s) in the job (checkpoint.max_restarts=0); falling back to a requeue"
            in out), out[-3000:]
    assert "stepwatch: the step ended (rank_lost): requeue 1 of at most 3" in out, out[-3000:]
    status = run_cli("status", str(run_dir), timeout=HANG_S)
    print(status.stdout)
    assert status.returncode == 0, status.stdout + status.stderr
    assert f"{job_id} smoke: completed (2 segments: RANK_LOST on {victim}, then completed)" in status.stdout, \
        status.stdout
    assert (f"{job_id} smoke: no in-job restart after rank_lost on {victim}: already restarted 0 time(s) in the job "
            "(checkpoint.max_restarts=0); fell back to the requeue") in status.stdout, status.stdout
    assert "in-job restart 1" not in status.stdout and "root cause" not in status.stdout, status.stdout
