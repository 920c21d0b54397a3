"""Stop on a signal: every rank agrees on the same step, checkpoints, and (under Slurm) requeues.

* :class:`StopFlag` installs handlers for the requeue signal (``checkpoint.signal``, default
  USR2, sent by ``#SBATCH --signal=USR2@LEAD`` before the wall-time limit) and SIGTERM (scancel,
  preemption, the time limit itself). A handler only records the signal: a second signal while
  the checkpoint is being written changes nothing, so it cannot corrupt it.
* :class:`StopAgreement` makes the ranks stop after the *same* step: at each poll step every
  rank launches an asynchronous MAX all-reduce of its flag on a separate gloo group and reads
  the result of the previous one. The reduce overlaps with the following steps' compute, costs no
  device sync, and all ranks act on the same reduced value at the same step. Polls are spaced
  about ``interval_s`` apart (``checkpoint.poll_s``, 0.5 s by default): each rank proposes a step count from its own
  step time and the reduce carries the proposals too, so every rank learns the same next poll
  step. (Polling after every step cost 1.5 ms a step on 2 busy CPU cores: 25% of a tiny step,
  ~1% of a 130 ms one; bench/RESULTS.md.)
* :func:`requeue` runs ``scontrol requeue`` for the job (array tasks as ARRAYJOBID_TASKID) when
  the requeue signal (not SIGTERM: that is also how ``scancel`` stops a job) arrived, requeueing
  is enabled and the job has been requeued fewer than ``checkpoint.max_requeues`` times.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Mapping
from types import FrameType
from typing import Any

from cyclone_kit.launchers import LOCAL
from cyclone_kit.launchers.containers import REQUEUE_BY_STEPWATCH, REQUEUE_BY_VARIABLE

#: Flag values, ordered so that the MAX reduce lets a requeue request win over a plain stop.
NONE, STOP, REQUEUE = 0, 1, 2


def signal_number(name: str) -> int:
    """``"USR2"`` -> ``signal.SIGUSR2`` (names as in :data:`cyclone_kit.config.job.SIGNALS`)."""
    return int(getattr(signal, f"SIG{name}"))


class StopFlag:
    """Records the first stop request: the requeue signal or SIGTERM.

    Args:
        requeue_signal: signal name from the spec (``USR2``); SIGTERM is always handled too
            (as a plain stop, unless the requeue signal is TERM itself).
    """

    def __init__(self, requeue_signal: str = "USR2") -> None:
        self.requeue_signum = signal_number(requeue_signal)
        self.value = NONE
        self.received: list[int] = []
        self._previous: dict[int, Any] = {}

    def install(self) -> StopFlag:
        """Install the handlers (main thread only); returns self."""
        for signum in {self.requeue_signum, int(signal.SIGTERM)}:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def uninstall(self) -> None:
        """Restore the previous handlers."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)
        self.value = max(self.value, REQUEUE if signum == self.requeue_signum else STOP)

    def request(self, value: int = STOP) -> None:
        """Ask for a stop from code (e.g. a wall-time watchdog)."""
        self.value = max(self.value, value)


def catch_stop_signals(requeue_signal: str = "USR2") -> StopFlag:
    """Install the stop handlers (the requeue signal and SIGTERM) and return their flag.

    The one way they are installed: by the session when it opens (:func:`~cyclone_kit.runtime.session.open_session`),
    or earlier by the trainer's entry point, so that a signal during its slow imports is not lost.
    """
    return StopFlag(requeue_signal).install()


