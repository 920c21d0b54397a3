"""A per-rank watchdog: run the rank as a child and record how it died when it cannot say so itself.

A rank that raises writes its own error record (``ranks/error-rank-N.json``), but a rank killed
by a signal (SIGKILL from the OOM killer or a user, SIGSEGV in a native library) writes nothing:
its peers fail a moment later with "connection closed by peer", and their records would be
taken for the root cause. Under Slurm, ``srun --kill-on-bad-exit`` stops the other tasks, but
nothing tells the user *which* rank died first, on which host, and how.

The watchdog is the small parent process of one rank (torchrun's agent does the same for its
workers). It imports neither torch nor the training code, so it costs a few MB and no start-up
time, and it:

* starts the rank (``python -m cyclone_kit.runtime ...``) as its child, in the same process
  group, so Slurm's signals (``--signal``, scancel's SIGTERM, the final SIGKILL) reach both;
* forwards SIGTERM, SIGINT, SIGHUP, SIGUSR1 and SIGUSR2 that reach the watchdog alone (a
  second copy of a signal is harmless: the rank's handler only records it);
* when the child dies by a signal the watchdog did not pass on, writes the rank's error record
  (rank, host, pid, signal, exit code, time of death) and ``failure.json`` (first writer wins),
  both through :mod:`cyclone_kit.rundir.failures`, whose root cause ``status`` and ``logs`` print;
  when it exits non-zero without a stop having been passed on, ``failure.json`` from the rank's
  own error record (unless the rank, or another rank, wrote it first);
* ends the same way as its child (re-raising the child's signal, or its exit code), so srun
  sees the failure and stops the other tasks.

Entry points: :func:`supervise` (used by ``python -m cyclone_kit.runtime`` under Slurm, see
:func:`wanted`) and ``python -m cyclone_kit.runtime.watchers.rankexit -- CMD ...``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from cyclone_kit.launchers import LOCAL
from cyclone_kit.rundir.failures import (
    death_line,
    death_record,
    host_guess,
    rank_guess,
    record_death,
    record_rank_failure,
    utc_now,
)

#: Set in the child's environment so that it does not start a watchdog of its own.
CHILD_VAR = "CYCLONE_WATCHDOG_CHILD"
#: ``CYCLONE_WATCHDOG=0`` turns the watchdog off (``1`` forces it on outside Slurm).
SWITCH_VAR = "CYCLONE_WATCHDOG"
#: Signals passed on to the rank.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def wanted(environ: Mapping[str, str]) -> bool:
    """Whether ``python -m cyclone_kit.runtime`` should run itself under a watchdog (pure).

    Yes inside a real Slurm job (not the local launcher, which watches its ranks itself), unless
    this process already is the watchdog's child or ``CYCLONE_WATCHDOG=0``.
    """
    if environ.get(CHILD_VAR) == "1":
        return False
    switch = environ.get(SWITCH_VAR, "").strip()
    if switch in ("0", "false", "no", "off"):
        return False
    if switch in ("1", "true", "yes", "on"):
        return True
    if LOCAL.started(environ):
        return False
    return bool(environ.get("SLURM_JOB_ID") or environ.get("SLURM_ARRAY_JOB_ID"))


#: The failure-record helpers, re-exported under the names callers of this module know.
rank_of = rank_guess
host_of = host_guess
root_cause_line = death_line
write_records = record_death


def supervise(argv: Sequence[str], run_dir: Path | str | None, environ: Mapping[str, str] | None = None) -> int:
    """Run ``argv`` as the supervised rank and return its exit status (or die by its signal).

    Args:
        argv: the rank's command line.
        run_dir: where the records go (None: ``$CYCLONE_RUN_DIR``; with neither, nothing is written).
        environ: the rank's environment (default ``os.environ``); ``CYCLONE_WATCHDOG_CHILD=1`` is added.

    Returns:
        The child's exit code. A child killed by a signal makes the watchdog kill itself with
        the same signal (so srun and the job's exit code say what happened); if that returns,
        ``128 + signal`` is returned.
    """
    base = dict(os.environ if environ is None else environ)
    target = run_dir or base.get("CYCLONE_RUN_DIR")
    forwarded: list[int] = []
    pending: list[int] = []  # signals that came before the rank's process existed
    child: subprocess.Popen[bytes] | None = None

    def forward(signum: int, frame: object) -> None:
        forwarded.append(signum)
        if child is None:
            pending.append(signum)
            return
        with contextlib.suppress(ProcessLookupError, OSError):
            child.send_signal(signum)

    # The handlers come first: a signal (srun's, or the rank's own to its parent) that arrives while the rank
    # starts is passed on once it exists, instead of killing the watchdog and orphaning the rank.
    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        # close_fds=False: the rank inherits every descriptor, as if srun had started it (PMI_FD of MPI/Horovod).
        child = subprocess.Popen(list(argv), env={**base, CHILD_VAR: "1"}, close_fds=False)
        for signum in pending:
            with contextlib.suppress(ProcessLookupError, OSError):
                child.send_signal(signum)
        while True:
            try:
                code = child.wait()
                break
            except InterruptedError:  # pragma: no cover - PEP 475 retries wait() itself
                continue
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    when = utc_now()
    if target:
        from cyclone_kit.runtime.watchers.stall import mark_exited

        mark_exited(Path(target), rank_guess(base), child.pid, code)
    if code < 0 and target and -code not in forwarded:
        record = death_record(rank_guess(base), host_guess(base), child.pid, code, when, base.get("SLURM_JOB_ID"))
        try:
            record_death(Path(target), record)
            sys.stderr.write(f"cyclone_kit: watchdog: {death_line(record)}\n")
        except OSError as e:
            sys.stderr.write(f"cyclone_kit: watchdog: could not write the error record: {e}\n")
        sys.stderr.flush()
    elif code > 0 and target and not forwarded:  # it raised or exited non-zero: failure.json, if nobody wrote it
        rank = rank_guess(base)
        fallback = death_record(rank, host_guess(base), child.pid, code, when, base.get("SLURM_JOB_ID"))
        with contextlib.suppress(OSError):
            record_rank_failure(Path(target), rank, written_by="watchdog", job_id=base.get("SLURM_JOB_ID"),
                                exit_code=code, fallback=fallback)
    if code < 0:
        with contextlib.suppress(OSError, ValueError):  # SIGKILL and SIGSTOP cannot be caught: no reset
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        time.sleep(1.0)  # a signal whose default is to ignore it falls through
        return 128 - code
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m cyclone_kit.runtime.watchers.rankexit [--run-dir DIR] -- CMD ...``."""
    args = list(sys.argv[1:] if argv is None else argv)
    run_dir = None
    if args[:1] == ["--run-dir"] and len(args) >= 2:
        run_dir, args = args[1], args[2:]
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        sys.stderr.write("error: no command to supervise HINT: python -m cyclone_kit.runtime.watchers.rankexit "
                         "[--run-dir DIR] -- python -m cyclone_kit.runtime --run-dir DIR\n")
        return 2
    return supervise(args, run_dir)


if __name__ == "__main__":
    sys.exit(main())
