"""``cancel``: stop a job by id or run directory (checks the id exists: scancel would not)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``cancel``."""
    p = sub.add_parser("cancel", help="cancel a job by id or run directory")
    p.add_argument("target", help="job id or run directory")
    p.set_defaults(func=run)


def handle_of_target(target: str):
    """The job named by ``target``: a Slurm job id, or the handle a run directory recorded."""
    from cyclone_kit.backends.base import JobHandle, handle_of
    from cyclone_kit.core.errors import ValidationError
    from cyclone_kit.rundir.summary import read_run

    path = Path(target)
    if not path.is_dir() and target.replace("_", "").isdigit():
        return JobHandle(target, "slurm")
    read_run(path)  # a clear error when it is no run directory
    handle = handle_of(path)
    if handle is None:
        raise ValidationError(f"run {str(path)!r} was never submitted to a scheduler (no job_id file)",
                              hint="a local run stops with Ctrl-C")
    return handle


def job_id_of(target: str) -> str:
    """The job id named by ``target`` (an id, or a run directory holding ``job_id``)."""
    return handle_of_target(target).job_id


def run(args: argparse.Namespace) -> int:
    """Cancel through the backend the run recorded, then report the state it shows."""
    from cyclone_kit.backends import get_backend

    handle = handle_of_target(args.target)
    backend = get_backend(handle.backend)
    if handle.run_dir is not None:  # the run's end record then says "cancelled", not "preempted"
        from cyclone_kit.rundir.layout import RunDir

        RunDir(handle.run_dir).write_cancel_request(handle.job_id)
    backend.cancel(handle)
    wait = getattr(backend, "wait", None)
    info = wait(handle, timeout=60) if wait is not None else backend.status(handle)
    print(f"job {handle.job_id}: {info.state.value}")
    return 0
