"""Issue 22 (stalls and status), the pure parts: the progress watchdog's bound and its choice of the
stuck rank, the step watcher's rules, the collective timeout, and how a requeued run's segments
are judged. The real thing runs in tests/integration/test_stall.py and tests/slurm/test_stall_slurm.py."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from cyclone_kit.rundir import failures
from cyclone_kit.rundir.layout import RunDir
from cyclone_kit.runtime.watchers import jobstep as sw
from cyclone_kit.runtime.watchers import stall as pg


@pytest.fixture(autouse=True)
def _not_stalling():
    """A watchdog that fired here marks this (pytest's) process as stalling: clear it for the next test."""
    yield
    pg._STALLING.clear()


# --------------------------------------------------------------------------- the bound
def test_bound_is_the_floor_or_a_multiple_of_the_median_step() -> None:
    policy = pg.StallPolicy(floor_s=60, factor=20)
    assert pg.stall_bound(policy, [0.1, 0.1]) is None, "unarmed before MIN_STEPS timed steps"
    assert pg.stall_bound(policy, [0.1, 0.2, 0.1]) == 60  # 20 x 0.1 s < the floor
    assert pg.stall_bound(policy, [5.0, 4.0, 6.0, 100.0]) == pytest.approx(20 * 5.5)  # the median, not the outlier
    assert pg.stall_bound(pg.StallPolicy(floor_s=0), [1.0] * 10) is None, "floor 0 turns it off"


def test_bound_stays_below_the_process_groups_timeout() -> None:
    """A peer waiting for a stopped rank fails at its collective's timeout: a bound past it would never name the
    stopped rank (slow first steps on a busy machine: 20 x 3.5 s > a 60-s timeout), so it is held below it."""
    policy = pg.StallPolicy.below_collectives(6, 20, 60)
    assert policy.ceiling_s == pg.COLLECTIVE_SHARE * 60
    assert pg.stall_bound(policy, [3.5, 3.0, 4.0]) == policy.ceiling_s
    assert pg.stall_bound(policy, [0.1, 0.1, 0.1]) == 6, "below the ceiling the rule is unchanged"
    assert pg.stall_bound(pg.StallPolicy.below_collectives(60, 20, 60), [0.1] * 3) == policy.ceiling_s, "floor too"
    assert pg.StallPolicy.below_collectives(60, 20, None).ceiling_s is None, "a world of one: no collective"
    held = {"bound_s": 36.0, "floor_s": 6, "factor": 20, "median_step_s": 3.5, "ceiling_s": 36.0}
    assert pg.describe_bound(held).startswith("bound 36.0 s = 0.6 x the process group's timeout, below max(")
    assert pg.describe_bound({**held, "bound_s": 6.0, "median_step_s": 0.1}) == (
        "bound 6.0 s = max(checkpoint.stall_floor_s 6 s, 20 x median step 0.100 s)")


def test_collective_timeout_stays_below_the_remaining_wall_time() -> None:
    now = 1_000_000.0
    assert pg.collective_timeout(600, None, now) == 600
    assert pg.collective_timeout(600, "garbage", now) == 600
    assert pg.collective_timeout(600, str(now + 3600), now) == 600
    assert pg.collective_timeout(600, str(now + 300), now) == 300 - pg.END_MARGIN_S
    assert pg.collective_timeout(600, str(now + 10), now) == 30, "never below 30 s"


def test_the_main_thread_waits_for_peers_inside_a_collective_or_backward() -> None:
    site = "/venv/lib/python3.11/site-packages"
    assert pg.waiting_for_peers(["train.py", f"{site}/torch/autograd/graph.py"])
    assert pg.waiting_for_peers(["train.py", f"{site}/torch/distributed/distributed_c10d.py"])
    assert pg.waiting_for_peers(["train.py", "/src/cyclone_kit/runtime/session.py"])
    assert not pg.waiting_for_peers([f"{site}/torch/autograd/graph.py", "train.py"]), "only the innermost frame counts"
    assert not pg.waiting_for_peers(["train.py", f"{site}/torch/serialization.py"]), "a hung load is not a wait"
    assert not pg.waiting_for_peers([])


def _rec(rank: int, step: int | None, state: str = "stalled", waiting: bool | None = None, **extra: Any) -> dict:
    return {"rank": rank, "host": f"c{rank // 2 + 1}", "pid": 100 + rank, "step": step, "state": state,
            "waiting": waiting, "idle_s": 12.0, "bound_s": 10.0, "floor_s": 10.0, "factor": 20.0,
            "median_step_s": 0.05, "where": "train.py:9 in main", **extra}


def test_the_stuck_rank_is_the_one_not_waiting_for_its_peers() -> None:
    records = {0: _rec(0, 14, waiting=True), 1: _rec(1, 14, waiting=False), 2: _rec(2, 14, waiting=True),
               3: _rec(3, 14, waiting=True)}
    assert pg.choose_stuck(records, 4) == [1]
    line = pg.stall_line([1], records, 4)
    assert line.startswith("rank 1 on host c1 (pid 101) stopped making progress after step 14"), line
    assert "rank(s) 0, 2, 3 waited for it" in line


def test_fewer_steps_and_silence_make_a_rank_stuck() -> None:
    # rank 2 is a step behind (the others finished a step it never joined)
    assert pg.choose_stuck({0: _rec(0, 15, waiting=True), 1: _rec(1, 15), 2: _rec(2, 14, waiting=True)}, 3) == [2]
    # rank 1 never answered (SIGSTOP, a frozen node): a suspect, with no stack
    records = {0: _rec(0, 14, waiting=True), 1: _rec(1, 14, state="running")}
    assert pg.choose_stuck(records, 2) == [1]
    assert "did not answer" in pg.stall_line([1], records, 2)
    # ... told apart from one alive but busy (its watchdog wrote a second ago: a loop of its own), given the time
    now = 1000.0
    stopped = {0: _rec(0, 14, waiting=True), 1: _rec(1, 14, state="running", beat_time=now - 60, bound_s=6.0)}
    busy = {0: _rec(0, 14, waiting=True), 1: _rec(1, 14, state="running", beat_time=now - 1, bound_s=6.0)}
    assert "did not answer (stopped, frozen, or its node is gone)" in pg.stall_line([1], stopped, 2, now)
    line = pg.stall_line([1], busy, 2, now)
    assert "did not say it stalled, though its watchdog still wrote" in line and "did not answer" not in line, line
    assert "still wrote" in pg.stall_error_record(busy[1], "t", now)["message"]
    assert "did not answer" in pg.stall_error_record(stopped[1], "t", now)["message"]
    # no record at all (died before its first heartbeat)
    assert pg.choose_stuck({0: _rec(0, 3, waiting=True)}, 2) == [1]
    # everyone waits in a collective: nobody stands out, all are named
    assert pg.choose_stuck({0: _rec(0, 7, waiting=True), 1: _rec(1, 7, waiting=True)}, 2) == [0, 1]


def test_stall_failure_carries_the_stuck_ranks_stack() -> None:
    records = {0: _rec(0, 14, waiting=True), 1: _rec(1, 14, waiting=False, stack='File "train.py", line 9 in main')}
    doc, errors = pg.stall_failure([1], records, 2, "42", "42:0")
    assert doc["cause"] == "stalled" and doc["rank"] == 1 and doc["host"] == "c1" and doc["segment"] == "42:0"
    assert errors[1]["type"] == "Stalled" and 'line 9 in main' in errors[1]["traceback"]
    assert doc["first"]["traceback"] == errors[1]["traceback"]


class _Records:
    """An in-memory stand-in for the run directory's progress records (one rank's view)."""

    def __init__(self) -> None:
        self.data: dict[int, dict[str, Any]] = {}

    def write(self, rank: int, rec: dict[str, Any]) -> None:
        self.data[rank] = json.loads(json.dumps(rec, default=str))

    def read_all(self) -> dict[int, Any]:
        return dict(self.data)


def test_the_watchdog_fires_once_the_bound_passes_without_a_step() -> None:
    """A real ProgressWatch thread: steps every ~10 ms, then none. It dumps this thread's stack,
    calls on_stall and leaves through `exit` (here: recorded, not os._exit)."""
    records, called, exits = _Records(), [], []
    done = threading.Event()

    def on_stall(stuck: list[int], recs: dict[int, Any], own: dict[str, Any]) -> None:
        called.append((stuck, own))

    def leave(code: int) -> None:
        exits.append(code)
        done.set()

    watch = pg.ProgressWatch(records, 0, 1, "c1", pg.StallPolicy(floor_s=0.5, factor=20), "7:0", on_stall,
                             exit=leave, settle_s=0.0).start()
    for step in range(1, 6):
        stopped = time.monotonic()  # before the last beat: the watchdog's idle time starts at or after it
        watch.beat(step)
        time.sleep(0.01)
    assert done.wait(30), "the watchdog never fired"
    waited = time.monotonic() - stopped
    assert exits == [pg.STALL_EXIT_CODE]
    (stuck, own), = called
    assert stuck == [0] and own["state"] == "stalled" and own["step"] == 5
    assert "test_the_watchdog_fires_once_the_bound_passes" in own["stack"], own["stack"][:500]
    # The product's rule, max(floor, factor x median step): 0.5 s unless a loaded machine stretched the
    # ~10 ms beats past 25 ms (then 20 x median). The verdict holds at any speed.
    assert own["bound_s"] == pytest.approx(max(0.5, 20 * own["median_step_s"]))
    assert own["idle_s"] > own["bound_s"] >= 0.5
    assert waited > own["bound_s"], (waited, own["bound_s"])


def test_a_live_peer_that_decides_late_is_waited_for_a_stopped_one_is_not() -> None:
    now = 1000.0
    live = {"state": "running", "beat_time": now - 1.0, "bound_s": 6.0}
    stopped = {"state": "running", "beat_time": now - 7.0, "bound_s": 6.0}  # last wrote when it stopped
    assert pg.live_undecided({0: {"state": "stalled"}, 1: live}, 0, now)
    assert not pg.live_undecided({0: {"state": "stalled"}, 1: stopped}, 0, now)
    assert not pg.live_undecided({0: {"state": "stalled"}, 1: {**live, "state": "stalled"}}, 0, now)
    assert not pg.live_undecided({0: live}, 0, now), "its own record does not count"


def test_a_stalled_rank_waits_past_the_settle_time_for_a_peer_still_writing_its_record() -> None:
    """The condition is made: the peer (rank 1) keeps beating and says ``stalled`` (waiting in a collective)
    only half a second after the settle time, as a peer whose watchdog a busy machine runs late. Rank 0's
    watchdog waits for that verdict instead of deciding on its own at the settle time (then rank 1 would be
    "did not answer")."""
    records, called, done = _Records(), [], threading.Event()
    # The peer answers at settle + 0.5 s = 3.5 s; rank 0's last wait (SETTLE_MAX_FACTOR settle times) ends at 9 s:
    # 5.5 s of room for a late test thread (the peer's beats keep it "live" while it writes within 3 s).
    settle = 3.0
    answer_s = settle + 0.5
    assert answer_s + 5 < pg.SETTLE_MAX_FACTOR * settle

    def on_stall(stuck: list[int], recs: dict[int, Any], own: dict[str, Any]) -> None:
        called.append((stuck, recs))

    watch = pg.ProgressWatch(records, 0, 2, "c1", pg.StallPolicy(floor_s=0.3, factor=1), "7:0", on_stall,
                             exit=lambda code: done.set(), settle_s=settle)
    peer = {"rank": 1, "host": "c2", "pid": 2, "segment": "7:0", "state": "running", "step": 5, "bound_s": 0.3,
            "beat_time": time.time()}
    records.write(1, peer)
    watch.start()
    for step in range(1, 6):
        watch.beat(step)
        time.sleep(0.01)
    while (records.read_all().get(0) or {}).get("state") != "stalled":  # rank 0 decided: its settle starts
        records.write(1, {**peer, "beat_time": time.time()})
        time.sleep(0.05)
    t0 = time.monotonic()
    while time.monotonic() - t0 < answer_s:  # alive, beating, not yet decided
        assert not done.is_set(), "rank 0 decided without its live peer's verdict"
        records.write(1, {**peer, "beat_time": time.time()})
        time.sleep(0.05)
    records.write(1, {**peer, "state": "stalled", "waiting": True, "beat_time": time.time()})
    assert done.wait(30), "the watchdog never left"
    (stuck, recs), = called
    assert recs[1]["state"] == "stalled" and stuck == [0], (stuck, recs)


class _CountingWatch(pg.ProgressWatch):
    """A ProgressWatch that counts its thread's looks (each look asks for the bound), so that a test
    can wait until the watchdog has judged a moment instead of hoping it looked in time."""

    looks = 0

    def bound(self) -> float | None:
        if threading.current_thread().name == "cyclone_kit-progress":
            self.looks += 1
        return super().bound()


def _wait_past_the_bound(watch: _CountingWatch, looks: int) -> None:
    """Return once at least 3 bounds passed since the last step and the watchdog looked ``looks`` more times."""
    bound, since, start = watch.bound(), watch.looks, time.monotonic()
    assert bound is not None, "the watch is armed by its steps"
    while watch.looks < since + looks or time.monotonic() - start < 3 * bound:
        assert time.monotonic() - start < 60, "the watchdog stopped looking"  # a hang guard, not a bound
        time.sleep(0.02)


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_pause_is_not_a_stall(world_size: int) -> None:
    """Several bounds (step and pause bounds alike) in a pause, in Python and outside any collective: no stall.
    With a peer (world 2, the pause watched below the collective timeout), its record says it is live and
    waits for nobody: this pass is just long."""
    records, called = _Records(), []
    if world_size == 2:
        records.write(1, {"rank": 1, "segment": "7:0", "state": "running", "step": 5, "beat_time": time.time()})
    watch = _CountingWatch(records, 0, world_size, "c1", pg.StallPolicy(floor_s=0.3, factor=20, ceiling_s=0.3),
                           "7:0", lambda *a: called.append(a), exit=lambda code: None, settle_s=0.0)
    assert (watch.pause_bound is None) == (world_size == 1)
    for step in range(1, 6):  # armed before the thread starts: its first look is a tenth of the bound away
        watch.beat(step)
    watch.start()
    with watch.paused("a checkpoint"):  # several bounds long, and the watchdog looked at it many times
        _wait_past_the_bound(watch, looks=10)
    watch.beat(6)
    watch.stop()
    assert not called
    assert records.data[0]["state"] == "ended" and records.data[0]["step"] == 6


def test_pause_rules() -> None:
    policy = pg.StallPolicy(floor_s=60, factor=20, ceiling_s=18)
    assert pg.pause_bound(policy, 2) == 18
    assert pg.pause_bound(policy, 1) is None, "no peer: no collective would time out"
    assert pg.pause_bound(pg.StallPolicy(60, 20, None), 4) is None, "the timeout unknown"
    assert pg.pause_bound(pg.StallPolicy(0, 20, 18), 4) is None, "the watchdog off"
    waiter = {"state": "stalled", "waiting": True, "step": 5}
    v = pg.pause_verdict
    assert v(18, 18.0, 18.0, 30, None, 0, 5) == pg.STALLED, "inside one collective call for the bound"
    assert v(18, 18.0, None, 30, None, 0, 5) == pg.STALLED, "no probe: the frames alone"
    assert v(18, 17.9, 17.9, 30, None, 0, 5) == pg.WORKING
    assert v(18, 30.0, 0.5, 30, None, 0, 5) == pg.WORKING, "many short waits (a pipeline stage), back in Python"
    assert v(18, None, 0.0, 17.9, {1: waiter}, 0, 5) == pg.WORKING, "paused for less than the bound"
    assert v(18, None, 0.0, 18.0, {1: waiter}, 0, 5) == pg.STALLED, "a peer waits for this rank's pass"
    assert v(18, None, 0.0, 99, {1: {**waiter, "step": 6}}, 0, 5) == pg.WORKING, "a peer at another step"
    assert v(18, None, 0.0, 99, {1: {**waiter, "waiting": False}}, 0, 5) == pg.WORKING, "a peer waiting for nobody"
    assert v(18, None, 0.0, 99, {1: {**waiter, "state": "running"}}, 0, 5) == pg.WORKING
    assert v(18, None, 0.0, 99, {0: waiter}, 0, 5) == pg.WORKING, "its own record does not count"
    assert v(18, None, 0.0, 99, None, 0, 5) == pg.WORKING, "records not read"


#: One call inside a "collective": a lock's acquire (a C call: the main-thread probe stays outstanding) in a
#: function compiled under torch/distributed's file name (its innermost Python frame).
_COLLECTIVE: dict[str, Any] = {}
exec(compile("def wait(lock, timeout=120):\n"
             "    return lock.acquire(timeout=timeout)\n", "/v/torch/distributed/distributed_c10d.py", "exec"), _COLLECTIVE)


def _peer(rank: int, **fields: Any) -> dict[str, Any]:
    return {"rank": rank, "host": f"c{rank + 1}", "pid": 100 + rank, "segment": "7:0", "step": 5, "bound_s": 0.5,
            "beat_time": time.time(), **fields}


def test_a_rank_its_peer_waits_for_in_a_pause_is_named_with_its_stack() -> None:
    """The engine's validation pass hangs on rank 0 (this test's main thread sits on a lock, released only by the
    watchdog's exit), past the pause's bound, while rank 1 says it has waited for it in a collective at the same
    step: rank 0 says ``stalled`` (not waiting) with its stack, and is the one named. No step bound is involved:
    the watch was never armed."""
    records, called, exits = _Records(), [], []
    blocked = threading.Lock()
    blocked.acquire()
    records.write(1, _peer(1, state="stalled", waiting=True, where="distributed_c10d.py:1 in all_reduce"))

    def leave(code: int) -> None:
        exits.append(code)
        blocked.release()

    watch = pg.ProgressWatch(records, 0, 2, "c1", pg.StallPolicy(floor_s=60, factor=20, ceiling_s=0.5), "7:0",
                             lambda stuck, recs, own: called.append((stuck, recs, own)), exit=leave, settle_s=0.0)
    watch.beat(5)
    watch.start()
    with watch.paused("the validation pass of epoch 0"):
        released = blocked.acquire(timeout=120)  # a hang guard, not a bound: the watchdog's exit releases it
    watch.stop()
    assert released and exits == [pg.STALL_EXIT_CODE], exits
    (stuck, recs, own), = called
    assert stuck == [0], (stuck, recs)
    assert own["pause"] == "the validation pass of epoch 0" and own["waiting"] is False and own["step"] == 5, own
    assert own["bound_s"] == 0.5 and own["paused_s"] >= 0.5 and own["idle_s"] >= own["bound_s"], own
    assert "test_a_rank_its_peer_waits_for_in_a_pause" in own["where"] and "Thread 0x" in own["stack"], own["where"]
    line = pg.stall_line(stuck, recs, 2)
    assert line.startswith("rank 0 on host c1 (pid ") and "in the validation pass of epoch 0 after step 5" in line, line
    assert "0.5 x the process group's timeout" not in line and "rank(s) 1 waited for it in a collective" in line, line
    error = pg.stall_error_record(own, "now")
    assert error["message"].startswith("no progress in the validation pass of epoch 0 after step 5: its peers waited"), error


def test_a_rank_waiting_in_a_collective_in_a_pause_names_the_peer_it_waits_for() -> None:
    """Made, not hoped for: in a checkpoint pause the main thread (this test) sits in one collective-like call (a
    lock's acquire, in a function compiled under torch/distributed's file name) until its watchdog fires, past
    the pause's bound, counted from when it first saw it there; the peer wrote its record long ago and stopped
    (no answer): it is the one named, and this rank waited for it."""
    records, called, exits = _Records(), [], []
    blocked = threading.Lock()
    blocked.acquire()
    records.write(1, _peer(1, state="running", beat_time=time.time() - 600))

    def leave(code: int) -> None:
        exits.append(code)
        blocked.release()

    watch = pg.ProgressWatch(records, 0, 2, "c1", pg.StallPolicy(floor_s=60, factor=20, ceiling_s=0.5), "7:0",
                             lambda stuck, recs, own: called.append((stuck, own)), exit=leave, settle_s=0.0)
    for step in range(1, 6):
        watch.beat(step)
    watch.start()
    with watch.paused("the checkpoint of step 5"):
        released = _COLLECTIVE["wait"](blocked)  # a hang guard inside, not a bound: the watchdog's exit releases it
    watch.stop()
    assert released and exits == [pg.STALL_EXIT_CODE], exits
    (stuck, own), = called
    assert stuck == [1] and own["waiting"] is True and own["pause"] == "the checkpoint of step 5", own
    assert own["waited_s"] >= 0.5 and own["bound_s"] == 0.5, own
    assert "waited inside a collective for" in pg.stall_error_record(own, "now")["message"]


def test_a_pipeline_stage_waiting_at_every_micro_batch_of_a_long_pass_is_not_stalled() -> None:
    """A pause several bounds long in which the main thread is inside a collective at (nearly) every look, but
    in many short calls (a pipeline stage waiting for its neighbour's activations, micro-batch after
    micro-batch of a validation pass), returning to Python between them: no stall; the peer, live, waits for
    nobody."""
    records, called = _Records(), []
    records.write(1, _peer(1, state="running"))
    watch = _CountingWatch(records, 0, 2, "c1", pg.StallPolicy(floor_s=60, factor=20, ceiling_s=0.3), "7:0",
                           lambda *a: called.append(a), exit=lambda code: None, settle_s=0.0)
    for step in range(1, 6):
        watch.beat(step)
    watch.start()
    short = threading.Lock()
    short.acquire()
    with watch.paused("the validation pass of epoch 0"):
        start, looks = time.monotonic(), watch.looks
        while not called and (watch.looks < looks + 10 or time.monotonic() - start < 3 * 0.3):
            assert time.monotonic() - start < 60, "the watchdog stopped looking"  # a hang guard, not a bound
            records.write(1, _peer(1, state="running"))
            _COLLECTIVE["wait"](short, 0.02)  # one micro-batch's wait: 20 ms inside the collective
    watch.beat(6)
    watch.stop()
    assert not called


def test_a_stall_declared_in_a_pause_is_taken_back_when_the_pause_ends() -> None:
    """Rank 0 waits in a collective in a validation pass past the bound and says ``stalled``; its peer is live
    and has not decided (a slow pass, not a hang), then the pass ends (the collective returned): rank 0 stands
    down, no ``on_stall``, no exit; its record says ``running`` again."""
    records, called, exits = _Records(), [], []
    peer = _peer(1, state="running")
    records.write(1, peer)
    blocked = threading.Lock()
    blocked.acquire()
    watch = pg.ProgressWatch(records, 0, 2, "c1", pg.StallPolicy(floor_s=60, factor=20, ceiling_s=0.5), "7:0",
                             lambda *a: called.append(a), exit=exits.append, settle_s=60.0)
    for step in range(1, 6):
        watch.beat(step)
    watch.start()

    def said_stalled() -> bool:
        records.write(1, {**peer, "beat_time": time.time()})  # the peer stays live meanwhile
        return (records.read_all().get(0) or {}).get("state") == "stalled"

    def peer_side() -> None:  # the live peer; the collective returns once rank 0 said stalled (the pass ended)
        deadline = time.monotonic() + 60  # a hang guard, not a bound
        while not said_stalled() and time.monotonic() < deadline:
            time.sleep(0.05)
        blocked.release()

    helper = threading.Thread(target=peer_side)
    helper.start()
    with watch.paused("the validation pass of epoch 0"):
        released = _COLLECTIVE["wait"](blocked)  # one call inside a collective, until the helper lets it return
    helper.join(60)
    assert released and said_stalled(), "the watchdog never said stalled"
    deadline = time.monotonic() + 60  # a hang guard, not a bound
    while (records.read_all().get(0) or {}).get("state") != "running":
        assert time.monotonic() < deadline, "the watchdog never took its stall back"
        records.write(1, {**peer, "beat_time": time.time()})
        time.sleep(0.05)
    watch.beat(6)
    watch.stop()
    assert not called and not exits and not pg._STALLING.is_set()
    assert records.read_all()[0]["state"] == "ended"


SCRIPT = ["/x/train.py", "/x/train.py"]
COLLECTIVE = [*SCRIPT, "/v/torch/distributed/distributed_c10d.py"]


@pytest.mark.parametrize(("idle_s", "cpu_s", "frames", "silent_s", "verdict"), [
    (10.0, 4.0, SCRIPT, 0.0, pg.WORKING),  # a validation pass: 40% of a core, back in Python at every look
    (10.0, 4.0, SCRIPT, None, pg.WORKING),  # no probe (not CPython): the CPU alone decides
    (10.0, 0.2, SCRIPT, 0.0, pg.STALLED),  # asleep, on a lock, on a dead file system
    (10.0, 9.0, COLLECTIVE, 0.0, pg.STALLED),  # waiting for a peer inside a collective
    (0.0, 1.0, SCRIPT, 0.0, pg.STALLED),
    # a GPU rank hung at its host sync (loss.item() spins a core behind a collective that never ends):
    # one C call for the whole bound, whatever it burns
    (10.0, 10.0, SCRIPT, 8.0, pg.STALLED),
    (10.0, 10.0, SCRIPT, 9.0, pg.STALLED),
    (10.0, 10.0, SCRIPT, 3.0, pg.UNSURE),  # one C call for less than the bound so far: look again
    (10.0, 0.2, SCRIPT, 3.0, pg.STALLED),  # ... unless the CPU already says it sleeps
])
def test_a_rank_past_its_bound_works_only_computing_in_python_outside_a_collective(
        idle_s: float, cpu_s: float, frames: list[str], silent_s: float | None, verdict: str) -> None:
    assert pg.idle_verdict(0.1, idle_s, 8.0, cpu_s, frames, silent_s) == verdict


@pytest.mark.parametrize(("waiting_s", "verdict"), [
    (None, pg.STALLED),  # how long it waited is unknown: inside a collective past the bound decides
    (8.0, pg.STALLED),  # inside the collective for the whole bound
    (12.0, pg.STALLED),
    (1.0, pg.UNSURE),  # its own validation pass ended a second ago; the peer's goes on: look again
    (0.0, pg.UNSURE),  # the look that first saw it there
])
def test_a_rank_inside_a_collective_is_stalled_once_it_waited_there_for_the_bound(
        waiting_s: float | None, verdict: str) -> None:
    """The wait for a peer counts from when the watchdog first saw the main thread inside the collective, not
    from the last step or the last restart of the wait (a validation pass): ``idle_s`` is past the bound in
    every case, and the CPU share says busy (the pass just ended)."""
    assert pg.idle_verdict(0.1, 10.0, 8.0, 9.0, COLLECTIVE, 0.5, waiting_s) == verdict


def test_the_watchdog_counts_a_collective_wait_from_when_it_saw_it() -> None:
    """Made, not hoped for: the main thread (this test) makes no step for three bounds, in Python and "in one C
    call for less than the bound" (a probe that says so: the watchdog looks again, the wait is not restarted),
    then sits in a collective-like frame (a function compiled under torch/distributed's file name) for a
    quarter of the bound: no stall (counted from the last step it would be one), and it steps. Then it sits
    there until the watchdog fires: once the bound passed inside the collective, with ``waiting`` true."""
    records, called, exits, fired = _Records(), [], [], threading.Event()
    bound = 1.0
    fake: dict[str, Any] = {}
    exec(compile("import time\n"
                 "def wait(s, done):\n"
                 "    t = time.monotonic()\n"
                 "    while time.monotonic() - t < s and not done.is_set():\n"
                 "        time.sleep(0.01)\n", "/v/torch/distributed/distributed_c10d.py", "exec"), fake)

    def leave(code: int) -> None:
        exits.append(code)
        fired.set()

    watch = _CountingWatch(records, 0, 1, "c1", pg.StallPolicy(floor_s=bound, factor=1), "7:0",
                           lambda stuck, recs, own: called.append(own), exit=leave, settle_s=0.0,
                           busy_share=0.0, probe=_ShortCall())
    for step in range(1, 5):
        watch.beat(step)
    watch.start()
    _wait_past_the_bound(watch, looks=3)  # unsure at every look: no step for three bounds, the wait goes on
    fake["wait"](bound / 4, fired)
    assert not fired.is_set(), "a quarter of the bound inside the collective was taken for a stall"
    watch.beat(5)
    fake["wait"](120, fired)  # a hang guard, not a bound: returns when the watchdog fires
    watch.stop()
    assert exits == [pg.STALL_EXIT_CODE], exits
    (own,) = called
    assert own["waiting"] is True and own["step"] == 5 and own["idle_s"] >= bound, own


class _ShortCall:
    """A main-thread probe that always says the main thread has been in one C call for a tenth of a second."""

    def post(self) -> None:
        pass

    def silent_s(self) -> float:
        return 0.1


def test_a_rank_that_steps_while_it_settles_takes_its_stall_back() -> None:
    """The condition is made: rank 0 stops stepping, its watchdog says ``stalled`` and waits for its live peer's
    verdict; then rank 0 makes a step (the peer it waited for caught up). It stands down: no exit, no
    ``on_stall``, its record says ``running`` at the new step; the watch goes on and ends normally."""
    records, called, exits = _Records(), [], []
    peer = {"rank": 1, "host": "c2", "pid": 2, "segment": "7:0", "state": "running", "step": 5, "bound_s": 0.3,
            "beat_time": time.time()}
    records.write(1, peer)
    watch = pg.ProgressWatch(records, 0, 2, "c1", pg.StallPolicy(floor_s=0.3, factor=1), "7:0",
                             lambda *a: called.append(a), exit=exits.append, settle_s=60.0)
    for step in range(1, 6):
        watch.beat(step)
        time.sleep(0.01)
    watch.start()
    deadline = time.monotonic() + 60  # a hang guard, not a bound
    while (records.read_all().get(0) or {}).get("state") != "stalled":
        assert time.monotonic() < deadline, "the watchdog never said stalled"
        records.write(1, {**peer, "beat_time": time.time()})
        time.sleep(0.05)
    assert pg._STALLING.is_set()
    watch.beat(6)
    while (records.read_all().get(0) or {}).get("state") != "running":
        assert time.monotonic() < deadline, "the watchdog never took its stall back"
        records.write(1, {**peer, "beat_time": time.time()})
        time.sleep(0.05)
    assert not called and not exits and not pg._STALLING.is_set()
    assert records.read_all()[0]["step"] == 6
    watch.beat(7)
    watch.stop()
    assert records.read_all()[0]["state"] == "ended" and not exits


def test_the_probe_runs_when_the_main_thread_returns_to_python_not_before() -> None:
    """Py_AddPendingCall's probe, posted from another thread (as the watchdog does at every look) while
    the main thread (this test) sits in one C call (a lock's acquire), stays outstanding until that call
    returns; then it runs. A probe posted before the main thread reached the call may run: the helper
    posts until one has stayed outstanding for 0.2 s, then releases the lock."""
    probe = pg.MainThreadProbe()
    blocked = threading.Lock()
    blocked.acquire()
    seen: list[float] = []

    def other() -> None:
        start = time.monotonic()
        while probe.silent_s() < 0.2 and time.monotonic() - start < 60:  # a hang guard, not a bound
            probe.post()
            time.sleep(0.01)
        seen.append(probe.silent_s())
        blocked.release()

    helper = threading.Thread(target=other)
    helper.start()
    assert blocked.acquire(timeout=120)  # a hang guard, not a bound: released by the helper
    for _ in range(3):  # back in Python: the next bytecodes run the pending call
        pass
    helper.join(60)
    assert seen and seen[0] >= 0.2, seen  # outstanding while the main thread was in C
    assert probe.silent_s() == 0.0  # ran once it returned


def test_a_busy_script_is_not_stalled_and_an_idle_one_is() -> None:
    """busy_share (a script fed by its optimizer steps): a CPU clock that runs at half the wall
    clock past the bound restarts the wait; once it stops, the watchdog fires."""
    records, called, exits = _Records(), [], []
    done, busy = threading.Event(), threading.Event()
    busy.set()
    cpu = [0.0]
    last = [time.monotonic()]

    def clock() -> float:  # half a core while busy, nothing after
        now = time.monotonic()
        if busy.is_set():
            cpu[0] += (now - last[0]) / 2
        last[0] = now
        return cpu[0]

    def leave(code: int) -> None:
        exits.append(code)
        done.set()

    class _Returning:  # the main thread keeps returning to Python (the probe has its own tests): a 0.3-s wait
        def post(self) -> None:  # for a CPU on a loaded machine must not read as "one C call past the bound"
            pass

        def silent_s(self) -> float:
            return 0.0

    watch = _CountingWatch(records, 0, 1, "c1", pg.StallPolicy(floor_s=0.3, factor=20), "7:0",
                           lambda stuck, recs, own: called.append(own), exit=leave, settle_s=0.0,
                           busy_share=0.1, cpu_clock=clock, probe=_Returning())
    for step in range(1, 6):  # armed before the thread starts: its first look is a tenth of the bound away
        watch.beat(step)
    watch.start()
    _wait_past_the_bound(watch, looks=10)  # several bounds with no step, computing, judged many times
    assert not called and not exits
    busy.clear()
    assert done.wait(30), "the watchdog never fired once the rank stopped computing"
    assert exits == [pg.STALL_EXIT_CODE] and called[0]["step"] == 5 and called[0]["state"] == "stalled"


def test_a_script_spinning_in_one_c_call_past_the_bound_is_stalled() -> None:
    """The GPU hang's shape on the CPU: the main thread (this test) sits in one C call (a lock's
    acquire, released only by the watchdog's exit) while the CPU clock says a core is busy, as
    ``loss.item()`` spins under CUDA's default scheduling. The CPU rule alone took it for a
    validation pass and restarted the wait forever; the probe sees no Python run for the bound."""
    records, called, exits = _Records(), [], []
    blocked = threading.Lock()
    blocked.acquire()
    start = time.monotonic()

    def leave(code: int) -> None:
        exits.append(code)
        blocked.release()

    watch = _CountingWatch(records, 0, 1, "c1", pg.StallPolicy(floor_s=0.3, factor=20), "7:0",
                           lambda stuck, recs, own: called.append(own), exit=leave, settle_s=0.0,
                           busy_share=0.1, cpu_clock=lambda: time.monotonic() - start)  # a full core, always
    for step in range(1, 6):
        watch.beat(step)
    watch.start()
    released = blocked.acquire(timeout=120)  # a hang guard, not a bound: the watchdog's exit releases it
    watch.stop()
    assert released and exits == [pg.STALL_EXIT_CODE], "the watchdog took the spinning call for work"
    (own,) = called
    assert own["state"] == "stalled" and own["step"] == 5 and own["waiting"] is False
    assert "test_a_script_spinning_in_one_c_call_past_the_bound_is_stalled" in own["where"], own["where"]
    assert own["idle_s"] >= own["bound_s"]


def test_stall_requeue_needs_requeue_on_and_requeues_left() -> None:
    assert pg.stall_requeue(True, 3, 0) == (True, "stalled: requeue 1 of at most 3, from the last checkpoint")
    assert pg.stall_requeue(False, 3, 0)[0] is False
    assert pg.stall_requeue(True, 3, 3) == (False, "stalled; already requeued 3 time(s) (checkpoint.max_requeues=3)")


# --------------------------------------------------------------------------- the step watcher
def _view(progress: dict[int, dict], errors: dict[int, dict] | None = None, failure: dict | None = None):
    return sw.SegmentView(failure, errors or {}, progress)


def test_vanished_ranks_need_a_peer_that_lost_its_connection() -> None:
    progress = {0: _rec(0, 60, state="running"), 1: _rec(1, 60, state="running")}
    reset = {0: {"rank": 0, "host": "c1", "type": "RuntimeError", "time": "t1",
                 "message": "[pair.cc:545] Read error [127.0.0.1]:41165: Connection reset by peer"}}
    view = _view(progress, reset)
    assert sw.vanished(view) == [1]
    assert sw.cause_of(view) == "rank_lost"
    line = sw.lost_line([1], view)
    assert line.startswith("rank(s) 1 on host c1 vanished after step 60"), line
    assert "then rank 0 on c1: RuntimeError" in line
    # a real bug first: the others were stopped by srun, not lost
    bug = {0: {"rank": 0, "host": "c1", "type": "ValueError", "message": "bad shape", "time": "t1"}}
    assert sw.vanished(_view(progress, bug)) == [] and sw.cause_of(_view(progress, bug)) == "rank_failed"
    # a rank whose parent saw it exit did not vanish
    exited = {**progress, 1: _rec(1, 60, state="exited")}
    assert sw.vanished(_view(exited, reset)) == []


def test_silent_ranks_and_the_end_time() -> None:
    now = 1000.0
    fresh = {0: _rec(0, 5, state="running", beat_time=now - 5), 1: _rec(1, 5, state="running", beat_time=now - 100)}
    assert not sw.silent(_view(fresh), now)
    stale = {r: {**p, "beat_time": now - 2 * 10 - sw.SILENT_SLACK_S - 1} for r, p in fresh.items()}
    assert sw.silent(_view(stale), now)
    unarmed = {r: {**p, "bound_s": None} for r, p in stale.items()}
    assert not sw.silent(_view(unarmed), now)
    assert sw.end_time(now, "4:57") == now + 297
    assert sw.end_time(now, "UNLIMITED") is None and sw.end_time(now, None) is None


# --------------------------------------------------------------------------- segments
def _lines(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_a_requeued_run_is_judged_by_its_last_segment(tmp_path: Path) -> None:
    rd = RunDir(tmp_path)
    rd.ranks.mkdir(parents=True)
    t = "2026-12-01T17:0{}:00.000+00:00".format
    _lines(rd.metrics, [{"kind": "start", "time": t(0), "restart_count": 0},
                        {"kind": "end", "status": "failed", "time": t(2)},
                        {"kind": "start", "time": t(4), "restart_count": 1}])
    failed = failures.failure_doc(written_by="stepwatch", cause="rank_lost", root_cause="rank(s) 1 on host c2 vanished",
                                  host="c2", time=t(1), segment="16:0")
    failures.write_failure(tmp_path, failed, first_wins=True)
    rd.error_record(0).write_text(json.dumps({"rank": 0, "host": "c1", "type": "RuntimeError",
                                              "message": "Connection reset by peer", "time": t(1)}))
    assert failures.root_cause(tmp_path) is None, "the failure belongs to the first segment"
    segments = failures.segment_history(tmp_path)
    assert failures.history_line(segments) == "running (2 segments: RANK_LOST on c2, then running)"
    assert failures.history_line(segments, ["NODE_FAIL", "RUNNING"]) == (
        "running (2 segments: NODE_FAIL on c2, then running)")

    # the second segment stalls: its failure.json replaces the first one's, which is kept aside
    stalled = failures.failure_doc(written_by="progress-watchdog", cause="stalled", root_cause="rank 1 stalled",
                                   host="c2", time=t(5), segment="16:1")
    assert failures.write_failure(tmp_path, stalled, first_wins=True)
    assert failures.root_cause(tmp_path) == "rank 1 stalled"
    assert [json.loads(p.read_text())["segment"] for p in rd.past_failures()] == ["16:0"]
    with rd.metrics.open("a") as f:
        f.write(json.dumps({"kind": "end", "status": "failed", "time": t(6)}) + "\n")
        f.write(json.dumps({"kind": "start", "time": t(8), "restart_count": 2}) + "\n")
        f.write(json.dumps({"kind": "end", "status": "completed", "time": t(9)}) + "\n")
    assert failures.root_cause(tmp_path) is None
    line = failures.history_line(failures.segment_history(tmp_path), ["REQUEUED", "PREEMPTED", "COMPLETED"])
    assert line == "completed (3 segments: RANK_LOST on c2, PREEMPTED on c2, then completed)", line


def test_accounting_names_a_segment_only_where_the_cause_came_from_outside_the_job() -> None:
    """A stalled, requeued run that accounting recorded as CANCELLED (seen on a loaded CI machine):
    the run's own record says why; a node failure, preemption or time limit says more than it."""
    stalled = {"status": "failed", "failure": {"cause": "stalled", "host": "c2"}}
    done = {"status": "completed", "failure": None}
    for state in ("CANCELLED by 0", "FAILED", "REQUEUED", ""):
        assert failures.history_line([stalled, done], [state, "COMPLETED"]) == (
            "completed (2 segments: STALLED on c2, then completed)"), state
    for state in sorted(failures.OUTSIDE_STATES):
        assert failures.history_line([stalled, done], [state, "COMPLETED"]) == (
            f"completed (2 segments: {state} on c2, then completed)"), state
    # no record of its own: accounting's word stands
    ended = {"status": None, "failure": None}
    assert failures.history_line([ended, done], ["CANCELLED by 0", "COMPLETED"]) == (
        "completed (2 segments: CANCELLED, then completed)")


def test_one_segment_has_no_history() -> None:
    assert failures.history_line([{"status": "completed", "failure": None}]) is None
