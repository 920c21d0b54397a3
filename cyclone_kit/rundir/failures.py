"""The failure record: one versioned schema, its writers, its reader and the root-cause choice.

Two files record a failure, both inside the run directory (paths: :class:`cyclone_kit.rundir.layout.RunDir`):

* ``ranks/error-rank-NNNNN.json``, a rank's **error record**: written by the rank itself when it
  raises (:func:`write_error_record`), or by its watchdog when it was killed by a signal and
  could not (:func:`death_record`). Fields: rank, host, pid, time, type, message, and
  traceback / signal / exit_code / source.
* ``failure.json``, the run's **failure record** (schema :data:`SCHEMA`), built by
  :func:`failure_doc` only. Written by the local launcher (it saw which rank failed first, and
  overwrites), and under Slurm and submitit by whoever sees a failure first (first writer wins):
  the rank itself when the script raised or exited non-zero (:func:`record_rank_failure`), its
  watchdog for a non-zero exit or a death by signal. Fields::

      schema: 1, kind: "failure", written_by: "local" | "watchdog" | "rank" | "submitit",
      cause: "rank_failed" | "interrupted",
      root_cause: one line (also under "summary"), time, job_id,
      rank, host, pid, exit_code, signal: the first failed rank (null when interrupted),
      first: that rank's error record (or null),
      ranks: [{rank, host, pid, exit_code, signal, elapsed_s, stopped_by_launcher}] (launcher only),
      and writer-specific details (stop_s, stderr_log, stderr_tail ...).

:func:`root_cause` is the one place that chooses the line ``status``, ``logs`` and ``run`` print.
Stdlib only (the watchdog imports it without cost).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import signal
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cyclone_kit.rundir.fileio import read_json, write_atomic, write_new
from cyclone_kit.rundir.layout import RunDir

SCHEMA = 1
CAUSES = ("rank_failed", "interrupted", "stalled", "rank_lost")
#: The launchers' rank variables, most specific first (torchrun, Slurm, Open MPI, MPICH/PMI, submitit).
RANK_VARS = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SUBMITIT_LOCAL_GLOBALID")


# --------------------------------------------------------------------------- pure helpers
def signal_label(signum: int) -> str:
    """``9`` -> ``"SIGKILL"`` (``"signal 99"`` for numbers Python has no name for)."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def signal_name(returncode: int | None) -> str | None:
    """The signal behind a :attr:`subprocess.Popen.returncode`: ``-9`` -> ``"SIGKILL"``; None for exits (pure)."""
    if returncode is None or returncode >= 0:
        return None
    return signal_label(-returncode)


def rank_guess(environ: Mapping[str, str]) -> int:
    """This process's global rank from whichever launcher variable is set (0 when none; pure)."""
    for key in RANK_VARS:
        raw = environ.get(key, "")
        if raw.isdigit():
            return int(raw)
    return 0


def host_guess(environ: Mapping[str, str]) -> str:
    """The node name as Slurm knows it, else this host's name."""
    return environ.get("SLURMD_NODENAME") or socket.gethostname()