class StopAgreement:
    """Agree across ranks on when to stop, with an overlapped all-reduce about every ``interval_s``.

    Call :meth:`poll` after every optimizer step with the same step number on every rank;
    it returns the agreed flag (``NONE``, ``STOP`` or ``REQUEUE``), identical on all ranks.
    A request is acted on within two poll intervals (about ``2 * interval_s`` plus a step).

    Args:
        flag: this rank's :class:`StopFlag`.
        distributed: False for one process (then :meth:`poll` just reads the flag).
        every: the first poll interval in steps, and the least one.
        interval_s: the wall time to aim for between polls (0: every ``every`` steps).
        max_every: the most steps between polls.
    """

    def __init__(self, flag: StopFlag, distributed: bool, every: int = 1, interval_s: float = 0.0,
                 max_every: int = 10_000) -> None:
        self.flag, self.distributed = flag, distributed
        self.every, self.interval_s, self.max_every = max(1, every), interval_s, max(1, max_every, every)
        self.next_poll = 0  # the step of the next poll (the same on every rank)
        self._group: Any = None
        self._work: Any = None
        self._tensor: Any = None
        self._last: tuple[int, float] | None = None  # (step, time) of this rank's previous poll
        if distributed:
            import torch
            import torch.distributed as dist

            # A separate CPU group: no device sync on NCCL, no interleaving with DDP's buckets.
            self._group = dist.new_group(backend="gloo")
            self._tensor = torch.zeros(2, dtype=torch.int64)  # [flag, proposed steps to the next poll]

    def poll(self, step: int) -> int:
        """The agreed stop flag after ``step``; NONE while nobody asked (or between polls)."""
        if not self.distributed:
            return self.flag.value
        if step < self.next_poll:
            return NONE
        import torch.distributed as dist

        agreed, interval = NONE, self.every
        if self._work is not None:
            self._work.wait()
            agreed, interval = (int(v) for v in self._tensor.tolist())
        now = time.perf_counter()
        proposal = propose_interval(self._last, step, now, self.interval_s, self.every, self.max_every)
        self._last = (step, now)
        self._tensor[0], self._tensor[1] = self.flag.value, proposal
        self._work = dist.all_reduce(self._tensor, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        self.next_poll = step + max(1, interval)
        return agreed

    def finish(self) -> None:
        """Wait for an outstanding reduce (call before tearing the process group down)."""
        if self._work is not None:
            self._work.wait()
            self._work = None


def propose_interval(last: tuple[int, float] | None, step: int, now: float, interval_s: float,
                     least: int, most: int) -> int:
    """Steps to the next poll so that polls come about ``interval_s`` apart (pure).

    ``last`` is the (step, time) of the previous poll; without it, or without a target, ``least``.
    """
    if last is None or interval_s <= 0 or step <= last[0]:
        return least
    per_step = (now - last[1]) / (step - last[0])
    if per_step <= 0:
        return most
    return max(least, min(most, round(interval_s / per_step)))


def under_slurm(environ: Mapping[str, str]) -> bool:
    """True inside a real Slurm job (the local launcher's fake SLURM_JOB_ID does not count)."""
    if LOCAL.started(environ):
        return False
    return bool(environ.get("SLURM_JOB_ID") or environ.get("SLURM_ARRAY_JOB_ID"))


def should_requeue(agreed: int, requeue_enabled: bool, restart_count: int, max_requeues: int,
                   environ: Mapping[str, str]) -> tuple[bool, str]:
    """Decide whether to requeue (pure); returns (yes/no, the reason in words)."""
    if agreed != REQUEUE:
        return False, "stopped by SIGTERM (scancel or preemption): not requeued"
    if not requeue_enabled:
        return False, "checkpoint.requeue is false"
    if not under_slurm(environ):
        return False, "not running under Slurm"
    if restart_count >= max_requeues:
        return False, f"already requeued {restart_count} time(s) (checkpoint.max_requeues={max_requeues})"
    return True, f"requeue {restart_count + 1} of at most {max_requeues}"


def requeue(environ: Mapping[str, str]) -> str:
    """Run ``scontrol requeue`` for this job (array task ids as ARRAYJOBID_TASKID); returns the id.

    In a container (``CYCLONE_REQUEUE_BY=stepwatch``) the request goes into the run directory instead,
    and the step watcher requeues when the step has ended (:func:`cyclone_kit.runtime.watchers.jobstep.watch`).

    Raises:
        CommandError: scontrol failed or timed out.
    """
    from cyclone_kit.core.proc import run_command
    from cyclone_kit.slurm.argv import scontrol_requeue
    from cyclone_kit.slurm.env import requeue_target

    target = requeue_target(environ)
    if environ.get(REQUEUE_BY_VARIABLE) == REQUEUE_BY_STEPWATCH and environ.get("CYCLONE_RUN_DIR"):
        from cyclone_kit.rundir.layout import RunDir

        RunDir(environ["CYCLONE_RUN_DIR"]).write_requeue_request(target)
        sys.stderr.write(f"cyclone_kit: asked the step watcher to requeue Slurm job {target} when the step ends "
                         "(a container has no scontrol)\n")
        return target
    run_command(scontrol_requeue(target), timeout=60)
    sys.stderr.write(f"cyclone_kit: requeued Slurm job {target}\n")
    return target
