"""The progress watchdog of a rank: a stalled step ends the job within a bound, naming the rank that stopped.

A rank that hangs (a deadlock, a read from a dead file system, a process stopped with SIGSTOP,
an infinite loop) leaves every other rank waiting inside a collective: nothing fails, nothing
is written, and the job burns its whole wall time. Every rank therefore runs a
:class:`ProgressWatch`, a daemon thread fed by the training loop (:meth:`ProgressWatch.beat`
after every optimizer step: the built-in engines and ``ck.log_step`` call it through the
:class:`~cyclone_kit.runtime.session.Session`):

* it measures the step time and derives the **bound** (:func:`stall_bound`): ``max(floor,
  factor x median step)`` (``checkpoint.stall_floor_s``, default 60 s, and
  ``checkpoint.stall_factor``, default 20), armed once :data:`MIN_STEPS` steps were timed (the
  start-up is covered by the process-group timeout); checkpoints and validation are not steps
  and are excluded (:meth:`ProgressWatch.paused`);
* inside such a **pause** no step bound applies (a validation pass or a checkpoint write may rightly
  take long), but a hang there would otherwise end as a peer's collective timeout that blames the
  rank that waited: with peers and a known process-group timeout, a rank whose main thread has
  waited inside a collective for the pause's bound (:func:`pause_bound`, the step bound's ceiling)
  says ``stalled`` (waiting), and a paused rank that such a peer waits for says ``stalled`` too, with
  its stack (:func:`pause_verdict`): the usual agreement below then names it;
* every few seconds it writes this rank's **progress record** (``progress/rank-N.json``:
  step, time of the last step, bound, state), read by its peers and by the batch host's step
  watcher (:mod:`cyclone_kit.runtime.watchers.jobstep`);
* when this rank made no step for longer than the bound, it dumps every thread's Python stack
  (:mod:`faulthandler`), notes whether the main thread waits inside a collective, marks its
  record ``stalled``, waits a few seconds for its peers' records (longer, up to
  :data:`SETTLE_MAX_FACTOR` x that, for a peer still writing its record: alive, yet to decide), and picks the rank(s) that
  stopped making progress with :func:`choose_stuck` (the fewest steps; among those, the ones
  *not* waiting for a peer; a rank that did not answer counts as stuck). A rank that makes a step
  while it waits (the peer it waited for caught up) takes its stall back. The stuck rank's error
  record carries its stack; ``failure.json`` (cause ``stalled``, first writer wins) names it.
  The rank that wrote ``failure.json`` requeues the job under Slurm when ``checkpoint.requeue``
  allows it, then every stalled rank leaves with :data:`STALL_EXIT_CODE`, so the launcher (the
  local one, or ``srun --kill-on-bad-exit``) stops the rest.

Stdlib only, no torch: the decision rules are pure functions tested on records.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Unix time of the job's end, exported by the step watcher (:mod:`cyclone_kit.runtime.watchers.jobstep`).
END_TIME_VAR = "CYCLONE_JOB_END_TIME"
#: Set by the step watcher for the ranks: it, not a stalled rank, requeues the job.
STEPWATCH_VAR = "CYCLONE_STEPWATCH"
#: Exit status of a rank ended by its progress watchdog (as ``timeout(1)``'s).
STALL_EXIT_CODE = 124
#: Steps timed before the bound is armed.
MIN_STEPS = 3
#: Step intervals kept for the median.
WINDOW = 101
#: The bound's ceiling as a share of the process group's timeout: the watchdog, which looks every
#: ``check_interval`` (a tenth of the bound, <= 5 s), decides by 0.66 x the timeout (at 30 s, the least
#: timeout: 18 + 1.8 s), a third of it left for a loaded machine's late wake-ups before a peer's collective
#: times out. (0.75 left 5 s at 30 s: a fresh run on a busy machine saw gloo's timeout come first.)
COLLECTIVE_SHARE = 0.6
#: A stalled rank waits for a live peer's verdict up to this many settle times (see :func:`live_undecided`).
SETTLE_MAX_FACTOR = 3.0
#: Seconds a main thread that failed while its watchdog ends the rank waits for that exit (a bound).
PARK_S = 120.0
#: Set once a watchdog of this process decided that its rank stalled (it will leave with STALL_EXIT_CODE).
_STALLING = threading.Event()
#: Innermost frames (path fragments) of a main thread that is waiting for its peers: a collective,
#: DDP's gradient reduction inside backward, Horovod, cyclone_kit's own stop agreement and barriers.
WAIT_PATHS = ("/torch/distributed/", "/torch/autograd/", "/torch/nn/parallel/", "/torch/_tensor.py",
              "/horovod/", "/cyclone_kit/runtime/signals.py", "/cyclone_kit/runtime/session.py")


@dataclass(frozen=True)
class StallPolicy:
    """When a rank counts as stalled: no step for ``max(floor_s, factor x median step)``.

    Attributes:
        floor_s: the least bound in seconds (``checkpoint.stall_floor_s``; 0 turns the watchdog off).
        factor: the bound in median step times (``checkpoint.stall_factor``).
        ceiling_s: the largest bound (None: none): below the process group's timeout, see
            :meth:`below_collectives`.
    """

    floor_s: float = 60.0
    factor: float = 20.0
    ceiling_s: float | None = None

    @classmethod
    def below_collectives(cls, floor_s: float, factor: float, pg_timeout_s: float | None) -> StallPolicy:
        """The policy of a rank whose peers' collectives time out after ``pg_timeout_s`` (None: unknown).

        A peer waiting for a stopped rank fails when its collective times out; a bound past that is never
        reached and the stopped rank is never named (the run fails with the peer's timeout instead). So
        the bound is kept at :data:`COLLECTIVE_SHARE` of the timeout, floor included.
        """
        ceiling = None if not pg_timeout_s else COLLECTIVE_SHARE * float(pg_timeout_s)
        return cls(floor_s, factor, ceiling)

    @property
    def enabled(self) -> bool:
        """False when ``floor_s`` is 0."""
        return self.floor_s > 0


# --------------------------------------------------------------------------- pure rules
def stall_bound(policy: StallPolicy, intervals: Sequence[float]) -> float | None:
    """Seconds without a step after which a rank is stalled; None while unarmed (pure)."""
    if not policy.enabled or len(intervals) < MIN_STEPS:
        return None
    bound = max(policy.floor_s, policy.factor * statistics.median(intervals))
    return bound if policy.ceiling_s is None else min(bound, policy.ceiling_s)


def check_interval(bound: float | None) -> float:
    """Seconds between the watchdog's looks: a tenth of the bound, within 0.2-5 s (pure)."""
    return 5.0 if bound is None else min(5.0, max(0.2, bound / 10))


def beat_interval(bound: float | None) -> float:
    """Seconds between progress-record writes: a tenth of the bound, within 1-5 s (pure)."""
    return 2.0 if bound is None else min(5.0, max(1.0, bound / 10))


def settle_time(bound: float | None) -> float:
    """Seconds a stalled rank waits for its peers' records before it decides (pure)."""
    return min(15.0, max(3.0, 3 * check_interval(bound)))


def live_undecided(records: Mapping[int, Mapping[str, Any] | None], rank: int, now: float) -> bool:
    """Whether a peer of ``rank`` has not said ``stalled`` yet but wrote its record lately (pure): within two
    of its beat intervals and a second. A stopped or hung peer wrote last when it stopped, a bound or more
    ago; a live one (its rank waiting in a collective) writes every beat interval."""
    return any(r != rank and isinstance(rec, Mapping) and rec.get("state") != "stalled" and wrote_lately(rec, now)
               for r, rec in records.items())


def wrote_lately(rec: Mapping[str, Any], now: float) -> bool:
    """Whether a rank's watchdog wrote its record within two of its beat intervals and a second of ``now`` (pure):
    the rank is alive, whatever its main thread does."""
    return now - float(rec.get("beat_time") or 0) <= 2 * beat_interval(rec.get("bound_s")) + 1


def waiting_for_peers(frames: Sequence[str]) -> bool:
    """True when the innermost of ``frames`` (file names, outermost first) is inside a collective (pure)."""
    return bool(frames) and any(part in frames[-1].replace("\\", "/") for part in WAIT_PATHS)


#: Verdicts of :func:`idle_verdict` on a rank past its bound without a step.
STALLED, WORKING, UNSURE = "stalled", "working", "unsure"


def pause_bound(policy: StallPolicy, world_size: int) -> float | None:
    """Seconds a paused rank (a validation pass, a checkpoint: :meth:`ProgressWatch.paused`) may wait inside a
    collective before it says ``stalled`` (pure): the step bound's ceiling, :data:`COLLECTIVE_SHARE` of the process
    group's timeout, which that collective fails at anyway (blaming the rank that waited). None, not watched: one
    rank (no peer to wait for), the watchdog off, or the timeout unknown."""
    if not policy.enabled or world_size < 2 or not policy.ceiling_s:
        return None
    return policy.ceiling_s


def pause_verdict(bound_s: float, waiting_s: float | None, silent_s: float | None, paused_s: float,
                  peers: Mapping[int, Mapping[str, Any] | None] | None, rank: int, step: int | None) -> str:
    """What a rank paused for ``paused_s`` seconds is doing (pure): :data:`STALLED` or :data:`WORKING`.

    Stalled: its main thread has waited inside one collective for ``bound_s``: seen inside a collective at
    every look for that long (``waiting_s``; None: not there now) and run no Python meanwhile (``silent_s``,
    the main-thread probe's; None: no probe, the frames alone decide), so a pipeline stage that waits for its
    neighbour at every micro-batch of a long validation pass is not taken for one long wait; or a peer
    (``peers``: the progress records of this segment, None: not read) says ``stalled``, waiting in a
    collective, at this rank's step, and this rank has been paused for the bound: the peer waits for it (for
    this pass to end), whatever it does meanwhile (sleeps, sits in one C call, loops in Python). A pass that
    rightly outlasts the bound while nobody waits for it is working.
    """
    if waiting_s is not None and waiting_s >= bound_s and (silent_s is None or silent_s >= bound_s):
        return STALLED
    if paused_s < bound_s or not peers:
        return WORKING
    for r, rec in peers.items():
        if (r != rank and isinstance(rec, Mapping) and rec.get("state") == "stalled" and rec.get("waiting") is True
                and rec.get("step") == step):
            return STALLED
    return WORKING


def idle_verdict(busy_share: float, idle_s: float, bound_s: float, cpu_s: float, frames: Sequence[str],
                 silent_s: float | None, waiting_s: float | None = None) -> str:
    """What a rank with no step for ``idle_s`` (past its bound ``bound_s``) is doing (pure):
    :data:`STALLED`, :data:`WORKING` (the wait starts again) or :data:`UNSURE` (look again).

    Stalled: its main thread (``frames``) has waited inside a collective for the bound (``waiting_s``:
    seconds since the watchdog first saw it there; None: unknown, the frames alone decide); a shorter
    wait is unsure (a rank that validated, the wait restarted, and now waits for a peer still
    validating a little longer has waited only since its own pass ended); or it has run no Python for at
    least the bound (``silent_s``: it sits in one C call that has not returned, whatever CPU that
    call burns: on a GPU a hung rank waits at its next host sync, ``loss.item()``, spinning a core
    under CUDA's default scheduling behind a collective that never ends); or it used less than
    ``busy_share`` of a core (``cpu_s`` CPU seconds over ``idle_s``: it sleeps, waits on a lock or a
    dead file system). Unsure: busy, but in one C call for less than the bound so far. Working: it
    computes and its main thread keeps returning to Python (a validation pass). ``silent_s`` None:
    the main thread cannot be probed, the CPU alone decides.
    """
    if idle_s <= 0:
        return STALLED
    if waiting_for_peers(frames):
        return STALLED if waiting_s is None or waiting_s >= bound_s else UNSURE
    if silent_s is not None and silent_s >= bound_s:
        return STALLED
    if cpu_s / idle_s < busy_share:
        return STALLED
    return UNSURE if silent_s else WORKING


class MainThreadProbe:
    """How long the main thread has run no Python: a pending call (``Py_AddPendingCall``), which CPython
    runs only in the main thread between two bytecodes, posted by the watchdog. While the call posted
    at ``t`` has not run, the main thread has been inside one C call (a CUDA sync, a read, a spin)
    since ``t``; a thread that returns to Python runs it within one call. No signal is sent: nothing
    in the main thread is interrupted.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        import ctypes

        self._clock = clock
        self._posted: float | None = None
        self._add = ctypes.pythonapi.Py_AddPendingCall
        self._add.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._add.restype = ctypes.c_int
        self._callback = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(self._ran)
        _PROBES.append(self)  # a pending call may outlive the watch: its callback must stay alive

    def _ran(self, _arg: Any) -> int:
        self._posted = None
        return 0

    def post(self) -> None:
        """Post a probe unless one is outstanding (from the watchdog's thread)."""
        if self._posted is not None:
            return
        self._posted = self._clock()
        if self._add(self._callback, None) != 0:  # the interpreter's queue is full: try at the next look
            self._posted = None

    def silent_s(self) -> float:
        """Seconds since the outstanding probe was posted (0.0: none outstanding, the main thread ran it)."""
        posted = self._posted
        return 0.0 if posted is None else max(0.0, self._clock() - posted)


#: Every probe made (kept alive for their pending calls).
_PROBES: list[MainThreadProbe] = []


def main_thread_probe() -> MainThreadProbe | None:
    """A :class:`MainThreadProbe`, or None where ctypes cannot reach ``Py_AddPendingCall`` (not CPython)."""
    try:
        return MainThreadProbe()
    except (ImportError, AttributeError, OSError):
        return None


def choose_stuck(records: Mapping[int, Mapping[str, Any] | None], world_size: int) -> list[int]:
    """The ranks that stopped making progress, from every rank's progress record (pure).

    ``records`` maps a rank to its record of this segment (None: it wrote none, or none this
    segment). A rank that did not answer (no record, or not marked ``stalled``) is a suspect
    like one that is not waiting for a peer. The stuck ranks are the suspects with the fewest
    steps; when every rank with the fewest steps waits inside a collective, all of those.
    """
    keys: dict[int, tuple[int, int]] = {}
    for rank in range(world_size):
        rec = records.get(rank)
        if rec is None:
            keys[rank] = (-1, 0)
            continue
        step = rec.get("step")
        waiting = rec.get("state") == "stalled" and rec.get("waiting") is True
        keys[rank] = (int(step) if isinstance(step, int) else -1, 1 if waiting else 0)
    if not keys:
        return []
    least = min(keys.values())
    return [rank for rank, key in keys.items() if key == least]


def stall_requeue(requeue: bool, max_requeues: int, restart_count: int) -> tuple[bool, str]:
    """Whether a stalled job is requeued, and why (pure): ``checkpoint.requeue`` and requeues left."""
    if not requeue:
        return False, "stalled; checkpoint.requeue is false: not requeued"
    if restart_count >= max_requeues:
        return False, f"stalled; already requeued {restart_count} time(s) (checkpoint.max_requeues={max_requeues})"
    return True, f"stalled: requeue {restart_count + 1} of at most {max_requeues}, from the last checkpoint"


#: Seconds kept between a collective's timeout and the job's end.
END_MARGIN_S = 60


def collective_timeout(pg_timeout_s: int, end_time: str | None, now: float) -> int:
    """The process group's timeout: ``pg_timeout_s``, but below the job's remaining wall time (pure).

    ``end_time`` is ``$CYCLONE_JOB_END_TIME`` (Unix seconds; None or unparsable: unknown). A
    collective that waits for a dead or hung peer then fails while there is time to requeue.
    """
    try:
        remaining = float(end_time) - now if end_time else None
    except ValueError:
        remaining = None
    if remaining is None:
        return pg_timeout_s
    return int(max(30, min(pg_timeout_s, remaining - END_MARGIN_S)))


def describe_bound(rec: Mapping[str, Any]) -> str:
    """``bound 60 s = max(floor 60 s, 20 x median step 0.120 s)`` for a progress record (pure); a bound held
    below the process group's timeout says so."""
    rule = (f"max(checkpoint.stall_floor_s {rec.get('floor_s', 0):g} s, "
            f"{rec.get('factor', 0):g} x median step {rec.get('median_step_s') or 0:.3f} s)")
    bound, ceiling = rec.get("bound_s") or 0, rec.get("ceiling_s")
    if rec.get("pause"):
        return (f"bound {bound:.1f} s = {COLLECTIVE_SHARE:g} x the process group's timeout, in {rec['pause']}, "
                "not a step: a peer's collective would time out first")
    if ceiling and bound >= ceiling:
        return (f"bound {bound:.1f} s = {COLLECTIVE_SHARE:g} x the process group's timeout, below {rule}: "
                "a peer's collective would time out first")
    return f"bound {bound:.1f} s = {rule}"


#: Why a stuck rank that did not say ``stalled`` has no stack, by whether it was alive (:func:`wrote_lately`).
SILENT_WHY = {False: "did not answer (stopped, frozen, or its node is gone): no stack",
              True: "did not say it stalled, though its watchdog still wrote (alive, computing outside any "
                    "collective: a pass or a loop of its own longer than the bound): no stack"}


def stall_line(stuck: Sequence[int], records: Mapping[int, Mapping[str, Any] | None], world_size: int,
               now: float | None = None) -> str:
    """The root cause of a stall, in one line (pure); ``now`` (Unix time; None: unknown) tells a stuck rank that
    did not answer from one alive but busy."""
    parts = []
    for rank in stuck:
        rec = records.get(rank) or {}
        where = f"rank {rank} on host {rec.get('host', '?')}" + (f" (pid {rec['pid']})" if rec.get("pid") else "")
        if rec.get("state") != "stalled":
            alive = now is not None and wrote_lately(rec, now)
            parts.append(f"{where} stopped making progress after step {rec.get('step', '?')} and {SILENT_WHY[alive]}")
        elif rec.get("pause"):
            parts.append(f"{where} stopped making progress in {rec['pause']} after step {rec.get('step')}: "
                         f"{pause_what(rec)} ({describe_bound(rec)}), in {rec.get('where') or '?'}")
        else:
            parts.append(f"{where} stopped making progress after step {rec.get('step')}: no step for "
                         f"{rec.get('idle_s', 0):.1f} s ({describe_bound(rec)}), in {rec.get('where') or '?'}")
    waiters = [r for r in range(world_size) if r not in stuck and (records.get(r) or {}).get("waiting")]
    line = "; ".join(parts)
    if waiters:
        line += f"; rank(s) {', '.join(map(str, waiters))} waited for it in a collective"
    return line


def pause_what(rec: Mapping[str, Any]) -> str:
    """What a rank that stalled in a pause was doing, from its record (pure)."""
    if rec.get("waiting"):
        return f"waited inside a collective for {rec.get('waited_s') or 0:.1f} s"
    return f"its peers waited for it; paused for {rec.get('paused_s') or 0:.1f} s"


def stall_error_record(rec: Mapping[str, Any], when: str, now: float | None = None) -> dict[str, Any]:
    """The error record of a stuck rank, from its progress record (pure): its stack when it answered; ``now``
    as for :func:`stall_line`."""
    rank = int(rec.get("rank", -1))
    if rec.get("state") == "stalled" and rec.get("pause"):
        message = (f"no progress in {rec['pause']} after step {rec.get('step')}: {pause_what(rec)} "
                   f"({describe_bound(rec)}); the main thread is in {rec.get('where') or '?'}")
        source = "progress-watchdog"
    elif rec.get("state") == "stalled":
        message = (f"no optimizer step for {rec.get('idle_s', 0):.1f} s after step {rec.get('step')} "
                   f"({describe_bound(rec)}); the main thread is in {rec.get('where') or '?'}")
        source = "progress-watchdog"
    else:
        alive = now is not None and wrote_lately(rec, now)
        message = f"stopped making progress after step {rec.get('step', '?')} and {SILENT_WHY[alive]}"
        source = "peer-watchdog"
    return {"rank": rank, "host": rec.get("host", "?"), "pid": rec.get("pid"), "time": when, "type": "Stalled",
            "message": message, "traceback": rec.get("stack") or "", "step": rec.get("step"),
            "bound_s": rec.get("bound_s"), "segment": rec.get("segment"), "source": source}


def stall_failure(stuck: Sequence[int], records: Mapping[int, Mapping[str, Any] | None], world_size: int,
                  job_id: str | None, segment: str) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    """The ``failure.json`` of a stall and the stuck ranks' error records (pure but for the time)."""
    from cyclone_kit.rundir.failures import failure_doc, utc_now

    when, now = utc_now(), time.time()
    errors = {r: stall_error_record(records.get(r) or {"rank": r}, when, now) for r in stuck}
    first = errors[stuck[0]] if stuck else None
    ranks = [{k: (records.get(r) or {}).get(k) for k in ("rank", "host", "pid", "step", "state", "waiting", "where")}
             | {"rank": r} for r in range(world_size)]
    doc = failure_doc(written_by="progress-watchdog", cause="stalled", root_cause=stall_line(stuck, records, world_size, now),
                      first=first, job_id=job_id, ranks=ranks, time=when, segment=segment, stuck=list(stuck))
    return doc, errors


def park_if_stalling() -> None:
    """Called by a failing main thread: when this rank's watchdog is ending it, wait for that exit.

    Once every rank agreed on a stall, the stuck rank leaves and a waiting rank's collective fails
    under it ("Connection reset by peer"). Its error record would blame the waiter; its watchdog
    is about to leave with :data:`STALL_EXIT_CODE` after writing the stall's records, so the main
    thread waits (at most :data:`PARK_S`) instead of recording a failure of its own.
    """
    if _STALLING.is_set():
        threading.Event().wait(PARK_S)


# --------------------------------------------------------------------------- the stack
def main_thread_file() -> str:
    """The file name of the main thread's innermost frame ("" when it has none): cheap enough for every look."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    return frame.f_code.co_filename if frame is not None else ""


def main_thread_frames() -> tuple[list[str], str]:
    """The main thread's frame file names (outermost first) and its innermost frame as ``file:line in func``."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return [], "?"
    summary = traceback.extract_stack(frame)
    if not summary:
        return [], "?"
    last = summary[-1]
    return [f.filename for f in summary], f"{last.filename}:{last.lineno} in {last.name}"


def dump_stacks() -> str:
    """Every thread's Python stack, as :func:`faulthandler.dump_traceback` writes it."""
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(f, all_threads=True)
        f.flush()
        f.seek(0)
        return f.read()


# --------------------------------------------------------------------------- the watchdog
class ProgressWatch:
    """This rank's progress watchdog (a daemon thread); see the module doc.

    Args:
        records: reads and writes progress records: ``write(rank, rec)``, ``read_all() -> {rank: rec}``.
        rank, world_size, host: where this rank sits.
        policy: the :class:`StallPolicy`.
        segment: identifies this run segment (job id and restart count); records of others are ignored.
        on_stall: called once on a stall with ``(stuck ranks, records, own record)`` before this
            rank leaves; it writes the error record and ``failure.json`` and may requeue.
        exit: how a stalled rank leaves (default ``os._exit``; tests pass their own).
        settle_s: seconds to wait for the peers' records (default :func:`settle_time`).
        busy_share: for a loop that cannot say all that is not a step (a script without the API, fed by
            its optimizer steps; a script on the API, whose own validation ck is not told of): past the
            bound, a rank whose main thread is not inside a
            collective, keeps returning to Python and used at least this share of a core since its
            last step is busy (a validation pass, a checkpoint), not stalled: the wait starts again
            (see :func:`idle_verdict`). None (the engines, which mark their pauses): no such exception.
        cpu_clock: this process's CPU seconds (default :func:`time.process_time`).
        probe: tells how long the main thread ran no Python (``post()``, ``silent_s()``); default with
            ``busy_share`` or a :func:`pause_bound`: a :class:`MainThreadProbe`, posted at every look.
    """

    def __init__(self, records: Any, rank: int, world_size: int, host: str, policy: StallPolicy, segment: str,
                 on_stall: Callable[[list[int], dict[int, Any], dict[str, Any]], None],
                 exit: Callable[[int], None] = os._exit, settle_s: float | None = None,
                 busy_share: float | None = None, cpu_clock: Callable[[], float] = time.process_time,
                 probe: Any = None) -> None:
        self.records, self.rank, self.world_size, self.host = records, rank, world_size, host
        self.policy, self.segment, self.on_stall, self._exit = policy, segment, on_stall, exit
        self.settle_s, self.busy_share, self._cpu_clock = settle_s, busy_share, cpu_clock
        self.pause_bound = pause_bound(policy, world_size)
        self.probe = probe if probe is not None or (busy_share is None and self.pause_bound is None) \
            else main_thread_probe()
        self.step: int | None = None
        self._t_last = time.monotonic()
        self._cpu_last = cpu_clock()
        self._waiting_since: float | None = None  # when a look first saw the main thread inside a collective
        self._intervals: deque[float] = deque(maxlen=WINDOW)
        self._pauses: tuple[str, ...] = ()  # what each open pause is, outermost first (replaced, never mutated)
        self._pause_id = 0  # counts the outermost pauses: a stall declared in one is taken back once it ends
        self._pause_t0 = 0.0
        self._stop = threading.Event()
        self._armed = threading.Event()  # set by the beat that arms the bound: the thread's next look comes now
        self._thread: threading.Thread | None = None
        self._last_write = 0.0
        self._last_read = 0.0  # when a look inside a long pause last read the peers' records
        self.stalled = False

    # -- fed by the training loop (main thread): cheap
    def beat(self, step: int) -> None:
        """Optimizer step ``step`` is done."""
        now = time.monotonic()
        if self.step is not None and step > self.step and not self._pauses:
            self._intervals.append((now - self._t_last) / (step - self.step))
            if len(self._intervals) == MIN_STEPS:  # armed: the thread may be in an unarmed (5 s) wait
                self._armed.set()
        self.step, self._t_last = step, now
        if self.busy_share is not None:
            self._cpu_last = self._cpu_clock()

    @contextlib.contextmanager
    def paused(self, what: str = "work that is not a step") -> Iterator[None]:
        """Not steps: a checkpoint, a validation pass (``what`` names it in a stall's records, e.g.
        ``"the validation pass of epoch 3"``). The time inside counts neither way for the step bound; a hang inside is
        still named when peers wait for it (:func:`pause_verdict`)."""
        if not self._pauses:
            self._pause_t0 = time.monotonic()
            self._pause_id += 1
        self._pauses = (*self._pauses, what)
        try:
            yield
        finally:
            self._pauses = self._pauses[:-1]
            self._t_last = time.monotonic()

    # -- the thread
    def start(self) -> ProgressWatch:
        """Start the thread (returns self); a no-op when the policy is off."""
        if self.policy.enabled and self._thread is None:
            self._write(self.record("running"))
            self._thread = threading.Thread(target=self._loop, name="cyclone_kit-progress", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (the segment ended) and mark this rank's record ``ended``."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._armed.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
            self._write(self.record("ended"))

    def bound(self) -> float | None:
        """The bound now (None while unarmed)."""
        return stall_bound(self.policy, list(self._intervals))

    def record(self, state: str, **extra: Any) -> dict[str, Any]:
        """This rank's progress record now."""
        bound, intervals = self.bound(), list(self._intervals)
        idle = time.monotonic() - self._t_last
        return {"rank": self.rank, "host": self.host, "pid": os.getpid(), "segment": self.segment, "state": state,
                "step": self.step, "progress_time": time.time() - idle, "beat_time": time.time(),
                "idle_s": round(idle, 3), "bound_s": bound,
                "median_step_s": statistics.median(intervals) if intervals else None,
                "floor_s": self.policy.floor_s, "factor": self.policy.factor, "ceiling_s": self.policy.ceiling_s,
                **extra}

    def _write(self, rec: Mapping[str, Any]) -> None:
        self._last_write = time.monotonic()
        try:
            self.records.write(self.rank, rec)
        except OSError as e:  # a full or gone file system must not kill the rank from here
            sys.stderr.write(f"cyclone_kit: could not write the progress record: {e}\n")

    def _loop(self) -> None:
        while True:
            bound = self.bound()
            # unarmed: look every 5 s (a pause's bound may ask for more often), or at once when a beat arms the
            # bound (a stall is then one bound away)
            (self._armed if bound is None else self._stop).wait(check_interval(bound or self.pause_bound))
            if self._stop.is_set():
                return
            bound = self.bound()
            now = time.monotonic()
            pauses = self._pauses
            if self.probe is not None:
                self.probe.post()
            if self.busy_share is not None or pauses:  # how long the main thread has waited inside a collective
                waiting = waiting_for_peers([main_thread_file()])
                self._waiting_since = (self._waiting_since if self._waiting_since is not None else now) if waiting else None
            else:
                self._waiting_since = None
            if pauses:
                if self._pause_stalled(now, pauses[-1]):
                    return
            elif bound is not None and now - self._t_last > bound:
                if self.busy_share is None:
                    if self._stall():
                        return
                    continue
                cpu = self._cpu_clock()
                frames, _ = main_thread_frames()
                silent = self.probe.silent_s() if self.probe is not None else None
                waited = 0.0 if self._waiting_since is None else now - self._waiting_since
                verdict = idle_verdict(self.busy_share, now - self._t_last, bound, cpu - self._cpu_last, frames, silent,
                                       waited)
                if verdict == STALLED:
                    if self._stall():
                        return
                    continue
                if verdict == WORKING:  # a pass that is no step: the wait starts again
                    self._t_last, self._cpu_last = now, cpu
            if now - self._last_write >= beat_interval(bound):
                self._write(self.record("running"))

    def _pause_stalled(self, now: float, what: str) -> bool:
        """A look inside a pause (:func:`pause_verdict`); True when this rank stalled and left (a test's ``exit``
        returned). Peers' records are read only once the pause outlasted its bound, at most every beat."""
        bound = self.pause_bound
        if bound is None:
            return False
        paused_s = now - self._pause_t0
        waited = None if self._waiting_since is None else now - self._waiting_since
        silent = self.probe.silent_s() if self.probe is not None else None
        verdict = pause_verdict(bound, waited, silent, paused_s, None, self.rank, self.step)
        if verdict != STALLED and paused_s >= bound and waited is None and now - self._last_read >= beat_interval(bound):
            self._last_read = now
            verdict = pause_verdict(bound, None, silent, paused_s, self.current_records(), self.rank, self.step)
        if verdict != STALLED:
            return False
        return self._stall(bound, pause=what, bound_s=bound, paused_s=round(paused_s, 3),
                           waited_s=None if waited is None else round(waited, 3))

    def _stall(self, bound: float | None = None, **pause: Any) -> bool:
        """No step for longer than the bound (or, with ``pause``, no end to a pause a peer waits for: the
        pause's fields for the record): record, agree on the stuck rank(s), hand over, leave (True; a
        test's ``exit`` returns). False: this rank made a step, or its pause ended, while it waited for its
        peers' records (the peer it waited for caught up): it stands down, its record says ``running``
        again, the watch goes on."""
        self.stalled = True
        _STALLING.set()  # before this rank says "stalled": a peer that acts on it may break our collective
        pause_id = self._pause_id if pause else None
        frames, where = main_thread_frames()
        own = self.record("stalled", waiting=waiting_for_peers(frames), where=where, stack=dump_stacks(), **pause)
        self._write(own)
        settle = settle_time(bound if bound is not None else self.bound()) if self.settle_s is None else self.settle_s
        start = time.monotonic()
        records: dict[int, Any] = {}
        while True:
            if self._moved_on(own["step"], pause_id):
                return self._stand_down()
            records = self.current_records()
            if all((records.get(r) or {}).get("state") == "stalled" for r in range(self.world_size)):
                break
            waited = time.monotonic() - start
            # past the settle time, wait on (up to SETTLE_MAX_FACTOR x) only for a peer that is alive and yet to
            # decide: a busy machine may run its watchdog late; a stopped or hung peer never writes again
            if waited >= settle and (waited >= SETTLE_MAX_FACTOR * settle
                                     or not live_undecided(records, self.rank, time.time())):
                break
            time.sleep(0.2)
        if self._moved_on(own["step"], pause_id):
            return self._stand_down()
        records = self.current_records()
        records[self.rank] = own
        stuck = choose_stuck(records, self.world_size)
        try:
            self.on_stall(stuck, records, own)
        except Exception as e:  # leave anyway: the launcher stops the rest
            sys.stderr.write(f"cyclone_kit: progress watchdog: {type(e).__name__}: {e}\n")
        what = f"in {own['pause']}: {pause_what(own)}" if pause else f"no step for {own['idle_s']:.1f} s"
        sys.stderr.write(f"cyclone_kit: rank {self.rank}: {what} ({describe_bound(own)}); "
                         f"stuck: rank(s) {', '.join(map(str, stuck))}; leaving\n")
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        self._exit(STALL_EXIT_CODE)
        return True

    def _moved_on(self, step: int | None, pause_id: int | None) -> bool:
        """Whether this rank made a step since ``step``, or left the pause ``pause_id`` (None: not in one)."""
        return self.step != step or (pause_id is not None and (pause_id != self._pause_id or not self._pauses))

    def _stand_down(self) -> bool:
        """A stall this rank declared, taken back: it made a step since (see :meth:`_stall`)."""
        self.stalled = False
        _STALLING.clear()
        self._waiting_since = None
        self._write(self.record("running"))
        return False

    def current_records(self) -> dict[int, Any]:
        """Every rank's progress record of this segment (others' segments dropped)."""
        return {r: rec for r, rec in self.records.read_all().items()
                if isinstance(rec, dict) and rec.get("segment") == self.segment}


class RunDirRecords:
    """Progress records as files of a run directory (``progress/rank-N.json``)."""

    def __init__(self, run_dir: Path) -> None:
        from cyclone_kit.rundir.layout import RunDir

        self.rd = RunDir(run_dir)

    def write(self, rank: int, rec: Mapping[str, Any]) -> None:
        """Write one rank's record atomically."""
        from cyclone_kit.rundir.fileio import write_atomic

        path = self.rd.progress_record(rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(dict(rec), default=str) + "\n")

    def read_all(self) -> dict[int, Any]:
        """rank -> record, for every record file there is."""
        from cyclone_kit.rundir.fileio import read_json

        out = {}
        for path in self.rd.progress_records():
            rec = read_json(path)
            if isinstance(rec, dict) and isinstance(rec.get("rank"), int):
                out[rec["rank"]] = rec
        return out


def mark_exited(run_dir: Path, rank: int, pid: int, returncode: int) -> None:
    """The rank's parent saw it exit: its progress record (if it is that process's) says so.

    A rank whose record still says ``running`` after its step ended vanished together with its
    parent (see :func:`cyclone_kit.runtime.watchers.jobstep.vanished`).
    """
    records = RunDirRecords(run_dir)
    rec = records.read_all().get(rank)
    if isinstance(rec, dict) and rec.get("pid") == pid and rec.get("state") == "running":
        with contextlib.suppress(OSError):
            records.write(rank, {**rec, "state": "exited", "exit_code": returncode, "beat_time": time.time()})
