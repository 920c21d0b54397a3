"""Watch a job's training step from the batch host: a step whose ranks failed, vanished or stalled is ended.

``srun`` waits for every task of its step. When a node's processes die but its slurmd answers
again at once (the node never goes DOWN), srun never hears from the tasks that were there: it
waits, with ``--kill-on-bad-exit`` or not, and the job sits RUNNING with no live rank until its
wall time. The sbatch templates therefore run srun under this watcher::

    python -m cyclone_kit.runtime.stepwatch --run-dir DIR -- srun ... python -m cyclone_kit.runtime ...

It imports neither torch nor the training code, and:

* exports ``CYCLONE_JOB_END_TIME`` (Unix time, from squeue's time left) so that the ranks'
  collectives time out before the wall time, and ``CYCLONE_STEPWATCH=1`` so that a stalled
  rank leaves the requeue to this watcher;
* looks at the run directory every second: once a rank of this segment failed (its error
  record, ``failure.json``) or stalled, and srun has not ended :data:`GRACE_S` later, cancels
  the job's steps (``scancel JOB.STEP``; srun then ends within Slurm's KillWait);
* as a backstop, when no rank's progress record moved for twice its bound plus
  :data:`SILENT_SLACK_S` (no rank could even report a stall), writes ``failure.json`` and ends
  the step the same way;
* when srun has ended and ranks vanished (a progress record, no error record, no exit: their
  processes died with their parents), writes ``failure.json`` naming them and their host;
* requeues the job (``scontrol requeue``) when it ended because of a stall or a lost rank,
  ``checkpoint.requeue`` is on and requeues are left, and otherwise exits with srun's status.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cyclone_kit.rundir import failures
from cyclone_kit.runtime.progress import END_TIME_VAR, STEPWATCH_VAR, choose_stuck, stall_failure

#: Seconds srun gets to end by itself after a rank failed, before its steps are cancelled.
GRACE_S = 5.0
#: Seconds after the step cancel before srun itself is killed.
KILL_AFTER_S = 60.0
#: Slack on top of twice the largest bound before silent ranks count as stalled.
SILENT_SLACK_S = 30.0
#: Causes after which a requeue can help (a retry of a rank that raised would fail again).
REQUEUE_CAUSES = ("stalled", "rank_lost")


@dataclass(frozen=True)
class SegmentView:
    """What the run directory says about the current segment (built by :func:`segment_view`).

    Attributes:
        failure: this segment's ``failure.json`` (None when there is none).
        errors: rank -> this segment's error record.
        progress: rank -> this segment's progress record.
    """

    failure: dict[str, Any] | None
    errors: dict[int, dict[str, Any]]
    progress: dict[int, dict[str, Any]]

    @property
    def failed(self) -> bool:
        """A rank of this segment failed or stalled."""
        return bool(self.failure or self.errors or any(p.get("state") == "stalled" for p in self.progress.values()))


# --------------------------------------------------------------------------- pure rules
def silent(view: SegmentView, now: float) -> bool:
    """True when every rank's record is older than twice its bound plus the slack (pure).

    Only armed ranks count (a bound is known); none at all: False.
    """
    armed = [p for p in view.progress.values() if p.get("bound_s")]
    if not armed or len(armed) < len(view.progress):
        return False
    return all(now - float(p.get("beat_time") or 0) > 2 * float(p["bound_s"]) + SILENT_SLACK_S for p in armed)


def vanished(view: SegmentView) -> list[int]:
    """Ranks that vanished with their parents (pure): a progress record of this segment still
    ``running`` (never ended, stalled or exited), no error record, while the first error record
    of the segment says a peer's connection was lost."""
    if not view.errors:
        return []
    first = min(view.errors.values(), key=lambda r: (str(r.get("time", "")), r.get("rank", 0)))
    if not failures.peer_lost(first):
        return []
    return sorted(r for r, p in view.progress.items() if p.get("state") == "running" and r not in view.errors)


def lost_line(lost: Sequence[int], view: SegmentView) -> str:
    """The root cause when ranks vanished (pure)."""
    hosts = sorted({str(view.progress[r].get("host", "?")) for r in lost})
    steps = [view.progress[r].get("step") for r in lost]
    last = max((s for s in steps if isinstance(s, int)), default=None)
    when = f"after step {last}" if last is not None else "before their first step"
    line = (f"rank(s) {', '.join(map(str, lost))} on host {', '.join(hosts)} vanished {when}: their processes "
            f"died without a record (node {', '.join(hosts)} lost its processes?)")
    others = sorted(r for r in view.errors if r not in lost)
    if others:
        line += f"; then {failures.format_error_record(view.errors[others[0]])}"
    return line


