"""``status``: a table of jobs (id, name, state, nodes, elapsed, reason), root cause first.

Exit codes: 0 when no job shown has failed (pending, running, completed, cancelled, requeued);
1 when at least one has failed (FAILED, TIMEOUT, NODE_FAIL, OUT_OF_MEMORY, or its run recorded a
root cause); 2 for bad input or when Slurm cannot answer (one ``error: ... HINT: ...`` line).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cyclone_kit.backends.lookup import JobRow

EXIT_CODES = ("exit codes: 0 no job shown has failed (pending, running, completed, cancelled); "
              "1 a job shown has failed (FAILED, TIMEOUT, NODE_FAIL, OUT_OF_MEMORY, or a recorded root cause); "
              "2 bad input, or Slurm cannot be asked")


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``status``."""
    p = sub.add_parser("status", help="show the state of jobs by id, run directory or study directory",
                       description="Show id, name, state, nodes, elapsed and reason for a run directory, a study "
                                   "directory (every point and the report job), a job id (runs and report jobs "
                                   "are found under --runs-dir; any other id is asked of Slurm), or every run "
                                   "under --runs-dir; a failed run's root cause first, and why a job waits.",
                       epilog=EXIT_CODES)
    p.add_argument("target", nargs="?",
                   help="run directory, study directory or job id (default: every run under --runs-dir)")
    p.add_argument("--runs-dir", default="runs", help="where to look for runs and studies (default: ./runs)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the table (root causes above it, why jobs wait below); 1 when a job shown has failed."""
    from cyclone_kit.backends import lookup
    from cyclone_kit.core.errors import ValidationError
    from cyclone_kit.rundir.layout import find_runs

    runs_dir = Path(args.runs_dir)
    if args.target:
        target = lookup.resolve_target(args.target, runs_dir)
        if target.kind == "study":
            print(f"study {target.path}")
        elif target.kind == "report":
            print(f"report job of study {target.path}")
        rows = lookup.rows(target)
        runs = _run_dirs(target.kind, target.path)
    else:
        found = find_runs(runs_dir)  # every run, and Slurm asked once for all of them (one squeue, one sacct)
        if not found:
            raise ValidationError(f"no runs found under {args.runs_dir!r}",
                                  hint="give a job id, a run directory or a study directory")
        rows = lookup.run_rows(found)
        runs = found
    for row in rows:
        if row.root_cause:
            print(f"root cause ({_who(row)}): {row.root_cause}")
        for warning in row.warnings:
            print(f"warning ({_who(row)}): {warning}")
    header = ["JOBID", "NAME", "STATE", "NODES", "ELAPSED", "REASON"]
    table = [header, *(r.cells() for r in rows)]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for r in table:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    for row in rows:
        if row.history:
            print(f"{_who(row)}: {row.history}")
        for line in row.restarts:
            print(f"{_who(row)}: {line}")
        if row.note:
            print(row.note)
    _script_warnings(runs)
    failed = [r for r in rows if r.failed]
    if failed:
        print(f"{len(failed)} of {len(rows)} job(s) failed: {', '.join(f'{_id(r)} ({r.state.value})' for r in failed)}")
        return 1
    return 0


def _id(row: JobRow) -> str:
    """The job id a scheduler gave, or the name for a job without one (a local run: ``-``)."""
    return row.name if row.job_id in ("-", "") else row.job_id


def _who(row: JobRow) -> str:
    """``JOBID NAME``, or the name alone for a job no scheduler gave an id (a local run: ``-``)."""
    return row.name if row.job_id in ("-", "") else f"{row.job_id} {row.name}"


def _run_dirs(kind: str, path: Path | None) -> list[Path]:
    """The run directories a target shows: one run, or every point of a study."""
    from cyclone_kit.rundir.layout import StudyDir

    if path is None or kind not in ("run", "study"):
        return []
    return [rd.path for rd in StudyDir(path).point_dirs()] if kind == "study" else [path]


def _script_warnings(runs: list[Path]) -> None:
    """What the launch shim found wrong with a script run (``N ranks ran as N independent copies``)."""
    from cyclone_kit.rundir.layout import RunDir

    for run in runs:
        warning = RunDir(run).script_warning()
        if warning:
            print(f"warning ({Path(run).name}): {warning}")
