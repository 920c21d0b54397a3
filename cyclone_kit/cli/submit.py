"""``submit``: validate a job against its cluster profile, render its sbatch script, submit it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cyclone_kit.core.errors import ValidationError


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``submit``."""
    from cyclone_kit.config.jobspec import add_job_arguments

    p = sub.add_parser("submit", help="render and submit a training job (sbatch, submitit or local)",
                       description="Validate a job spec against a cluster profile, render its sbatch script "
                                   "and submit it. With --dry-run what would run goes to stdout (the script; with --backend "
                                   "local the ranks' plan) and nothing is written.")
    add_job_arguments(p)
    p.add_argument("--dry-run", action="store_true", help="print what would run (the batch script; with --backend "
                   "local the ranks' command, working folder and variables, as JSON); write and submit nothing")
    p.add_argument("--runs-dir", default="runs", help="where run directories are created (default: ./runs)")
    p.add_argument("--backend", default="slurm", help="slurm (default), submitit or local")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Submit the job (or, with ``--dry-run``, print its backend's plan); prints the job id and run directory."""
    from cyclone_kit.backends import get_backend
    from cyclone_kit.config.request import job_from_args
    from cyclone_kit.rundir.layout import run_dir_name
    from cyclone_kit.submit.submission import plan_submission, submit_job

    backend = get_backend(args.backend)  # a dry run is a rehearsal of the real submit: same refusals
    job = job_from_args(args, args.backend)  # config/'s one way down: spec, profile, resolve, script, container
    runs_dir = Path(args.runs_dir).absolute()
    if args.dry_run:  # the plan the backend would schedule, for the directory's name at this second
        sys.stdout.write(plan_submission(job, runs_dir / run_dir_name(job.spec.name), backend).text())
        return 0
    if job.profile.account_required and not job.account:
        raise ValidationError(
            f"profile {job.profile.name!r} requires a Slurm account",
            hint="pass --account=<project> (e.g. p163) or set account in your profile",
        )
    run_dir, job_id = submit_job(job, runs_dir, backend)
    print(f"submitted job {job_id}")
    print(f"run dir: {run_dir}")
    return 0