def lost_failure(lost: Sequence[int], view: SegmentView, job_id: str, segment: str) -> dict[str, Any]:
    """The ``failure.json`` of a segment whose ranks vanished (pure but for the time)."""
    first = view.progress[lost[0]]
    record = {"rank": lost[0], "host": first.get("host"), "pid": first.get("pid"), "type": "RankLost",
              "message": "the rank's process vanished without a record", "step": first.get("step")}
    return failures.failure_doc(written_by="stepwatch", cause="rank_lost", root_cause=lost_line(lost, view),
                                first=record, job_id=job_id, segment=segment, lost=list(lost),
                                hosts=sorted({str(view.progress[r].get("host")) for r in lost}))


def cause_of(view: SegmentView) -> str | None:
    """``stalled``, ``rank_lost``, ``rank_failed`` or None for a segment whose step ended (pure)."""
    if view.failure is not None:
        return str(view.failure.get("cause") or "rank_failed")
    if vanished(view) and view.errors:
        return "rank_lost"
    return "rank_failed" if view.errors else None


def end_time(now: float, time_left: str | None) -> float | None:
    """The job's end as Unix time from squeue's time left (``%L``); None when unknown or unlimited (pure)."""
    from cyclone_kit.core.errors import ParseError
    from cyclone_kit.slurm.parse import parse_duration

    if not time_left:
        return None
    try:
        return now + parse_duration(time_left)
    except ParseError:
        return None


# --------------------------------------------------------------------------- the run directory
def segment_view(run_dir: Path, segment: str, since: float) -> SegmentView:
    """Read this segment's failure record, error records and progress records."""
    from cyclone_kit.rundir.fileio import read_json
    from cyclone_kit.rundir.layout import RunDir

    rd = RunDir(run_dir)
    failure = read_json(rd.failure) if _newer(rd.failure, since) else None
    errors = {}
    for path in rd.error_records():
        rec = read_json(path)
        if isinstance(rec, dict) and isinstance(rec.get("rank"), int) and _newer(path, since):
            errors[rec["rank"]] = rec
    progress = {}
    for path in rd.progress_records():
        rec = read_json(path)
        if isinstance(rec, dict) and rec.get("segment") == segment and isinstance(rec.get("rank"), int):
            progress[rec["rank"]] = rec
    return SegmentView(failure if isinstance(failure, dict) else None, errors, progress)


def _newer(path: Path, since: float) -> bool:
    try:
        return path.stat().st_mtime >= since - 1
    except OSError:
        return False


# --------------------------------------------------------------------------- Slurm
def _time_left(job_id: str) -> str | None:
    from cyclone_kit.core.proc import run_command

    try:
        out = run_command(["squeue", "--noheader", f"--jobs={job_id}", "--format=%L"], check=False, timeout=30)
    except Exception:  # no end time is a known answer: the fixed timeouts stay
        return None
    return out.stdout.strip().splitlines()[0] if out.ok and out.stdout.strip() else None


def cancel_steps(job_id: str) -> list[str]:
    """``scancel`` every step of the job but the batch and extern ones; returns the steps cancelled."""
    from cyclone_kit.core.proc import run_command

    out = run_command(["squeue", "--noheader", "--steps", f"--jobs={job_id}", "--format=%i"], check=False, timeout=30)
    steps = [s.strip() for s in out.stdout.split() if "." in s and not s.endswith((".batch", ".extern"))]
    for step in steps:
        run_command(["scancel", "--quiet", step], check=False, timeout=30)
    return steps


def _requeue(environ: Mapping[str, str], run_dir: Path, cause: str) -> bool:
    """``scontrol requeue`` when the spec allows it; True when requeued."""
    from cyclone_kit.core.errors import CycloneError
    from cyclone_kit.runtime.signals import requeue
    from cyclone_kit.slurm.env import restart_count

    cc = _checkpoint_table(run_dir)
    restarts = restart_count(environ)
    if not cc.get("requeue", True):
        _say(f"the step ended ({cause}); checkpoint.requeue is false: not requeued")
        return False
    limit = int(cc.get("max_requeues", 3))
    if restarts >= limit:
        _say(f"the step ended ({cause}); already requeued {restarts} time(s) (checkpoint.max_requeues={limit})")
        return False
    # said first: Slurm ends this batch script as soon as the requeue is accepted
    _say(f"the step ended ({cause}): requeue {restarts + 1} of at most {limit}, from the last checkpoint")
    try:
        requeue(environ)
    except CycloneError as e:
        _say(f"requeue failed: {e}")
        return False
    return True