def utc_now() -> str:
    """The current time as ISO-8601 UTC with milliseconds."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


def error_record(rank: int, host: str, exc: BaseException, traceback_text: str) -> dict[str, Any]:
    """The error record of a rank that raised ``exc`` (pure but for the time and pid)."""
    return {"rank": rank, "host": host, "type": type(exc).__name__, "message": str(exc),
            "traceback": traceback_text, "time": utc_now(), "pid": os.getpid()}


def death_record(rank: int, host: str, pid: int, returncode: int, when: str, job_id: str | None = None) -> dict[str, Any]:
    """The error record of a rank that died without writing one (pure).

    ``returncode`` is :attr:`subprocess.Popen.returncode`: negative for a signal.
    """
    record: dict[str, Any] = {"rank": rank, "host": host, "pid": pid, "time": when, "source": "watchdog"}
    if returncode < 0:
        name = signal_label(-returncode)
        record.update(signal=name, exit_code=128 - returncode, type="KilledBySignal",
                      message=f"the rank process was killed by {name} and could not write an error record")
    else:
        record.update(signal=None, exit_code=returncode, type="ExitedWithoutRecord",
                      message=f"the rank process exited with code {returncode} without writing an error record")
    if job_id:
        record["slurm_job_id"] = job_id
    return record


def death_line(record: Mapping[str, Any]) -> str:
    """``rank 1 on host c1 (pid 123) killed by SIGKILL`` for a :func:`death_record` (pure)."""
    how = f"killed by {record['signal']}" if record.get("signal") else f"exited with code {record.get('exit_code')}"
    return f"rank {record['rank']} on host {record['host']} (pid {record['pid']}) {how}"


def format_error_record(rec: Mapping[str, Any]) -> str:
    """One line for any error record: ``rank R on HOST: <what happened>`` (pure)."""
    where = f"rank {rec.get('rank', '?')} on {rec.get('host', '?')}"
    if rec.get("signal"):
        what = f"killed by {rec['signal']}"
    elif rec.get("exit_code") not in (None, 0):
        what = f"exited with code {rec['exit_code']}"
    else:
        what = ""
    detail = rec.get("message") or rec.get("error") or ""
    if rec.get("type"):
        detail = f"{rec['type']}: {detail}" if detail else str(rec["type"])
    text = ", ".join(x for x in (what, detail) if x)
    return f"{where}: {text}" if text else where


def failure_doc(*, written_by: str, cause: str, root_cause: str, first: Mapping[str, Any] | None = None,
                rank: int | None = None, host: str | None = None, pid: int | None = None,
                exit_code: int | None = None, job_id: str | None = None,
                ranks: Sequence[Mapping[str, Any]] = (), time: str | None = None, **details: Any) -> dict[str, Any]:
    """The ``failure.json`` document (schema :data:`SCHEMA`); the one builder every writer uses (pure).

    Args:
        written_by: ``"local"`` (the local launcher) or ``"watchdog"``.
        cause: one of :data:`CAUSES`.
        root_cause: the one-line root cause.
        first: the first failed rank's error record (None when it wrote none).
        rank, host, pid, exit_code: the first failed rank (default: from ``first``).
        job_id: the (real or fake) job id.
        ranks: how every rank ended (the launcher knows; the watchdog does not).
        time: when (default: now).
        details: writer-specific extra fields.
    """
    if cause not in CAUSES:
        raise ValueError(f"unknown failure cause {cause!r}")
    first_ = dict(first) if first else None

    def pick(key: str, given: Any) -> Any:
        return given if given is not None else (first_ or {}).get(key)

    code = pick("exit_code", exit_code)
    doc: dict[str, Any] = {
        "schema": SCHEMA, "kind": "failure", "written_by": written_by, "launcher": written_by, "cause": cause,
        "root_cause": root_cause, "summary": root_cause, "time": time or utc_now(), "job_id": job_id,
        "rank": pick("rank", rank), "host": pick("host", host), "pid": pick("pid", pid), "exit_code": code,
        "signal": signal_name(code) if exit_code is not None else (first_ or {}).get("signal"),
        "first": first_, "ranks": [dict(r) for r in ranks],
    }
    doc.update(details)
    return doc


# --------------------------------------------------------------------------- writers and readers
def write_error_record(run_dir: Path, rank: int, host: str, exc: BaseException, traceback_text: str) -> Path:
    """Write the rank's own error record ``ranks/error-rank-NNNNN.json`` atomically; returns its path."""
    path = RunDir(run_dir).error_record(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(error_record(rank, host, exc, traceback_text), indent=1) + "\n")
    return path


def read_error_record(run_dir: Path, rank: int) -> dict[str, Any] | None:
    """The rank's own error record, when it wrote one."""
    data = read_json(RunDir(run_dir).error_record(rank))
    return data if isinstance(data, dict) else None


