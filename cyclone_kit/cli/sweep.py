"""``sweep``: run a scaling study — one run directory per point, submitted together, then the report.

This module only parses arguments and prints; planning, creating, running and submitting the
study is :mod:`cyclone_kit.submit.study`.

The study directory ``RUNS_DIR/<study>-<stamp>/`` is created whole or not at all: ``sweep.json``
(the record the analysis reads), one run directory per point (``spec.json``, ``job.sbatch``,
``logs/``) and ``logs/`` for the report job. After submission ``submitted.json`` lists the job
id (and, for local runs, the outcome) of every point.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

BACKENDS = ("slurm", "submitit", "local")


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``sweep``."""
    from cyclone_kit.config.jobspec import add_data_check_argument, add_script_arguments

    p = sub.add_parser(
        "sweep",
        help="run a strong or weak scaling study (one run per point) and its report",
        description="Expand a sweep spec (a base job plus points) into one run directory per point under "
        "RUNS_DIR/<study>-<stamp>/, submit them all and, with report = true, a final report job that "
        "depends on every point (Slurm) or the report right after the runs (local). With --dry-run the "
        "plan and scripts go to stdout and nothing is written.",
    )
    p.add_argument("sweep_spec", metavar="SWEEP_SPEC", help="sweep spec TOML, e.g. jobs/strong_scaling.toml")
    p.add_argument("--backend", default="slurm", choices=BACKENDS, help="slurm (default), submitit or local")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the scripts; write and submit nothing")
    p.add_argument("--runs-dir", default="runs", help="where the study directory is created (default: ./runs)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field of the base job, e.g. --set train.steps=50 (repeatable)")
    p.add_argument("--profile", help="cluster profile name or .toml path (default: the base job's)")
    p.add_argument("--partition", help="Slurm partition (default: the base job's, else the profile's default)")
    p.add_argument("--account", help="Slurm account (project), e.g. p163")
    p.add_argument("--time", help="wall time of every point, e.g. 00:30:00")
    p.add_argument("--name", help="study name (default: the sweep spec's)")
    p.add_argument("--container", metavar="IMAGE",
                   help="run every point's ranks inside this container image (slurm backend; the runtime: the "
                        "profile's [container] runtime, or --set container.runtime=...)")
    p.add_argument("--no-report", action="store_true", help="do not run or submit the report")
    p.add_argument("--serial", action="store_true",
                   help="slurm/submitit: run the points one after another (as serial = true in the spec)")
    p.add_argument("--wait", action="store_true", help="slurm/submitit: wait until every job (and the report) ended")
    p.add_argument("--quiet", action="store_true", help="local: do not echo rank 0's output")
    add_script_arguments(p)
    add_data_check_argument(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Plan, create, run or submit (:mod:`cyclone_kit.submit.study`), print; returns 0, or 1 when a point failed."""
    import dataclasses

    from cyclone_kit.config.jobspec import script_flag_values
    from cyclone_kit.config.profile import load_profile
    from cyclone_kit.config.script import check_data_dir
    from cyclone_kit.config.sweep import load_sweep
    from cyclone_kit.core.errors import ValidationError
    from cyclone_kit.submit import study as lib

    flags = [(key, getattr(args, dest)) for dest, key in (
        ("profile", "resources.profile"), ("partition", "resources.partition"),
        ("account", "resources.account"), ("time", "resources.time"), ("container", "container.image"),
    ) if getattr(args, dest) is not None]
    sweep = load_sweep(args.sweep_spec, args.overrides, flags)
    if args.name:
        sweep = dataclasses.replace(sweep, name=args.name)
    if args.no_report or args.serial:
        sweep = dataclasses.replace(sweep, report=sweep.report and not args.no_report,
                                    serial=sweep.serial or args.serial)
    script_flags = script_flag_values(args, sweep.base.script is not None)
    if script_flags:  # --chdir / --live-code: every point's script
        script = dataclasses.replace(sweep.base.script, **script_flags)
        sweep = dataclasses.replace(sweep, base=dataclasses.replace(sweep.base, script=script))
    if not args.no_data_check:
        check_data_dir(sweep.base)
    if sweep.base.script is not None:  # the script exists and compiles; its hash goes into every point
        from cyclone_kit.config.script import checked_spec
        from cyclone_kit.config.validate import check_backend

        check_backend(sweep.base, args.backend)
        sweep = dataclasses.replace(sweep, base=checked_spec(sweep.base)[0])
    profile = load_profile(sweep.base.resources.profile)
    runs = lib.plan(sweep, profile)
    from cyclone_kit.config.validate import check_restart_backend

    for r in runs:  # a point may set resources.spare_nodes / min_nodes
        check_restart_backend(r.job, args.backend)
    runs_dir = Path(args.runs_dir).absolute()
    if any(r.job.spec.container is not None for r in runs):  # the image, runtime and binds, before anything is written
        from cyclone_kit.config.container import check_container
        from cyclone_kit.config.validate import check_backend

        check_backend(runs[0].job.spec, args.backend)
        runs = tuple(dataclasses.replace(r, job=check_container(r.job, runs_dir)) for r in runs)
    if args.dry_run:
        sys.stdout.write(lib.plan_text(sweep, runs, args.backend, runs_dir))
        return 0
    if not lib.study_backend(args.backend).foreground and profile.account_required and not runs[0].job.account:
        raise ValidationError(f"profile {profile.name!r} requires a Slurm account",
                              hint="pass --account=<project> (e.g. p163) or set account in your profile")
    study = lib.create_study(sweep, runs, args.backend, runs_dir, profile)
    print(f"study dir: {study.path}")
    print(lib.plan_table(sweep, runs), end="")
    outcome = lib.submit_study(sweep, runs, study, args.backend, echo=None if args.quiet else sys.stdout,
                               out=sys.stdout, err=sys.stderr)
    if outcome.interrupted:
        return 130
    if outcome.foreground:  # the backend ran the points here (local launcher, submitit's local executor)
        return _finish_foreground(sweep, runs, outcome, args.backend)
    if args.wait:
        states = lib.wait_study(outcome)
        print("final states: " + ", ".join(f"{k}={v}" for k, v in states.items()))
        if any(v != "COMPLETED" for v in states.values()):
            return 1
    return 0


def _finish_foreground(sweep: Any, runs: Any, outcome: Any, backend: str) -> int:
    """After points ran here: the report (in this process), then the exit code."""
    from cyclone_kit.submit import study as lib

    code = 0
    if sweep.report:
        code = _report_here(outcome.study.path, outcome.study.report)
        lib.write_submitted(outcome.study, backend, outcome.entries, {"output": outcome.study.report.name,
                                                                       "exit_code": code})
    if outcome.failed:
        sys.stderr.write(f"error: {outcome.failed} of {len(runs)} run(s) failed (listed as incomplete in the "
                         f"report). HINT: see failure.json in their run directories under {outcome.study.path}\n")
        return 1
    return code


def _report_here(study: Path, out_dir: Path) -> int:
    """Run ``report STUDY -o STUDY/report`` in this process (the report command prints its summary)."""
    from cyclone_kit.cli.app import main

    print(f"== report: {out_dir}", flush=True)
    return main(["report", str(study), "-o", str(out_dir)])