def _checkpoint_table(run_dir: Path) -> dict[str, Any]:
    from cyclone_kit.rundir.layout import RunDir

    try:
        spec = RunDir(run_dir).read_spec()
    except Exception:  # the spec is a record here: defaults apply
        return {}
    table = spec.get("checkpoint") if isinstance(spec, dict) else None
    return table if isinstance(table, dict) else {}


def _say(text: str) -> None:
    sys.stderr.write(f"cyclone_kit: stepwatch: {text}\n")
    sys.stderr.flush()


# --------------------------------------------------------------------------- the watcher
def watch(argv: Sequence[str], run_dir: Path, environ: Mapping[str, str] | None = None, poll_s: float = 1.0) -> int:
    """Run ``argv`` (srun ...) and watch its step; returns its exit status (see the module doc)."""
    base = dict(os.environ if environ is None else environ)
    job = base.get("SLURM_JOB_ID", "")
    started = time.time()
    segment = failures.segment_id(base)
    extra = {STEPWATCH_VAR: "1"}
    end = end_time(started, _time_left(job)) if job else None
    if end is not None:
        extra[END_TIME_VAR] = f"{end:.0f}"
    child = subprocess.Popen(list(argv), env={**base, **extra})
    terminated: list[int] = []

    def note(signum: int, frame: object) -> None:  # Slurm signals srun itself: only remember it
        terminated.append(signum)

    previous = {sig: signal.signal(sig, note) for sig in (signal.SIGTERM, signal.SIGINT)}
    failed_at = cancelled_at = None
    try:
        while (code := _wait(child, poll_s)) is None:
            now = time.time()
            view = segment_view(run_dir, segment, started)
            if failed_at is None and not terminated and view.failed:
                failed_at = now
            if failed_at is None and not terminated and silent(view, now):
                records: dict[int, Any] = dict(view.progress)
                world = max(records) + 1
                doc, errors = stall_failure(choose_stuck(records, world), records, world, job, segment)
                failures.record_stall(run_dir, doc, None, list(errors.values()))
                _say(f"no rank made progress or answered: {doc['root_cause']}")
                failed_at = now - GRACE_S
            if failed_at is not None and cancelled_at is None and now - failed_at >= GRACE_S:
                steps = cancel_steps(job) if job else []
                _say(f"a rank failed or stalled and srun is still waiting: cancelled step(s) {', '.join(steps) or '-'}")
                cancelled_at = now
            if cancelled_at is not None and now - cancelled_at > KILL_AFTER_S:
                with contextlib.suppress(ProcessLookupError):
                    child.kill()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if terminated:
        return code
    view = segment_view(run_dir, segment, started)
    lost = vanished(view)
    # A survivor's own record (its watchdog writes failure.json on a non-zero exit) only says that its
    # peer's connection broke: the vanished ranks are the root cause, so their record replaces it.
    if lost and (view.failure is None or view.failure.get("cause") == "rank_failed"):
        doc = lost_failure(lost, view, job, segment)
        failures.write_failure(run_dir, doc, first_wins=view.failure is None)
        _say(doc["root_cause"])
        view = segment_view(run_dir, segment, started)
    cause = cause_of(view)
    if code != 0 and cause in REQUEUE_CAUSES and job and _requeue(base, run_dir, cause):
        return 0
    return code


def _wait(child: subprocess.Popen[bytes], timeout: float) -> int | None:
    try:
        return child.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m cyclone_kit.runtime.stepwatch --run-dir DIR -- CMD ...``."""
    args = list(sys.argv[1:] if argv is None else argv)
    run_dir = os.environ.get("CYCLONE_RUN_DIR")
    if args[:1] == ["--run-dir"] and len(args) >= 2:
        run_dir, args = args[1], args[2:]
    if args[:1] == ["--"]:
        args = args[1:]
    if not args or not run_dir:
        sys.stderr.write("error: nothing to watch HINT: python -m cyclone_kit.runtime.stepwatch --run-dir DIR "
                         "-- srun ...\n")
        return 2
    return watch(args, Path(run_dir))


if __name__ == "__main__":
    sys.exit(main())