def write_failure(run_dir: Path, doc: Mapping[str, Any], *, first_wins: bool = False) -> bool:
    """Write ``failure.json``; with ``first_wins`` only when none of this segment exists yet. True when written.

    A ``failure.json`` of an earlier segment of a requeued run (another ``segment``, or older
    than this segment's ``start`` record) is first moved to ``ranks/failure-SEGMENT.json``.
    """
    rd = RunDir(run_dir)
    path = rd.failure
    text = json.dumps(dict(doc), indent=2) + "\n"
    _retire_earlier(rd, doc)
    if first_wins:
        return write_new(path, text)
    write_atomic(path, text)
    return True


def _retire_earlier(rd: RunDir, doc: Mapping[str, Any]) -> None:
    """Move a ``failure.json`` that belongs to an earlier segment out of the way."""
    old = read_failure(rd.path)
    if old is None:
        return
    mine, theirs = doc.get("segment"), old.get("segment")
    starts = segment_starts(rd.path)
    earlier = (mine and theirs and mine != theirs) or (
        bool(starts) and str(old.get("time", "")) < starts[-1] <= str(doc.get("time") or utc_now()))
    if not earlier:
        return
    rd.ranks.mkdir(parents=True, exist_ok=True)
    target = rd.past_failure(str(theirs or old.get("time", "earlier")))
    with contextlib.suppress(OSError):
        os.replace(rd.failure, target)


#: Set by the step watcher on the ranks of a step it started again inside the job: how many times it did.
INJOB_RESTARTS_VAR = "CYCLONE_INJOB_RESTARTS"


def segment_id(environ: Mapping[str, str]) -> str:
    """``JOBID:RESTARTS`` (``JOBID:RESTARTS.N`` after N in-job restarts), this run segment's name in
    progress and failure records (pure)."""
    array = environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array}_{environ.get('SLURM_ARRAY_TASK_ID', '')}" if array else environ.get("SLURM_JOB_ID", "")
    in_job = environ.get(INJOB_RESTARTS_VAR, "")
    tail = f".{in_job}" if in_job.isdigit() and int(in_job) > 0 else ""
    return f"{job}:{environ.get('SLURM_RESTART_COUNT', '') or '0'}{tail}"


def segment_starts(run_dir: Path) -> list[str]:
    """The times of the run's segment ``start`` records (metrics, else the launch shim's), oldest first."""
    rd = RunDir(run_dir)
    for path in (rd.metrics, rd.shim):
        times = [str(r["time"]) for r in _records(path) if r.get("kind") == "start" and r.get("time")]
        if times:
            return times
    return []


def read_records(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines record file (``metrics.jsonl``, ``shim.jsonl``), unreadable lines skipped."""
    return _records(path)


def _records(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def record_stall(run_dir: Path, doc: Mapping[str, Any], own: Mapping[str, Any] | None,
                 on_behalf: Sequence[Mapping[str, Any]] = ()) -> bool:
    """A stall's writes: ``own`` (the writer's error record, when it is a stuck rank), ``failure.json``
    (first of this segment wins) and, by the winner, the error records of stuck ranks that could
    not write theirs (never over one they wrote). True when this call wrote ``failure.json``."""
    rd = RunDir(run_dir)
    rd.ranks.mkdir(parents=True, exist_ok=True)
    if own is not None:
        write_atomic(rd.error_record(int(own["rank"])), json.dumps(dict(own), indent=1) + "\n")
    won = write_failure(rd.path, doc, first_wins=True)
    if won:
        for rec in on_behalf:
            write_new(rd.error_record(int(rec["rank"])), json.dumps(dict(rec), indent=1) + "\n")
    return won


def peer_lost(record: Mapping[str, Any] | None) -> bool:
    """Whether an error record says only that a peer's connection went away (pure): a symptom, not a cause."""
    if not record:
        return False
    return bool(PEER_LOST.search(f"{record.get('type', '')}: {record.get('message', '')}"))


