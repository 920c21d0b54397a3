"""What a run directory says about its run, in one record: name, job id, backend, end status, root cause.

Above both :mod:`~cyclone_kit.rundir.layout` (where the files are) and
:mod:`~cyclone_kit.rundir.failures` (what the failure records say), so neither needs the other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cyclone_kit.core.errors import ValidationError
from cyclone_kit.rundir.failures import root_cause
from cyclone_kit.rundir.layout import SPEC_FILE, RunDir


@dataclass(frozen=True)
class RunRecord:
    """The facts a run directory holds about its run."""

    path: Path
    name: str
    job_id: str | None
    backend: str | None
    end_status: str | None
    root_cause: str | None
    notes: tuple[str, ...] = ()


def checkpoint_notes(start: Mapping[str, Any] | None) -> tuple[str, ...]:
    """What the last segment's ``start`` record says about damaged checkpoints it skipped (pure)."""
    start = start or {}
    skipped = start.get("skipped_checkpoints")
    if not isinstance(skipped, list):
        return ()
    resumed = start.get("resumed_from")
    then = f"; resumed from {resumed} at step {start.get('start_step')}" if resumed else ""
    return tuple(f"skipped damaged checkpoint {s.get('path')} ({s.get('reason')}){then}"
                 for s in skipped if isinstance(s, dict))


def read_run(run_dir: Path) -> RunRecord:
    """Read a run directory, or raise a ValidationError naming what is missing."""
    rd = RunDir(run_dir)
    if not rd.path.is_dir():
        raise ValidationError(f"run directory {str(rd.path)!r} does not exist", hint="give a path under runs/ or a job id")
    if not rd.is_run_dir():
        raise ValidationError(f"{str(rd.path)!r} is not a run directory (no {SPEC_FILE})",
                              hint="give a directory created by cyclone-kit submit or run")
    return RunRecord(rd.path, str(rd.read_spec().get("name", rd.path.name)), rd.job_id(), rd.backend(),
                     rd.end_status(), root_cause(rd.path), checkpoint_notes(rd.start_record()))
