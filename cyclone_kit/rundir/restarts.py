"""The in-job restart record: ``restarts.json``, its one writer (the step watcher) and its readers.

When a step of a job with spare nodes or a shrink floor (``resources.spare_nodes``,
``resources.min_nodes``) ends because of a stall or a lost node, the step watcher
(:mod:`cyclone_kit.runtime.watchers.jobstep`, on the batch host) leaves the bad node out and starts the
step again inside the same job. Each such restart is one entry of ``restarts.json`` (schema
:data:`SCHEMA`)::

    schema: 1, kind: "restarts", job_id,
    restarts: [{restart (1, 2, ...), job_id, segment (the segment that failed), cause ("stalled" |
                "rank_lost"), left_out [hosts], nodes_before [hosts], nodes_after [hosts], spares [hosts
                taken from the spares], shrunk (bool), world_size_before, world_size_after,
                fault_time (the fault's last sign of life: a lost rank's first peer error or last beat,
                a stuck rank's last step), detected_time (failure.json), restart_time (the new srun),
                last_step (the highest step a rank had finished), master (ADDR:PORT of the new rendezvous),
                and, once the new segment has made its first step: resumed_step, resumed_from ("start
                record" | "first step record"), first_step, first_step_time, recovery_s (fault ->
                first step again), steps_recomputed, global_batch_before, global_batch_after}]

When a step ends that way but cannot restart in the job (``checkpoint.max_restarts`` used up, no
node blamed, too few healthy nodes), the watcher falls back to the job's requeue rules and says
why in ``fallbacks`` (optional; :func:`add_fallback`)::

    fallbacks: [{job_id, segment, cause, hosts [the blamed hosts], time, why, requeue (the job's
                 requeues before this one: SLURM_RESTART_COUNT)}]

Times are ISO 8601 UTC strings (as every other record). Only the step watcher writes the file
(one process per job: no locking); ``status`` and the report read it through :func:`read_restarts`
and word it with :func:`restart_line` and :func:`fallback_line`. Stdlib only.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cyclone_kit.rundir.fileio import read_json, write_atomic
from cyclone_kit.rundir.layout import RunDir

SCHEMA = 1


def read_restarts(run_dir: Path) -> list[dict[str, Any]]:
    """The run's in-job restarts, oldest first ([] when there were none or the file is unreadable)."""
    doc = read_json(RunDir(run_dir).restarts)
    entries = doc.get("restarts") if isinstance(doc, dict) else None
    return [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []


def read_fallbacks(run_dir: Path) -> list[dict[str, Any]]:
    """The run's steps that could not restart in the job and fell back to the requeue, oldest first."""
    doc = read_json(RunDir(run_dir).restarts)
    entries = doc.get("fallbacks") if isinstance(doc, dict) else None
    return [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []


def write_restarts(run_dir: Path, restarts: Sequence[Mapping[str, Any]], job_id: str | None = None,
                   fallbacks: Sequence[Mapping[str, Any]] | None = None) -> None:
    """Replace ``restarts.json`` atomically with ``restarts`` (the step watcher's whole list); its
    ``fallbacks`` are kept unless given."""
    kept = read_fallbacks(run_dir) if fallbacks is None else [dict(f) for f in fallbacks]
    doc: dict[str, Any] = {"schema": SCHEMA, "kind": "restarts", "job_id": job_id,
                           "restarts": [dict(r) for r in restarts]}
    if kept:
        doc["fallbacks"] = kept
    write_atomic(RunDir(run_dir).restarts, json.dumps(doc, indent=2) + "\n")


def add_fallback(run_dir: Path, entry: Mapping[str, Any], job_id: str | None = None) -> None:
    """Append one fall-back to the requeue to ``restarts.json`` (its restarts kept)."""
    write_restarts(run_dir, read_restarts(run_dir), job_id, [*read_fallbacks(run_dir), dict(entry)])


def fallback_line(entry: Mapping[str, Any]) -> str:
    """One fall-back in words, for ``status`` (pure), e.g. ``no in-job restart after rank_lost on c2:
    already restarted 0 time(s) in the job (checkpoint.max_restarts=0); fell back to the requeue``."""
    hosts = ",".join(entry.get("hosts") or []) or "?"
    return f"no in-job restart after {entry.get('cause', '?')} on {hosts}: {entry.get('why') or '?'}; fell back to the requeue"


def seconds_between(start: str | None, end: str | None) -> float | None:
    """Seconds from ISO time ``start`` to ``end`` (pure; None when either is missing or unreadable)."""
    if not start or not end:
        return None
    try:
        return (datetime.datetime.fromisoformat(end) - datetime.datetime.fromisoformat(start)).total_seconds()
    except ValueError:
        return None


def with_first_step(entry: Mapping[str, Any], *, first_step: int, first_step_time: str, start_step: int | None,
                    global_batch: int | None) -> dict[str, Any]:
    """``entry`` completed with the new segment's first step (pure).

    ``start_step`` is the new segment's ``start`` record's (the engine's resume step); when it is
    missing or 0 (a script's start record is written before its checkpoint is loaded) the step
    before the first logged one stands in, and ``resumed_from`` says so.
    """
    if start_step:
        resumed, basis = start_step, "start record"
    else:
        resumed, basis = first_step - 1, "first step record"
    last = entry.get("last_step")
    recomputed = max(0, int(last) - resumed) if isinstance(last, int) else None
    return {**entry, "resumed_step": resumed, "resumed_from": basis, "first_step": first_step,
            "first_step_time": first_step_time,
            "recovery_s": _round(seconds_between(entry.get("fault_time"), first_step_time)),
            "steps_recomputed": recomputed, "global_batch_after": global_batch}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def restart_line(entry: Mapping[str, Any], limit: int | None = None) -> str:
    """One restart in words, for ``status`` and the report (pure), e.g. ``in-job restart 1 of at most 3:
    rank_lost on c2 at step 23; left out c2, now c1,c3 (spare c3); first step again 21.4 s after the
    fault (step 21); 3 steps recomputed from the checkpoint of step 20``."""
    n = entry.get("restart", "?")
    head = f"in-job restart {n}" + (f" of at most {limit}" if limit else "")
    left = ",".join(entry.get("left_out") or []) or "-"
    line = f"{head}: {entry.get('cause', '?')} on {left}"
    if isinstance(entry.get("last_step"), int):
        line += f" at step {entry['last_step']}"
    now = ",".join(entry.get("nodes_after") or []) or "-"
    spares = entry.get("spares") or []
    how = f"spare {','.join(spares)}" if spares else ""
    if entry.get("shrunk"):
        before, after = entry.get("world_size_before"), entry.get("world_size_after")
        how = ", ".join(p for p in (how, f"shrunk: world {before} -> {after} ranks") if p)
        batch = (entry.get("global_batch_before"), entry.get("global_batch_after"))
        if all(isinstance(b, int) for b in batch):
            how += f", global batch {batch[0]} -> {batch[1]}" if batch[0] != batch[1] else f", global batch {batch[0]} kept"
    line += f"; left out {left}, now {now}" + (f" ({how})" if how else "")
    if entry.get("first_step_time"):
        recovery = entry.get("recovery_s")
        took = f"{recovery:.1f} s after the fault" if isinstance(recovery, int | float) else "(fault time unknown)"
        line += f"; first step again {took} (step {entry.get('first_step')})"
        if isinstance(entry.get("steps_recomputed"), int):
            line += (f"; {entry['steps_recomputed']} step(s) recomputed from the checkpoint of step "
                     f"{entry.get('resumed_step')}")
    else:
        line += "; no step since"
    return line