def record_death(run_dir: Path, record: Mapping[str, Any]) -> None:
    """The watchdog's writes: the rank's error record (unless it wrote one) and ``failure.json``.

    First writer wins, except over a ``failure.json`` of this segment whose first error is a peer's
    lost connection: a survivor whose collective broke under the dead rank may have been quicker
    to record that symptom than this rank's watchdog the death that caused it.
    """
    rd = RunDir(run_dir)
    own = rd.error_record(int(record["rank"]))
    own.parent.mkdir(parents=True, exist_ok=True)
    if not own.exists():
        write_new(own, json.dumps(dict(record), indent=1) + "\n")
    doc = failure_doc(written_by="watchdog", cause="rank_failed", root_cause=death_line(record), first=record,
                      job_id=record.get("slurm_job_id"), time=record.get("time"))
    if write_failure(rd.path, doc, first_wins=True):
        return
    old = read_failure(rd.path)
    if old is not None and old.get("cause") == "rank_failed" and peer_lost(old.get("first")) and (
            old.get("segment") == doc.get("segment")):
        write_failure(rd.path, doc)


#: What an error says when a peer's process vanished under a collective (gloo, NCCL, sockets).
PEER_LOST = re.compile(r"connection (reset|closed|refused)|closed by peer|broken pipe|socket timeout|"
                       r"communicator was aborted|peer .* (gone|closed)|end of file|EOF", re.IGNORECASE)


def record_rank_failure(run_dir: Path, rank: int, *, written_by: str, job_id: str | None = None,
                        exit_code: int | None = None, fallback: Mapping[str, Any] | None = None) -> bool:
    """``failure.json`` for a rank that raised or exited non-zero, unless one exists (first writer wins).

    Written by whoever sees the failure first: the rank itself (the launch shim, right after it
    wrote its error record), else its watchdog (a non-zero exit) or submitit's callable. The root
    cause is the rank's own error record, else ``fallback`` (e.g. a :func:`death_record`). True
    when this call wrote the file.
    """
    record = read_error_record(Path(run_dir), rank) or (dict(fallback) if fallback else None)
    if record is None:
        return False
    doc = failure_doc(written_by=written_by, cause="rank_failed", root_cause=format_error_record(record),
                      first=record, job_id=job_id, exit_code=exit_code, time=record.get("time"))
    return write_failure(Path(run_dir), doc, first_wins=True)


def read_failure(run_dir: Path) -> dict[str, Any] | None:
    """The decoded ``failure.json`` (None when there is none)."""
    data = read_json(RunDir(run_dir).failure)
    return data if isinstance(data, dict) else None


def root_cause(run_dir: Path) -> str | None:
    """The first failure of the run's last segment, as one line, or None when nothing failed.

    Records older than the last segment's ``start`` record belong to an earlier segment of a
    requeued run (see :func:`segment_history`) and are not this segment's root cause.

    ``failure.json`` (written by whoever saw which rank died first) wins, except an interrupt
    after which every rank checkpointed and exited 0 (a stop on request); else the earliest
    per-rank error record. Older schema-less records (``first`` only) are read too.
    """
    starts = segment_starts(run_dir)
    since = starts[-1] if starts else ""
    failure = read_failure(run_dir)
    if failure is not None and str(failure.get("time", "")) < since:
        failure = None  # an earlier segment's: the requeued run went on
    if failure is not None:
        ranks = failure.get("ranks")
        if failure.get("cause") == "interrupted" and isinstance(ranks, list) and ranks and all(
                isinstance(r, dict) and r.get("exit_code") == 0 for r in ranks):
            return None  # stopped on request and every rank checkpointed and exited cleanly
        if isinstance(failure.get("root_cause"), str):
            return failure["root_cause"]
        first = failure.get("first") if isinstance(failure.get("first"), dict) else failure
        return format_error_record(first)
    records = [r for r in (read_json(p) for p in RunDir(run_dir).error_records())
               if isinstance(r, dict) and str(r.get("time", "")) >= since]
    if not records:
        return None
    records.sort(key=lambda r: (str(r.get("time", "")), r.get("rank", 0)))
    return format_error_record(records[0])


