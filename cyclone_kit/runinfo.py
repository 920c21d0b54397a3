"""What a run directory says about its run: job id, backend, end status, root cause of a failure.

Pure readers over the files the launcher and the runtime write (``job_id``, ``backend``,
``metrics.jsonl``, ``failure.json``, ``ranks/error-rank-*.json``); nothing here talks to Slurm.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cyclone_kit.errors import ValidationError


@dataclass(frozen=True)
class RunRecord:
    """The facts a run directory holds about its run."""

    path: Path
    name: str
    job_id: str | None
    backend: str | None
    end_status: str | None
    root_cause: str | None


def is_run_dir(path: Path) -> bool:
    """A run directory holds the resolved ``spec.json``."""
    return (path / "spec.json").is_file()


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def last_end_status(metrics: Path) -> str | None:
    """The status of the last ``end`` record in ``metrics.jsonl`` (None if there is none)."""
    status = None
    try:
        lines = metrics.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("kind") == "end":
            status = str(rec.get("status"))
    return status


def format_error_record(rec: dict[str, Any]) -> str:
    """One line: ``rank R on HOST: <what happened>``."""
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


def root_cause(run_dir: Path) -> str | None:
    """The first failure of a run, as one line, or None when nothing failed.

    ``failure.json`` (written by the launcher, which saw which rank died first) wins; else the
    earliest per-rank error record.
    """
    failure = _read_json(run_dir / "failure.json")
    if isinstance(failure, dict):
        ranks = failure.get("ranks")
        if failure.get("cause") == "interrupted" and isinstance(ranks, list) and ranks and all(
                isinstance(r, dict) and r.get("exit_code") == 0 for r in ranks):
            return None  # stopped on request and every rank checkpointed and exited cleanly
        if isinstance(failure.get("root_cause"), str):
            return failure["root_cause"]
        first = failure.get("first") if isinstance(failure.get("first"), dict) else failure
        return format_error_record(first)
    records = [r for r in (_read_json(p) for p in sorted((run_dir / "ranks").glob("error-rank-*.json")))
               if isinstance(r, dict)]
    if not records:
        return None
    records.sort(key=lambda r: (str(r.get("time", "")), r.get("rank", 0)))
    return format_error_record(records[0])


def read_run(run_dir: Path) -> RunRecord:
    """Read a run directory, or raise a ValidationError naming what is missing."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValidationError(f"run directory {str(run_dir)!r} does not exist", hint="give a path under runs/ or a job id")
    if not is_run_dir(run_dir):
        raise ValidationError(f"{str(run_dir)!r} is not a run directory (no spec.json)",
                              hint="give a directory created by cyclone-kit submit or run")
    spec = _read_json(run_dir / "spec.json") or {}
    job_id = (run_dir / "job_id").read_text().strip() if (run_dir / "job_id").is_file() else None
    backend = (run_dir / "backend").read_text().strip() if (run_dir / "backend").is_file() else None
    return RunRecord(run_dir, str(spec.get("name", run_dir.name)), job_id, backend,
                     last_end_status(run_dir / "metrics.jsonl"), root_cause(run_dir))


def find_runs(runs_dir: Path) -> list[Path]:
    """Run directories directly below ``runs_dir`` (and one level into studies), newest first."""
    if not runs_dir.is_dir():
        return []
    found = [p for p in runs_dir.iterdir() if p.is_dir() and is_run_dir(p)]
    found += [p for study in runs_dir.iterdir() if study.is_dir() and not is_run_dir(study)
              for p in study.iterdir() if p.is_dir() and is_run_dir(p)]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)
