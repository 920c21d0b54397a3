"""Stop on a signal: every rank agrees on the same step, checkpoints, and (under Slurm) requeues.

* :class:`StopFlag` installs handlers for the requeue signal (``checkpoint.signal``, default
  USR2, sent by ``#SBATCH --signal=USR2@LEAD`` before the wall-time limit) and SIGTERM (scancel,
  preemption, the time limit itself). A handler only records the signal: a second signal while
  the checkpoint is being written changes nothing, so it cannot corrupt it.
* :class:`StopAgreement` makes the ranks stop after the *same* step: every ``every`` steps each
  rank launches an asynchronous MAX all-reduce of its flag on a separate gloo group and reads
  the result of the previous one. The reduce overlaps with the next step's compute, costs no
  device sync, and all ranks act on the same reduced value at the same step.
* :func:`requeue` runs ``scontrol requeue`` for the job (array tasks as ARRAYJOBID_TASKID) when
  the requeue signal (not SIGTERM: that is also how ``scancel`` stops a job) arrived, requeueing
  is enabled and the job has been requeued fewer than ``checkpoint.max_requeues`` times.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Mapping
from types import FrameType
from typing import Any

#: Flag values, ordered so that the MAX reduce lets a requeue request win over a plain stop.
NONE, STOP, REQUEUE = 0, 1, 2


def signal_number(name: str) -> int:
    """``"USR2"`` -> ``signal.SIGUSR2`` (names as in :data:`cyclone_kit.config.SIGNALS`)."""
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


class StopAgreement:
    """Agree across ranks on when to stop, with an overlapped all-reduce every ``every`` steps.

    Call :meth:`poll` after every optimizer step with the same step number on every rank;
    it returns the agreed flag (``NONE``, ``STOP`` or ``REQUEUE``), identical on all ranks.
    A request is acted on within ``2 * every`` steps.
    """

    def __init__(self, flag: StopFlag, distributed: bool, every: int = 1) -> None:
        self.flag, self.distributed, self.every = flag, distributed, max(1, every)
        self._group: Any = None
        self._work: Any = None
        self._tensor: Any = None
        if distributed:
            import torch
            import torch.distributed as dist

            # A separate CPU group: no device sync on NCCL, no interleaving with DDP's buckets.
            self._group = dist.new_group(backend="gloo")
            self._tensor = torch.zeros(1, dtype=torch.int32)

    def poll(self, step: int) -> int:
        """The agreed stop flag after ``step``; NONE while nobody asked (or on off-steps)."""
        if not self.distributed:
            return self.flag.value
        if step % self.every:
            return NONE
        import torch.distributed as dist

        agreed = NONE
        if self._work is not None:
            self._work.wait()
            agreed = int(self._tensor.item())
        self._tensor.fill_(self.flag.value)
        self._work = dist.all_reduce(self._tensor, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        return agreed

    def finish(self) -> None:
        """Wait for an outstanding reduce (call before tearing the process group down)."""
        if self._work is not None:
            self._work.wait()
            self._work = None


def under_slurm(environ: Mapping[str, str]) -> bool:
    """True inside a real Slurm job (the local launcher's fake SLURM_JOB_ID does not count)."""
    if environ.get("CYCLONE_LAUNCHER") == "local":
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

    Raises:
        CommandError: scontrol failed or timed out.
    """
    from cyclone_kit.proc import run_command
    from cyclone_kit.slurm.argv import scontrol_requeue
    from cyclone_kit.slurm.env import requeue_target

    target = requeue_target(environ)
    run_command(scontrol_requeue(target), timeout=60)
    sys.stderr.write(f"cyclone_kit: requeued Slurm job {target}\n")
    return target
