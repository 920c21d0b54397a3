"""``logs``: print (or follow) a run's output and error logs, root cause of a failure first."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``logs``."""
    p = sub.add_parser("logs", help="print or follow a run's logs")
    p.add_argument("target", help="run directory (or a job id whose run is under --runs-dir)")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until the job ends")
    p.add_argument("--runs-dir", default="runs", help="where to look up a job id (default: ./runs)")
    p.add_argument("-n", "--lines", type=int, default=0, help="only the last N lines of each log (default: all)")
    p.set_defaults(func=run)


def resolve_run_dir(target: str, runs_dir: Path) -> Path:
    """A run directory path, or the run under ``runs_dir`` whose ``job_id`` file holds ``target``."""
    from cyclone_kit.errors import ValidationError
    from cyclone_kit.rundir import RunDir, find_runs

    path = Path(target)
    if path.is_dir():
        return path
    for run_dir in find_runs(runs_dir):
        if RunDir(run_dir).job_id() == target:
            return run_dir
    raise ValidationError(f"no run directory for {target!r} under {str(runs_dir)!r}",
                          hint="give the run directory path (printed by submit)")


def log_files(run_dir: Path) -> list[Path]:
    """Every log file of the run, as the backend it recorded lists them (its ``logs/`` when never submitted)."""
    from cyclone_kit.backends import get_backend
    from cyclone_kit.backends.base import JobHandle, handle_of
    from cyclone_kit.backends.base import log_files as run_logs

    handle = handle_of(run_dir)
    if handle is None:
        return run_logs(JobHandle("", "local", run_dir))
    return get_backend(handle.backend).log_files(handle)


def _finished(run_dir: Path) -> bool:
    from cyclone_kit.backends import get_backend
    from cyclone_kit.backends.base import handle_of
    from cyclone_kit.rundir import read_run

    rec = read_run(run_dir)
    if rec.end_status in ("completed", "failed") or rec.root_cause:
        return True
    handle = handle_of(run_dir)
    if handle is None:
        return False
    try:
        return get_backend(handle.backend).status(handle).state.is_terminal
    except Exception:
        return True


def run(args: argparse.Namespace) -> int:
    """Print the logs; with ``-f`` keep following them until the job is over."""
    from cyclone_kit.rundir import read_run

    run_dir = resolve_run_dir(args.target, Path(args.runs_dir))
    rec = read_run(run_dir)
    if rec.root_cause:
        print(f"root cause: {rec.root_cause}")
    offsets: dict[Path, int] = {}
    while True:
        for path in log_files(run_dir):
            data = path.read_bytes()
            start = offsets.get(path, 0)
            if len(data) > start:
                text = data[start:].decode(errors="replace")
                if start == 0:
                    print(f"==> {path.relative_to(run_dir)} <==")
                    if args.lines:
                        text = "\n".join(text.splitlines()[-args.lines:]) + "\n"
                sys.stdout.write(text)
                sys.stdout.flush()
                offsets[path] = len(data)
        if not args.follow or _finished(run_dir):
            return 0
        time.sleep(1.0)
