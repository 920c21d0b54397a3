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
  the job's steps (``scancel JOB.STEP``; srun then ends within Slurm's KillWait, or at once, killed, once
  the only ranks left are ones that vanished with their node: :func:`only_lost_left`);
* as a backstop, when no rank's progress record moved for twice its bound plus
  :data:`SILENT_SLACK_S` (no rank could even report a stall), writes ``failure.json`` and ends
  the step the same way;
* when srun has ended and ranks vanished (a progress record, no error record, no exit: their
  processes died with their parents), writes ``failure.json`` naming them and their host;
* with ``--nodes N --min-nodes M --tasks-per-node T`` (a job with ``resources.spare_nodes`` or
  ``resources.min_nodes``; the allocation holds the spares and survives a node's loss, ``--no-kill``),
  runs the step on N nodes of the allocation (``srun --nodes --ntasks --nodelist``) and, when it
  ended because of a stall or a lost rank, restarts it inside the job: the bad node is left out
  (:func:`bad_hosts`, and any node Slurm has DOWN or DRAINED), the healthy nodes are kept and a spare
  takes its place, else the step shrinks to no fewer than M nodes (:func:`next_nodes`); the ranks get
  a fresh rendezvous on the first node (MASTER_ADDR, a port free here, :func:`restart_port`) and
  ``CYCLONE_INJOB_RESTARTS`` (a new segment id), and resume from the newest checkpoint. Each restart
  is recorded in ``restarts.json`` (:mod:`cyclone_kit.rundir.restarts`), completed with the time of
  the new segment's first step. After ``checkpoint.max_restarts`` of them in this run of the job,
  or with too few healthy nodes, it falls back to the requeue below (why: ``restarts.json``'s
  ``fallbacks``, :func:`fallback_entry`);
* requeues the job (``scontrol requeue``) when it ended because of a stall or a lost rank,
  ``checkpoint.requeue`` is on and requeues are left, and otherwise exits with srun's status.
  A step whose rank raised is neither restarted nor requeued (it would fail again).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cyclone_kit.rundir import failures
from cyclone_kit.runtime.watchers.stall import END_TIME_VAR, STEPWATCH_VAR, choose_stuck, stall_failure

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


def only_lost_left(view: SegmentView) -> bool:
    """True when the step's only ranks not yet gone are ones that vanished with their node (pure): every
    other rank's record says it exited, ended or stalled. srun would wait for the vanished ones' dead
    step daemon until its own timeout; nothing of the step is left to wait for."""
    lost = set(vanished(view))
    if not lost:
        return False
    return all(p.get("state") in ("exited", "ended", "stalled") for r, p in view.progress.items() if r not in lost)


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
def segment_view(run_dir: Path, segment: str, since: float, stale: Mapping[str, float] | None = None) -> SegmentView:
    """Read this segment's failure record, error records and progress records.

    ``stale``: error records (path -> mtime) that existed when the step started: unchanged since, they
    belong to the step before an in-job restart, however close before it they were written.
    """
    from cyclone_kit.rundir.fileio import read_json
    from cyclone_kit.rundir.layout import RunDir

    rd = RunDir(run_dir)
    failure = read_json(rd.failure) if _newer(rd.failure, since) else None
    if isinstance(failure, dict) and failure.get("segment") not in (None, segment):
        failure = None  # the step before an in-job restart, written just before this one started
    errors = {}
    for path in rd.error_records():
        rec = read_json(path)
        if isinstance(rec, dict) and isinstance(rec.get("rank"), int) and _newer(path, since) and not _same(path, stale):
            errors[rec["rank"]] = rec
    progress = {}
    for path in rd.progress_records():
        rec = read_json(path)
        if isinstance(rec, dict) and rec.get("segment") == segment and isinstance(rec.get("rank"), int):
            progress[rec["rank"]] = rec
    return SegmentView(failure if isinstance(failure, dict) else None, errors, progress)


def _same(path: Path, stale: Mapping[str, float] | None) -> bool:
    """Whether ``path`` is as it was when recorded in ``stale``."""
    if not stale or str(path) not in stale:
        return False
    try:
        return path.stat().st_mtime == stale[str(path)]
    except OSError:
        return False


def _mtimes(paths: Sequence[Path]) -> dict[str, float]:
    out = {}
    for path in paths:
        with contextlib.suppress(OSError):
            out[str(path)] = path.stat().st_mtime
    return out


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


def _requeue_asked(environ: Mapping[str, str], run_dir: Path) -> bool:
    """Requeue the job a rank in a container asked to requeue (it has no ``scontrol``); True when requeued."""
    from cyclone_kit.core.errors import CycloneError
    from cyclone_kit.launchers.containers import REQUEUE_BY_VARIABLE
    from cyclone_kit.rundir.layout import RunDir
    from cyclone_kit.runtime.signals import requeue
    from cyclone_kit.slurm.env import requeue_target

    try:
        target = requeue_target(environ)
    except CycloneError:
        return False
    if not RunDir(run_dir).take_requeue_request(target):
        return False
    _say(f"the step ended; a rank asked for a requeue of job {target} (from a container): requeueing")
    try:
        requeue({k: v for k, v in environ.items() if k != REQUEUE_BY_VARIABLE})
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


# --------------------------------------------------------------------------- in-job restarts (pure)
@dataclass(frozen=True)
class RestartPolicy:
    """How the step may be started again inside the job (the template's ``--nodes/--min-nodes/--tasks-per-node``).

    Attributes:
        nodes: the nodes the step runs on (the allocation holds more: the spares).
        min_nodes: the fewest nodes it may shrink to when no spare is left.
        tasks_per_node: srun tasks per node.
        max_restarts: in-job restarts before falling back to a requeue (``checkpoint.max_restarts``).
    """

    nodes: int
    min_nodes: int
    tasks_per_node: int
    max_restarts: int = 3


def bad_hosts(failure: Mapping[str, Any] | None, view: SegmentView) -> list[str]:
    """The hosts a failed step's record blames (pure): a lost rank's host(s), a stuck rank's."""
    if not failure:
        return []
    if failure.get("cause") == "rank_lost" and failure.get("hosts"):
        return sorted({str(h) for h in failure["hosts"]})
    stuck = failure.get("stuck") or ([failure["rank"]] if isinstance(failure.get("rank"), int) else [])
    hosts = {str((view.progress.get(r) or {}).get("host") or "") for r in stuck}
    hosts |= {str(r.get("host")) for r in failure.get("ranks") or [] if isinstance(r, dict) and r.get("rank") in stuck
              and r.get("host")}
    hosts.discard("")
    if not hosts and failure.get("host"):
        hosts = {str(failure["host"])}
    return sorted(hosts)


def next_nodes(allocation: Sequence[str], current: Sequence[str], bad: Sequence[str] | set[str], wanted: int,
               min_nodes: int) -> list[str] | None:
    """The nodes of the next step (pure): the current healthy ones, then spares (allocated, never used, not
    bad) up to ``wanted``; at least ``min_nodes``; in the allocation's order (rank 0 and the rendezvous on the
    first). None when too few healthy nodes are left."""
    bad = set(bad)
    alive = set(allocation)
    healthy = [n for n in current if n not in bad and n in alive]
    spares = [n for n in allocation if n not in current and n not in bad]
    chosen = healthy + spares[:max(0, wanted - len(healthy))]
    if not chosen or len(chosen) < max(1, min_nodes):
        return None
    order = {n: i for i, n in enumerate(allocation)}
    return sorted(chosen, key=lambda n: order[n])


def step_argv(argv: Sequence[str], nodes: Sequence[str], tasks_per_node: int, restart: int = 0) -> list[str]:
    """``argv`` (``srun ...``) with the step's node count, task count and node list put after ``srun`` (pure).

    A restarted step also gets ``--overlap``: the step it replaces never completes in the controller's
    eyes when a node's step daemon died with its processes, and would hold the healthy nodes' CPUs
    ("Requested nodes are busy") until the job ends.
    """
    words = list(argv)
    at = next((i for i, w in enumerate(words) if Path(w).name == "srun"), None)
    if at is None:
        return words
    place = [f"--nodes={len(nodes)}", f"--ntasks={len(nodes) * tasks_per_node}", f"--nodelist={','.join(nodes)}"]
    place += ["--overlap"] if restart else []
    return [*words[:at + 1], *place, *words[at + 1:]]


def restart_port(job_id: str, restart: int, free: Callable[[int], bool]) -> int:
    """A fresh rendezvous port for the ``restart``-th in-job restart (pure but for ``free``): the job's port
    of step ``restart`` (:func:`cyclone_kit.core.ports.job_port`), else the next free one after it."""
    from cyclone_kit.core.ports import PORT_BASE, PORT_SPAN, job_port

    first = job_port(job_id, restart)
    for k in range(PORT_SPAN):
        port = PORT_BASE + (first - PORT_BASE + k) % PORT_SPAN
        if free(port):
            return port
    return first


def fault_time(failure: Mapping[str, Any] | None, view: SegmentView) -> str | None:
    """When the fault happened, as closely as the records say (pure): for lost ranks the first peer error
    (their connections broke as they died), else their last beat; for a stall the stuck rank's last step;
    else the failure record's time."""
    if not failure:
        return None
    if failure.get("cause") == "rank_lost":
        times = sorted(str(r.get("time")) for r in view.errors.values() if r.get("time"))
        if times:
            return times[0]
        beats = [float(view.progress[r].get("beat_time") or 0) for r in failure.get("lost") or [] if r in view.progress]
        if beats and max(beats) > 0:
            return _iso(max(beats))
    if failure.get("cause") == "stalled":
        last = [float((view.progress.get(r) or {}).get("progress_time") or 0) for r in failure.get("stuck") or []]
        if last and min(last) > 0:
            return _iso(min(last))
    return str(failure.get("time")) if failure.get("time") else None


def last_step(view: SegmentView) -> int | None:
    """The highest step any rank of the segment had finished (pure)."""
    steps = [p.get("step") for p in view.progress.values()]
    return max((s for s in steps if isinstance(s, int)), default=None)


def _iso(when: float) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(when, datetime.timezone.utc).isoformat(timespec="milliseconds")


def first_step_after(records: Sequence[Mapping[str, Any]], since: str) -> tuple[Mapping[str, Any], Mapping[str, Any]] | None:
    """(start record, first step record) of the first segment that started at or after ``since`` (pure)."""
    start = None
    for rec in records:
        if rec.get("kind") == "start" and str(rec.get("time", "")) >= since:
            start = start or rec
        elif start is not None and rec.get("kind") == "step" and isinstance(rec.get("step"), int):
            return start, rec
    return None


# --------------------------------------------------------------------------- the watcher
@dataclass
class _Step:
    """One srun step's end, as the watcher saw it."""

    code: int
    terminated: bool
    view: SegmentView
    cause: str | None


def watch(argv: Sequence[str], run_dir: Path, environ: Mapping[str, str] | None = None, poll_s: float = 1.0,
          policy: RestartPolicy | None = None) -> int:
    """Run ``argv`` (srun ...) and watch its step; returns its exit status (see the module doc).

    With a ``policy`` the step runs on ``policy.nodes`` nodes of the allocation and, after a stall or a
    lost node, starts again inside the job on healthy nodes (:func:`next_nodes`), at most
    ``checkpoint.max_restarts`` times, each restart recorded in ``restarts.json``; then it requeues as before.
    """
    base = dict(os.environ if environ is None else environ)
    job = base.get("SLURM_JOB_ID", "")
    extra = {STEPWATCH_VAR: "1"}
    end = end_time(time.time(), _time_left(job)) if job else None
    if end is not None:
        extra[END_TIME_VAR] = f"{end:.0f}"
    if policy is not None and job:
        policy = RestartPolicy(policy.nodes, policy.min_nodes, policy.tasks_per_node,
                               int(_checkpoint_table(run_dir).get("max_restarts", policy.max_restarts)))
    allocation = _allocation(base, job) if policy is not None and job else []
    current = allocation[:policy.nodes] if policy is not None else []
    bad: set[str] = set()
    # a requeued job's batch script starts with the earlier runs' restarts; the limit is per run of the job
    restarts = restart_records(run_dir) if policy is not None else []
    requeues = base.get("SLURM_RESTART_COUNT", "") or "0"
    pending: dict[str, Any] | None = None
    attempt = 0
    while True:
        env = {**base, **extra}
        if attempt:
            env[failures.INJOB_RESTARTS_VAR] = str(attempt)
        if pending is not None:
            env["MASTER_ADDR"], env["MASTER_PORT"] = pending["master"].rsplit(":", 1)
            if isinstance(pending.get("global_batch_before"), int):  # the engine keeps it where it can
                env["CYCLONE_GLOBAL_BATCH"] = str(pending["global_batch_before"])
        words = step_argv(argv, current, policy.tasks_per_node, attempt) if policy is not None and current else list(argv)
        step = _run_step(words, env, run_dir, job, pending, lambda pair: _note_first_step(run_dir, job, restarts, pair),
                         poll_s)
        if step.terminated:
            return step.code
        if step.code == 0 and job and _requeue_asked(base, run_dir):
            return 0
        if step.code != 0 and step.cause in REQUEUE_CAUSES and job and policy is not None:
            plan, why = _plan_restart(policy, attempt, allocation, current, bad, step, job)
            if plan is not None:
                attempt += 1
                entry = _restart_entry(run_dir, len(restarts) + 1, attempt, job, step, current, plan, allocation, policy, bad)
                entry["requeue"] = int(requeues) if requeues.isdigit() else 0
                restarts.append(entry)
                _write_restarts(run_dir, restarts, job)
                _say(f"the step ended ({step.cause} on {','.join(entry['left_out']) or '?'}): in-job restart {attempt} "
                     f"of at most {policy.max_restarts} on {','.join(plan)}, master {entry['master']}, "
                     "from the newest checkpoint")
                current, pending = plan, entry
                continue
            pending = None
            _say(f"the step ended ({step.cause}): {why}; falling back to a requeue")
            _note_fallback(run_dir, job, step, why, requeues)
        if step.code != 0 and step.cause in REQUEUE_CAUSES and job and _requeue(base, run_dir, step.cause):
            return 0
        return step.code


def restart_records(run_dir: Path) -> list[dict[str, Any]]:
    """This job's in-job restarts so far (a requeued job's batch script starts with the earlier ones)."""
    from cyclone_kit.rundir.restarts import read_restarts

    return read_restarts(run_dir)


def _write_restarts(run_dir: Path, restarts: Sequence[Mapping[str, Any]], job: str) -> None:
    """``restarts.json``, through its owner (:mod:`cyclone_kit.rundir.restarts`)."""
    from cyclone_kit.rundir.restarts import write_restarts

    write_restarts(run_dir, restarts, job)


def restart_plan(policy: RestartPolicy, attempt: int, alive: Sequence[str], current: Sequence[str],
                 bad: set[str]) -> tuple[list[str] | None, str]:
    """The nodes of the next in-job restart, or None and why not (pure): ``attempt`` restarts were made in
    this run of the job, ``alive`` is the allocation now, ``bad`` the nodes left out (blamed or unhealthy)."""
    if attempt >= policy.max_restarts:
        return None, f"already restarted {attempt} time(s) in the job (checkpoint.max_restarts={policy.max_restarts})"
    if not bad & set(current):
        return None, "no record names a node of the step as the bad one"
    plan = next_nodes(alive, current, bad, policy.nodes, policy.min_nodes)
    if plan is None:
        return None, (f"no healthy node left to restart on (left out {','.join(sorted(bad))}; at least "
                      f"{policy.min_nodes} needed)")
    return plan, ""


def _plan_restart(policy: RestartPolicy, attempt: int, allocation: list[str], current: list[str], bad: set[str],
                  step: _Step, job: str) -> tuple[list[str] | None, str]:
    """:func:`restart_plan` on what the step's records blame and what Slurm says now (``bad`` grows)."""
    if attempt >= policy.max_restarts:
        return restart_plan(policy, attempt, allocation, current, bad)
    bad.update(bad_hosts(step.view.failure, step.view))
    bad.update(_unhealthy(allocation))
    return restart_plan(policy, attempt, _allocation({}, job) or allocation, current, bad)


def fallback_entry(job: str, step: _Step, why: str, requeues: str) -> dict[str, Any]:
    """The ``restarts.json`` record of a step that could not restart in the job (see :func:`restart_plan`)."""
    failure = step.view.failure or {}
    return {"job_id": job, "segment": failure.get("segment"), "cause": step.cause,
            "hosts": bad_hosts(step.view.failure, step.view), "time": failures.utc_now(), "why": why,
            "requeue": int(requeues) if requeues.isdigit() else 0}


def _note_fallback(run_dir: Path, job: str, step: _Step, why: str, requeues: str) -> None:
    """Record the fall-back to the requeue; a record that cannot be written must not stop the requeue."""
    from cyclone_kit.rundir.restarts import add_fallback

    try:
        add_fallback(run_dir, fallback_entry(job, step, why, requeues), job)
    except OSError as e:
        _say(f"restarts.json not written: {e}")


def _restart_entry(run_dir: Path, number: int, attempt: int, job: str, step: _Step, current: list[str],
                   plan: list[str], allocation: list[str], policy: RestartPolicy, bad: set[str]) -> dict[str, Any]:
    """The ``restarts.json`` entry of a restart now starting."""
    from cyclone_kit.core.ports import can_bind

    failure = step.view.failure or {}
    spares = [n for n in plan if n not in current]
    return {"restart": number, "job_id": job, "segment": failure.get("segment"), "cause": step.cause,
            "left_out": [n for n in current if n in bad], "nodes_before": list(current), "nodes_after": list(plan),
            "spares": spares, "shrunk": len(plan) < len(current),
            "world_size_before": len(current) * policy.tasks_per_node, "world_size_after": len(plan) * policy.tasks_per_node,
            "fault_time": fault_time(failure, step.view), "detected_time": failure.get("time"),
            "restart_time": failures.utc_now(), "last_step": last_step(step.view),
            "master": f"{plan[0]}:{restart_port(job, attempt, can_bind)}",
            "global_batch_before": _global_batch_before(run_dir, failures.utc_now()),
            "allocation": list(allocation)}


def _note_first_step(run_dir: Path, job: str, restarts: list[dict[str, Any]], pair: tuple[Any, Any]) -> None:
    """Complete the newest restart's entry with the new segment's first step."""
    from cyclone_kit.rundir.restarts import with_first_step

    start, first = pair
    entry = restarts[-1]
    restarts[-1] = with_first_step(entry, first_step=int(first["step"]), first_step_time=str(first.get("time")),
                                   start_step=start.get("start_step") if isinstance(start.get("start_step"), int) else None,
                                   global_batch=start.get("global_batch_size"))
    _write_restarts(run_dir, restarts, job)
    _say(f"in-job restart {entry['restart']}: first step again (step {first['step']}) "
         f"{restarts[-1].get('recovery_s')} s after the fault")


def _global_batch_before(run_dir: Path, before: str) -> int | None:
    """The global batch of the run's first segment (the one a restarted step keeps), None for a script."""
    from cyclone_kit.rundir.layout import RunDir

    starts = [r for r in failures.read_records(RunDir(run_dir).metrics)
              if r.get("kind") == "start" and str(r.get("time", "")) < before]
    starts = starts[:1]
    value = starts[-1].get("global_batch_size") if starts else None
    return value if isinstance(value, int) else None


def _run_step(argv: Sequence[str], env: dict[str, str], run_dir: Path, job: str, pending: dict[str, Any] | None,
              on_first: Callable[[tuple[Any, Any]], None], poll_s: float = 1.0) -> _Step:
    """Run one srun step and watch it to its end (the cancel rules of the module doc).

    Once its steps are cancelled, srun is not waited for when only the vanished ranks are left
    (:func:`only_lost_left`): it would wait Slurm's KillWait (30 s by default, 60 s on the local test
    cluster) for the dead node's step daemon, and the in-job restart or the requeue that follows needs
    nothing of the step (fault -> in-job restart 21.5 s -> 5.9 s on the local cluster, d724fd2).
    """
    from cyclone_kit.rundir.layout import RunDir

    started = time.time()
    segment = failures.segment_id(env)
    stale = _mtimes(RunDir(run_dir).error_records())
    child = subprocess.Popen(list(argv), env=env)
    terminated: list[int] = []
    waiting = pending  # the restart whose first step is awaited

    def note(signum: int, frame: object) -> None:  # Slurm signals srun itself: only remember it
        terminated.append(signum)

    previous = {sig: signal.signal(sig, note) for sig in (signal.SIGTERM, signal.SIGINT)}
    failed_at = cancelled_at = None
    killed = False
    try:
        while (code := _wait(child, poll_s)) is None:
            now = time.time()
            view = segment_view(run_dir, segment, started, stale)
            if waiting is not None:
                found = _first_step(run_dir, str(waiting.get("restart_time", "")))
                if found is not None:
                    on_first(found)
                    waiting = None
            if failed_at is None and not terminated and view.failed:
                failed_at = now
            elif failed_at is not None and cancelled_at is None and not view.failed:
                failed_at = None  # a rank took its stall back (it made a step while its peers settled)
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
            lost_only = cancelled_at is not None and only_lost_left(view)
            if cancelled_at is not None and not killed and (lost_only or now - cancelled_at > KILL_AFTER_S):
                killed = True
                if lost_only:
                    _say(f"the step's other ranks have exited; rank(s) {', '.join(map(str, vanished(view)))} vanished "
                         "with their node: srun is not waited for")
                with contextlib.suppress(ProcessLookupError):
                    child.kill()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if waiting is not None and (found := _first_step(run_dir, str(waiting.get("restart_time", "")))) is not None:
        on_first(found)  # a short segment may end between two looks
    view = segment_view(run_dir, segment, started, stale)
    if terminated:
        return _Step(code, True, view, None)
    lost = vanished(view)
    # A survivor's own record (its watchdog writes failure.json on a non-zero exit) only says that its
    # peer's connection broke: the vanished ranks are the root cause, so their record replaces it.
    if lost and (view.failure is None or view.failure.get("cause") == "rank_failed"):
        doc = lost_failure(lost, view, job, segment)
        failures.write_failure(run_dir, doc, first_wins=view.failure is None)
        _say(doc["root_cause"])
        view = segment_view(run_dir, segment, started, stale)
    return _Step(code, False, view, cause_of(view))


def _first_step(run_dir: Path, since: str) -> tuple[Any, Any] | None:
    from cyclone_kit.rundir.layout import RunDir

    return first_step_after(failures.read_records(RunDir(run_dir).metrics), since) if since else None


def _allocation(environ: Mapping[str, str], job: str) -> list[str]:
    """The job's nodes now, in Slurm's order (squeue: a node lost under ``--no-kill`` leaves the list)."""
    from cyclone_kit.core.proc import run_command
    from cyclone_kit.slurm.hostlist import expand

    out = run_command(["squeue", "--noheader", f"--jobs={job}", "--format=%N"], check=False, timeout=30)
    text = out.stdout.strip().splitlines()[0].strip() if out.ok and out.stdout.strip() else ""
    text = text or environ.get("SLURM_JOB_NODELIST", "")
    try:
        return expand(text) if text else []
    except Exception:  # an unreadable list: no restart plan, the requeue stays
        return []


def _unhealthy(nodes: Sequence[str]) -> set[str]:
    """The nodes among ``nodes`` that Slurm has DOWN, DRAINED or FAILING (sinfo)."""
    from cyclone_kit.core.proc import run_command

    if not nodes:
        return set()
    out = run_command(["sinfo", "--noheader", "--Node", f"--nodes={','.join(nodes)}", "--format=%N %t"], check=False,
                      timeout=30)
    bad = set()
    for line in out.stdout.splitlines() if out.ok else []:
        parts = line.split()
        if len(parts) == 2 and parts[1].rstrip("*~#!%$@^-").startswith(("down", "drain", "fail", "maint")):
            bad.add(parts[0])
    return bad


def _wait(child: subprocess.Popen[bytes], timeout: float) -> int | None:
    try:
        return child.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def parse_args(args: Sequence[str], environ: Mapping[str, str]) -> tuple[str | None, RestartPolicy | None, list[str]]:
    """(run dir, restart policy or None, the command) from ``--run-dir DIR [--nodes N --min-nodes M
    --tasks-per-node T] -- CMD ...`` (pure).

    Raises:
        ValueError: an option without its value, or a count that is not a positive integer.
    """
    words = list(args)
    opts: dict[str, str] = {}
    while words and words[0] in ("--run-dir", "--nodes", "--min-nodes", "--tasks-per-node"):
        if len(words) < 2:
            raise ValueError(f"{words[0]} needs a value")
        opts[words[0]], words = words[1], words[2:]
    if words[:1] == ["--"]:
        words = words[1:]
    policy = None
    if "--nodes" in opts:
        counts = [opts.get(k, "1") for k in ("--nodes", "--min-nodes", "--tasks-per-node")]
        if not all(c.isdigit() and int(c) > 0 for c in counts):
            raise ValueError(f"--nodes/--min-nodes/--tasks-per-node must be positive counts, got {counts}")
        nodes, low, tasks = (int(c) for c in counts)
        policy = RestartPolicy(nodes, min(low, nodes), tasks)
    return opts.get("--run-dir") or environ.get("CYCLONE_RUN_DIR"), policy, words


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m cyclone_kit.runtime.stepwatch --run-dir DIR [--nodes N --min-nodes M --tasks-per-node T] -- CMD ...``."""
    try:
        run_dir, policy, args = parse_args(list(sys.argv[1:] if argv is None else argv), os.environ)
    except ValueError as e:
        sys.stderr.write(f"error: {e} HINT: python -m cyclone_kit.runtime.stepwatch --run-dir DIR "
                         "[--nodes N --min-nodes M --tasks-per-node T] -- srun ...\n")
        return 2
    if not args or not run_dir:
        sys.stderr.write("error: nothing to watch HINT: python -m cyclone_kit.runtime.stepwatch --run-dir DIR "
                         "-- srun ...\n")
        return 2
    code = watch(args, Path(run_dir), policy=policy)
    return 128 - code if code < 0 else code  # srun ended by a signal (killed above): the shell's 128 + N, not 256 - N


if __name__ == "__main__":
    sys.exit(main())