def segment_history(run_dir: Path) -> list[dict[str, Any]]:
    """The run's segments (one per ``start`` record: a requeued run has several), oldest first.

    Each: ``restart_count``, ``start`` (time), ``status`` (its ``end`` record's, None when it
    wrote none: it died) and ``failure`` (the failure record written during it, or None).
    """
    rd = RunDir(run_dir)
    records = _records(rd.metrics)
    if not any(r.get("kind") == "start" for r in records):
        records = _records(rd.shim)
    segments: list[dict[str, Any]] = []
    for rec in records:
        if rec.get("kind") == "start":
            segments.append({"restart_count": rec.get("restart_count"), "start": str(rec.get("time", "")),
                             "status": None, "failure": None})
        elif rec.get("kind") == "end" and segments and segments[-1]["status"] is None:
            segments[-1]["status"] = rec.get("status")
    docs = [d for d in (read_json(p) for p in [*rd.past_failures(), rd.failure]) if isinstance(d, dict)]
    for doc in docs:
        when = str(doc.get("time", ""))
        owners = [s for s in segments if s["start"] <= when]
        if owners and owners[-1]["failure"] is None:
            owners[-1]["failure"] = doc
    return segments


#: Accounting states that name a cause from outside the job; they win over its own failure record.
OUTSIDE_STATES = frozenset({"NODE_FAIL", "PREEMPTED", "TIMEOUT", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"})


def segment_label(segment: Mapping[str, Any], slurm_state: str | None = None) -> str:
    """``NODE_FAIL on c2``, ``STALLED on c1``, ``PREEMPTED``, ``completed``: what ended a segment (pure).

    ``slurm_state`` is what accounting says about that run of the job (sacct ``--duplicates``).
    A cause from outside the job (:data:`OUTSIDE_STATES`: a node failure, a preemption, the time
    limit, memory) wins over the segment's failure record; CANCELLED or FAILED are how our own end
    of a stalled step looks to Slurm (accounting has said CANCELLED for a requeued run), so the
    record's cause wins over them. The host comes from the segment's failure record.
    """
    failure = segment.get("failure") or {}
    cause = failure.get("cause")
    state = (slurm_state or "").split()[0].upper() if slurm_state else ""
    if segment.get("status") == "completed" and not failure:
        return "completed"
    if state in OUTSIDE_STATES:
        label = state
    elif cause in ("stalled", "rank_lost", "rank_failed"):
        label = {"stalled": "STALLED", "rank_lost": "RANK_LOST", "rank_failed": "FAILED"}[cause]
    elif state and state not in ("REQUEUED", "COMPLETED", "RUNNING", "PENDING"):
        label = state
    elif segment.get("status") in ("preempted", "cancelled", "failed"):
        label = str(segment["status"]).upper()
    else:
        label = state or "ENDED"
    host = failure.get("host")
    return f"{label} on {host}" if host else label


def history_line(segments: Sequence[Mapping[str, Any]], slurm_states: Sequence[str] = ()) -> str | None:
    """``completed (2 segments: NODE_FAIL on c2, then completed)`` for a run with several segments (pure).

    ``slurm_states``: accounting's state of each run of the job, oldest first (may be shorter).
    None for a run of one segment.
    """
    if len(segments) < 2:
        return None
    labels = [segment_label(s, slurm_states[i] if i < len(slurm_states) else None) for i, s in enumerate(segments)]
    last = labels[-1] if segments[-1].get("status") is not None else "running"
    head = last.split(" on ")[0].lower() if last != "completed" else "completed"
    return f"{head} ({len(segments)} segments: {', '.join(labels[:-1])}, then {last})"
