"""``status``: a table of jobs (id, name, state, nodes, elapsed, reason), root cause first."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``status``."""
    p = sub.add_parser("status", help="show the state of jobs by id or run directory",
                       description="Show id, name, state, nodes, elapsed and reason for a job id, a run "
                                   "directory, or every run under --runs-dir; a failed run's root cause first.")
    p.add_argument("target", nargs="?", help="job id or run directory (default: every run under --runs-dir)")
    p.add_argument("--runs-dir", default="runs", help="where to look when no target is given (default: ./runs)")
    p.set_defaults(func=run)


def row_for(target: str) -> tuple[list[str], str | None]:
    """Status columns for one job id or run directory, and its root cause line (if failed).

    A run directory is asked through the backend it recorded (:func:`cyclone_kit.backends.base.handle_of`);
    a bare job id is a Slurm job.
    """
    from cyclone_kit.backends import get_backend
    from cyclone_kit.backends.base import handle_of
    from cyclone_kit.rundir import read_run

    path = Path(target)
    if path.is_dir() or not target.replace("_", "").isdigit():
        rec = read_run(path)
        handle = handle_of(path)
        if handle is None:  # never submitted: what the run directory itself says
            from cyclone_kit.backends.local import run_dir_status

            info = run_dir_status("-", path)
        else:
            info = get_backend(handle.backend).status(handle)
        known = bool(info.nodes)  # a finished foreground run has no scheduler figures
        return [info.job_id, rec.name, info.state.value, str(info.nodes) if known else "-",
                _elapsed(info.elapsed) if known else "-", info.reason or "-"], rec.root_cause
    info = get_backend("slurm").status(target)
    return [info.job_id, info.name, info.state.value, str(info.nodes), _elapsed(info.elapsed), info.reason or "-"], None


def _elapsed(seconds: int) -> str:
    from cyclone_kit.walltime import format_time

    return format_time(seconds) if seconds else "00:00:00"


def run(args: argparse.Namespace) -> int:
    """Print the table; root causes of failed runs are printed above it."""
    from cyclone_kit.errors import ValidationError
    from cyclone_kit.rundir import find_runs

    targets = [args.target] if args.target else [str(p) for p in find_runs(Path(args.runs_dir))[:20]]
    if not targets:
        raise ValidationError(f"no runs found under {args.runs_dir!r}", hint="give a job id or a run directory")
    rows, causes = [], []
    for t in targets:
        row, cause = row_for(t)
        rows.append(row)
        if cause:
            causes.append(f"root cause ({row[0]} {row[1]}): {cause}")
    for line in causes:
        print(line)
    header = ["JOBID", "NAME", "STATE", "NODES", "ELAPSED", "REASON"]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return 0
