"""``sweep``: run a scaling study — one run directory per point, submitted together, then the report.

The study directory ``RUNS_DIR/<study>-<stamp>/`` is created whole or not at all: ``sweep.json``
(the record the analysis reads), one run directory per point (``spec.json``, ``job.sbatch``,
``logs/``) and ``logs/`` for the report job. After submission ``submitted.json`` lists the job
id (and, for local runs, the outcome) of every point.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

BACKENDS = ("slurm", "submitit", "local")


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``sweep``."""
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
    p.add_argument("--no-report", action="store_true", help="do not run or submit the report")
    p.add_argument("--serial", action="store_true",
                   help="slurm/submitit: run the points one after another (as serial = true in the spec)")
    p.add_argument("--wait", action="store_true", help="slurm/submitit: wait until every job (and the report) ended")
    p.add_argument("--quiet", action="store_true", help="local: do not echo rank 0's output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Plan, create, submit; returns 0, or 1 when a local point failed."""
    import dataclasses

    from cyclone_kit.config import load_profile
    from cyclone_kit.errors import ValidationError
    from cyclone_kit.sweep import expand, load_sweep

    flags = [(key, getattr(args, dest)) for dest, key in (
        ("profile", "resources.profile"), ("partition", "resources.partition"),
        ("account", "resources.account"), ("time", "resources.time"),
    ) if getattr(args, dest) is not None]
    sweep = load_sweep(args.sweep_spec, args.overrides, flags)
    if args.name:
        sweep = dataclasses.replace(sweep, name=args.name)
    if args.no_report or args.serial:
        sweep = dataclasses.replace(sweep, report=sweep.report and not args.no_report,
                                    serial=sweep.serial or args.serial)
    if sweep.base.script is not None:  # the script exists and compiles; its hash goes into every point
        from cyclone_kit.jobspec import check_backend, checked_spec

        check_backend(sweep.base, args.backend)
        sweep = dataclasses.replace(sweep, base=checked_spec(sweep.base)[0])
    profile = load_profile(sweep.base.resources.profile)
    runs = expand(sweep, profile)
    runs_dir = Path(args.runs_dir).absolute()
    if args.dry_run:
        sys.stdout.write(_plan_text(sweep, runs, args.backend, runs_dir))
        return 0
    if args.backend != "local" and profile.account_required and not runs[0].job.account:
        raise ValidationError(f"profile {profile.name!r} requires a Slurm account",
                              hint="pass --account=<project> (e.g. p163) or set account in your profile")
    study = _create_study(sweep, runs, profile, args.backend, runs_dir)
    print(f"study dir: {study}")
    print(_plan_table(sweep, runs), end="")
    if args.backend == "local":
        return _run_local(sweep, runs, study, quiet=args.quiet)
    return _submit_batch(sweep, runs, study, args.backend, wait=args.wait)


# --------------------------------------------------------------------------- planning (pure)
def _plan_table(sweep: Any, runs: Any) -> str:
    """One line per run: name, world size, layout, batch sizes."""
    lines = [f"{sweep.mode} scaling study {sweep.name!r}: {len(runs)} run(s)"]
    lines.append(f"  {'run':<24} {'ranks':>5} {'nodes x tasks':>13} {'batch/device':>12} {'global batch':>12}")
    for r in runs:
        rec = r.record()
        lines.append(f"  {r.name:<24} {r.world_size:>5} {f'{r.job.nodes} x {r.job.ntasks_per_node}':>13} "
                     f"{rec['per_device_batch_size']:>12} {rec['global_batch_size']:>12}")
    return "\n".join(lines) + "\n"


def _plan_text(sweep: Any, runs: Any, backend: str, runs_dir: Path) -> str:
    """The dry-run output: the plan, then every script that would be submitted."""
    from cyclone_kit.render import render_script
    from cyclone_kit.rundir import run_dir_name
    from cyclone_kit.sweep import report_script

    study = runs_dir / run_dir_name(sweep.name)
    parts = [f"# study dir (would be): {study}\n# backend: {backend}\n", _plan_table(sweep, runs)]
    if backend == "local":
        parts.append("# local: the runs execute one after another on this machine, then the report\n")
        return "".join(parts)
    seen = set()
    for r in runs:
        if r.name in seen:
            continue
        seen.add(r.name)
        parts.append(f"\n# ---- {r.name}/job.sbatch ----\n")
        parts.append(render_script(r.job, study / r.name))
    if sweep.report:
        parts.append("\n# ---- report.sbatch (submitted with #SBATCH --dependency=afterany:<every point's job id>) ----\n")
        parts.append(report_script(study, runs[0].job, [], name=f"{sweep.name}-report"))
    return "".join(parts)


# --------------------------------------------------------------------------- side effects
def _create_study(sweep: Any, runs: Any, profile: Any, backend: str, runs_dir: Path) -> Path:
    """Create the study directory with every run directory in it, all or nothing."""
    from cyclone_kit.jobspec import script_files, spec_json
    from cyclone_kit.render import render_script
    from cyclone_kit.rundir import create_run_dir, remove_run_dir, run_dir_name, write_atomic
    from cyclone_kit.sweep import sweep_record

    placeholder = runs_dir / run_dir_name(sweep.name)
    for r in runs:  # a value that cannot be rendered fails before anything exists
        render_script(r.job, placeholder / r.name)
    study = create_run_dir(runs_dir, sweep.name, {})
    try:
        for r in runs:
            run_dir = study / r.name
            (run_dir / "logs").mkdir(parents=True)
            write_atomic(run_dir / "spec.json", spec_json(r.job))
            for rel, content in script_files(r.job.spec).items():
                (run_dir / rel).parent.mkdir(parents=True, exist_ok=True)
                write_atomic(run_dir / rel, content)
            write_atomic(run_dir / "job.sbatch", render_script(r.job, run_dir))
            (run_dir / "job.sbatch").chmod(0o755)
        record = sweep_record(sweep, runs, profile, backend)
        write_atomic(study / "sweep.json", json.dumps(record, indent=2) + "\n")
    except BaseException:
        remove_run_dir(study)
        raise
    return study


def _write_submitted(study: Path, backend: str, entries: list[dict[str, Any]], report: dict[str, Any] | None) -> None:
    from cyclone_kit.rundir import write_atomic

    doc = {"schema": 1, "kind": "submitted", "backend": backend, "runs": entries, "report": report}
    write_atomic(study / "submitted.json", json.dumps(doc, indent=2) + "\n")


def _run_local(sweep: Any, runs: Any, study: Path, *, quiet: bool) -> int:
    """Run every point here, one after another, then the report; 1 when a point failed."""
    from cyclone_kit.backends.local import _set_spec_threads, available_cores, format_failure, launch
    from cyclone_kit.launch import rank_command
    from cyclone_kit.rundir import write_atomic

    entries: list[dict[str, Any]] = []
    failed = 0
    cores = available_cores()
    try:
        for r in runs:
            run_dir = study / r.name
            threads = max(1, min(r.job.cpus_per_task, cores // r.world_size))
            _set_spec_threads(run_dir / "spec.json", threads)
            print(f"== {r.name}: {r.world_size} rank(s), {threads} thread(s) each", flush=True)
            result = launch(run_dir, r.world_size, r.job.nodes, threads=threads, job_name=r.job.spec.name,
                            command=rank_command(r.job.spec, run_dir), echo=None if quiet else sys.stdout)
            write_atomic(run_dir / "job_id", result.job_id + "\n")
            write_atomic(run_dir / "backend", "local\n")
            entries.append({"name": r.name, "run_dir": r.name, "job_id": result.job_id,
                            "status": "completed" if result.ok else "failed",
                            "wall_time_s": round(result.wall_time_s, 3)})
            _write_submitted(study, "local", entries, None)
            if result.interrupted:
                sys.stderr.write(f"error: interrupted during {r.name}; the study is incomplete: {study}\n")
                return 130
            if not result.ok:
                failed += 1
                sys.stderr.write(format_failure(result) + "\n")
            else:
                print(f"== {r.name}: completed in {result.wall_time_s:.1f} s", flush=True)
    finally:
        _write_submitted(study, "local", entries, None)
    code = 0
    if sweep.report:
        code = _report_here(study)
        _write_submitted(study, "local", entries, {"output": "report", "exit_code": code})
    if failed:
        sys.stderr.write(f"error: {failed} of {len(runs)} run(s) failed (listed as incomplete in the report). "
                         f"HINT: see failure.json in their run directories under {study}\n")
        return 1
    return code


def _report_here(study: Path) -> int:
    """Run ``report STUDY -o STUDY/report`` in this process."""
    from cyclone_kit.cli import main

    print(f"== report: {study / 'report'}", flush=True)
    return main(["report", str(study), "-o", str(study / "report")])


def _submit_batch(sweep: Any, runs: Any, study: Path, backend: str, *, wait: bool) -> int:
    """Submit every point (sbatch or submitit), then the dependent report job; record the ids."""
    from cyclone_kit.backends import get_backend
    from cyclone_kit.backends.slurm import SlurmBackend
    from cyclone_kit.rundir import write_atomic
    from cyclone_kit.sweep import report_script, with_dependency

    slurm = SlurmBackend()
    chosen = get_backend(backend)
    if backend == "submitit" and chosen.chosen_executor() == "local":
        return _run_submitit_local(sweep, runs, study, chosen)
    entries: list[dict[str, Any]] = []
    try:
        for r in runs:
            run_dir = study / r.name
            after = [entries[-1]["job_id"]] if sweep.serial and entries else []
            if backend == "slurm":
                script = run_dir / "job.sbatch"
                if after:
                    write_atomic(script, with_dependency(script.read_text(encoding="utf-8"), after))
                job_id = slurm.submit(script, run_dir)
            else:
                job_id = chosen.submit_run(r.job, run_dir, dependency=f"afterany:{after[0]}" if after else None)
            write_atomic(run_dir / "job_id", job_id + "\n")
            write_atomic(run_dir / "backend", backend + "\n")
            entries.append({"name": r.name, "run_dir": r.name, "job_id": job_id})
            print(f"submitted {r.name}: job {job_id}", flush=True)
        report = None
        if sweep.report:
            script = study / "report.sbatch"
            write_atomic(script, report_script(study, runs[0].job, [e["job_id"] for e in entries],
                                               name=f"{sweep.name}-report"))
            report_id = slurm.submit(script, study)
            report = {"job_id": report_id, "output": "report", "dependency": "afterany"}
            print(f"submitted report: job {report_id} (after all points) -> {study / 'report'}", flush=True)
    except BaseException:
        # all or nothing: cancel what was submitted, then say so (the directory stays for the logs)
        for e in entries:
            try:
                slurm.cancel(e["job_id"])
            except Exception as exc:  # best effort while already failing
                sys.stderr.write(f"warning: could not cancel job {e['job_id']}: {exc}\n")
        _write_submitted(study, backend, [{**e, "cancelled": True} for e in entries], None)
        raise
    _write_submitted(study, backend, entries, report)
    if wait:
        ids = [e["job_id"] for e in entries] + ([report["job_id"]] if report else [])
        states = {}
        for job_id in ids:
            states[job_id] = slurm.wait(job_id, timeout=7 * 24 * 3600, poll=2.0).state.value
        print("final states: " + ", ".join(f"{k}={v}" for k, v in states.items()))
        if any(v != "COMPLETED" for v in states.values()):
            return 1
    return 0


def _run_submitit_local(sweep: Any, runs: Any, study: Path, chosen: Any) -> int:
    """submitit's local executor: run the points one after another in the foreground, then the report."""
    from cyclone_kit.errors import CycloneError
    from cyclone_kit.rundir import write_atomic

    entries: list[dict[str, Any]] = []
    failed = 0
    for r in runs:
        run_dir = study / r.name
        print(f"== {r.name}: {r.world_size} rank(s) via submitit (local executor)", flush=True)
        try:
            job_id = chosen.submit_run(r.job, run_dir)
            status = "completed"
        except CycloneError as e:
            failed += 1
            job_id = (run_dir / "submitit_job").read_text().strip() if (run_dir / "submitit_job").exists() else ""
            status = "failed"
            sys.stderr.write(f"error: {e}\n")
        write_atomic(run_dir / "backend", "submitit\n")
        if job_id:
            write_atomic(run_dir / "job_id", job_id + "\n")
        entries.append({"name": r.name, "run_dir": r.name, "job_id": job_id, "status": status})
        _write_submitted(study, "submitit", entries, None)
    code = _report_here(study) if sweep.report else 0
    return 1 if failed else code
