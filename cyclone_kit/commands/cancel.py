"""``cancel``: stop a job by id or run directory (checks the id exists: scancel would not)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``cancel``."""
    p = sub.add_parser("cancel", help="cancel a job by id or run directory")
    p.add_argument("target", help="job id or run directory")
    p.set_defaults(func=run)


def job_id_of(target: str) -> str:
    """The Slurm job id named by ``target`` (an id, or a run directory holding ``job_id``)."""
    from cyclone_kit.errors import ValidationError
    from cyclone_kit.runinfo import read_run

    path = Path(target)
    if not path.is_dir() and target.replace("_", "").isdigit():
        return target
    rec = read_run(path)
    if not rec.job_id:
        raise ValidationError(f"run {str(path)!r} was never submitted to a scheduler (no job_id file)",
                              hint="a local run stops with Ctrl-C")
    return rec.job_id


def run(args: argparse.Namespace) -> int:
    """Cancel, then report the state Slurm shows."""
    from cyclone_kit.backends import get_backend

    backend = get_backend("slurm")
    job_id = job_id_of(args.target)
    backend.cancel(job_id)
    info = backend.wait(job_id, timeout=60)
    print(f"job {job_id}: {info.state.value}")
    return 0
