"""Sweeps as a library: plan a scaling study, create its directory, run or submit every point.

``cyclone-kit sweep`` (:mod:`cyclone_kit.cli.sweep`) only parses arguments, calls these
functions and runs the report; anything else (a notebook, a script, issue 14's script sweeps)
can call them the same way::

    sweep = load_sweep("jobs/strong_scaling.toml")
    runs = plan(sweep)                                  # one validated job per point and repeat
    study = create_study(sweep, runs, "slurm", "runs")  # all or nothing
    outcome = submit_study(sweep, runs, study, "slurm") # every point, then the report job

The study directory (:class:`cyclone_kit.rundir.layout.StudyDir`) holds ``sweep.json`` (the record the
analysis reads), one run directory per point and, once submitted, ``submitted.json``.
Progress lines go to ``out`` (default: nowhere).
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from cyclone_kit.backends import get_backend
from cyclone_kit.backends.base import Backend
from cyclone_kit.config.profile import ClusterProfile, load_profile
from cyclone_kit.config.sweep import SweepRun, SweepSpec, expand, sweep_record
from cyclone_kit.config.validate import ResolvedJob
from cyclone_kit.core.errors import CycloneError, ValidationError
from cyclone_kit.rundir.fileio import write_atomic
from cyclone_kit.rundir.layout import StudyDir, create_run_dir, remove_run_dir, run_dir_name
from cyclone_kit.submit.render import render_report_script as report_script
from cyclone_kit.submit.submission import plan_submission, write_plan

BACKENDS = ("slurm", "submitit", "local")


@dataclass
class StudyOutcome:
    """What running or submitting a study did.

    Attributes:
        study: the study directory.
        entries: one mapping per point (name, run_dir, job_id, and status for foreground runs).
        report: the report job (job_id, output, dependency) when one was submitted.
        failed: points that failed (foreground backends).
        interrupted: a foreground run was interrupted; the study is incomplete.
        foreground: the points ran here (local launcher, submitit's local executor) and have ended.
    """

    study: StudyDir
    entries: list[dict[str, Any]] = field(default_factory=list)
    report: dict[str, Any] | None = None
    failed: int = 0
    interrupted: bool = False
    foreground: bool = False


# --------------------------------------------------------------------------- planning (pure)
def plan(sweep: SweepSpec, profile: ClusterProfile | None = None) -> tuple[SweepRun, ...]:
    """One validated job per point and repeat (the base job's profile unless ``profile`` is given)."""
    return expand(sweep, profile or load_profile(sweep.base.resources.profile))


def plan_table(sweep: SweepSpec, runs: Sequence[SweepRun]) -> str:
    """One line per run: name, world size, layout, batch sizes (pure)."""
    lines = [f"{sweep.mode} scaling study {sweep.name!r}: {len(runs)} run(s)"]
    lines.append(f"  {'run':<24} {'ranks':>5} {'nodes x tasks':>13} {'batch/device':>12} {'global batch':>12}")
    for r in runs:
        rec = r.record()
        lines.append(f"  {r.name:<24} {r.world_size:>5} {f'{r.job.nodes} x {r.job.ntasks_per_node}':>13} "
                     f"{rec['per_device_batch_size']:>12} {rec['global_batch_size']:>12}")
    return "\n".join(lines) + "\n"


def point_backend(backend: str, job: ResolvedJob) -> Backend:
    """The backend a point of a study runs on: the one named, the local launcher with the point's threads
    (its CPUs per task, at most this machine's cores shared among its ranks)."""
    if backend != "local":
        return get_backend(backend)
    from cyclone_kit.backends.local import LocalBackend

    return LocalBackend(threads=local_threads(job))


def local_threads(job: ResolvedJob) -> int:
    """Torch threads per rank of a study's point on the local launcher: its CPUs per task, at most this
    machine's cores shared among its ranks."""
    from cyclone_kit.backends.local_env import available_cores

    return max(1, min(job.cpus_per_task, available_cores() // job.world_size))


def plan_text(sweep: SweepSpec, runs: Sequence[SweepRun], backend: str, runs_dir: Path) -> str:
    """The dry run: the plan, then every point's submission plan as its backend would schedule it (pure)."""
    study = StudyDir(Path(runs_dir) / run_dir_name(sweep.name))
    parts = [f"# study dir (would be): {study.path}\n# backend: {backend}\n", plan_table(sweep, runs)]
    if backend == "local":
        parts.append("# local: the runs execute one after another on this machine, then the report\n")
        return "".join(parts)
    seen = set()
    for r in runs:
        if r.name in seen:
            continue
        seen.add(r.name)
        point = plan_submission(r.job, study.run(r.name).path, point_backend(backend, r.job))
        parts.append(f"\n# ---- {r.name}/{point.text_at} ----\n")
        parts.append(point.text())
    if sweep.report:
        parts.append(f"\n# ---- {study.report_script.name} (submitted with #SBATCH --dependency=afterany:"
                     "<every point's job id>) ----\n")
        parts.append(report_script(study.path, runs[0].job, [], name=f"{sweep.name}-report"))
    return "".join(parts)


# --------------------------------------------------------------------------- side effects
def create_study(sweep: SweepSpec, runs: Sequence[SweepRun], backend: str, runs_dir: Path,
                 profile: ClusterProfile | None = None) -> StudyDir:
    """Create the study directory with every point's run directory in it, holding the files of the point's
    submission plan (:func:`cyclone_kit.submit.submission.plan_submission`), all or nothing.

    Raises:
        ValidationError: a value cannot be planned (rendered), or ``runs_dir`` is not writable.
    """
    runs_dir = Path(runs_dir).absolute()
    placeholder = runs_dir / run_dir_name(sweep.name)
    for r in runs:  # a value that cannot be planned fails before anything exists
        plan_submission(r.job, placeholder / r.name, point_backend(backend, r.job))
    study = StudyDir(create_run_dir(runs_dir, sweep.name, {}))
    try:
        for r in runs:
            rd = study.run(r.name)
            rd.logs.mkdir(parents=True)
            write_plan(plan_submission(r.job, rd.path, point_backend(backend, r.job)))
        record = sweep_record(sweep, runs, profile or runs[0].job.profile, backend)
        write_atomic(study.sweep, json.dumps(record, indent=2) + "\n")
    except BaseException:
        remove_run_dir(study.path)
        raise
    return study


def write_submitted(study: StudyDir, backend: str, entries: Sequence[dict[str, Any]],
                    report: dict[str, Any] | None) -> None:
    """``submitted.json``: the job id (and, for foreground runs, the outcome) of every point."""
    doc = {"schema": 1, "kind": "submitted", "backend": backend, "runs": list(entries), "report": report}
    write_atomic(study.submitted, json.dumps(doc, indent=2) + "\n")


def run_local(runs: Sequence[SweepRun], study: StudyDir, *, echo: IO[str] | None = None,
              out: IO[str] | None = None, err: IO[str] | None = None) -> StudyOutcome:
    """Run every point here with the local launcher, one after another (``submitted.json`` kept current).

    Args:
        echo: receives rank 0's output of each run (None: silent).
        out, err: progress lines and failure reports (default: nowhere).
    """
    from cyclone_kit.backends.local import LocalBackend
    from cyclone_kit.backends.srun_emulator import format_failure

    out, err = out or io.StringIO(), err or io.StringIO()
    outcome = StudyOutcome(study, foreground=True)
    try:
        for r in runs:
            rd = study.run(r.name)
            threads = local_threads(r.job)
            print(f"== {r.name}: {r.world_size} rank(s), {threads} thread(s) each", file=out, flush=True)
            backend = LocalBackend(echo=echo, quiet=echo is None, threads=threads)
            result = backend.launch(backend.plan(r.job, rd.path))  # the plan whose files create_study wrote
            backend.record(rd.path, result)
            outcome.entries.append({"name": r.name, "run_dir": r.name, "job_id": result.job_id,
                                    "status": "completed" if result.ok else "failed",
                                    "wall_time_s": round(result.wall_time_s, 3)})
            write_submitted(study, "local", outcome.entries, None)
            if result.interrupted:
                outcome.interrupted = True
                print(f"error: interrupted during {r.name}; the study is incomplete: {study.path}", file=err)
                return outcome
            if not result.ok:
                outcome.failed += 1
                print(format_failure(result), file=err)
            else:
                print(f"== {r.name}: completed in {result.wall_time_s:.1f} s", file=out, flush=True)
    finally:
        write_submitted(study, "local", outcome.entries, None)
    return outcome


def run_submitit_local(runs: Sequence[SweepRun], study: StudyDir, backend: Any, *,
                       out: IO[str] | None = None, err: IO[str] | None = None) -> StudyOutcome:
    """submitit's local executor: run the points one after another in the foreground."""
    out, err = out or io.StringIO(), err or io.StringIO()
    outcome = StudyOutcome(study, foreground=True)
    for r in runs:
        rd = study.run(r.name)
        print(f"== {r.name}: {r.world_size} rank(s) via submitit (local executor)", file=out, flush=True)
        try:
            job_id = backend.schedule(plan_submission(r.job, rd.path, backend)).job_id
            status = "completed"
        except CycloneError as e:
            outcome.failed += 1
            job_id = rd.submitit_job_id() or ""
            status = "failed"
            print(f"error: {e}", file=err)
        rd.write_backend(backend.name)
        if job_id:
            rd.write_job_id(job_id)
        outcome.entries.append({"name": r.name, "run_dir": r.name, "job_id": job_id, "status": status})
        write_submitted(study, backend.name, outcome.entries, None)
    return outcome


def submit_study(sweep: SweepSpec, runs: Sequence[SweepRun], study: StudyDir, backend: str, *,
                 out: IO[str] | None = None, err: IO[str] | None = None) -> StudyOutcome:
    """Submit every point through ``backend`` (chained ``afterany`` when the sweep is serial), then the
    report job after all of them; all or nothing (a failure cancels what was submitted).

    submitit's local executor runs the points in the foreground instead (:func:`run_submitit_local`).
    """
    from cyclone_kit.backends.slurm import SlurmBackend

    out, err = out or io.StringIO(), err or io.StringIO()
    chosen = get_backend(backend)
    if backend == "submitit" and chosen.chosen_executor() == "local":  # type: ignore[attr-defined]
        return run_submitit_local(runs, study, chosen, out=out, err=err)
    if backend == "local":
        raise ValidationError("the local backend runs a study in the foreground", hint="use run_local")
    outcome = StudyOutcome(study)
    slurm = SlurmBackend()
    try:
        for r in runs:
            after = [outcome.entries[-1]["job_id"]] if sweep.serial and outcome.entries else []
            # the point's plan (its files written by create_study), with the job ids it waits for known now
            handle = chosen.schedule(plan_submission(r.job, study.run(r.name).path, chosen, after=after))
            outcome.entries.append({"name": r.name, "run_dir": r.name, "job_id": handle.job_id,
                                    **({"after": after} if after else {})})
            print(f"submitted {r.name}: job {handle.job_id}", file=out, flush=True)
        if sweep.report:
            ids = [e["job_id"] for e in outcome.entries]
            write_atomic(study.report_script, report_script(study.path, runs[0].job, ids, name=f"{sweep.name}-report"))
            report_id = slurm.submit(study.report_script, study.path)
            outcome.report = {"job_id": report_id, "output": study.report.name, "dependency": "afterany"}
            print(f"submitted report: job {report_id} (after all points) -> {study.report}", file=out, flush=True)
    except BaseException:
        # all or nothing: cancel what was submitted, then say so (the directory stays for the logs)
        for e in outcome.entries:
            try:
                slurm.cancel(e["job_id"])
            except Exception as exc:  # best effort while already failing
                print(f"warning: could not cancel job {e['job_id']}: {exc}", file=err)
        write_submitted(study, backend, [{**e, "cancelled": True} for e in outcome.entries], None)
        raise
    write_submitted(study, backend, outcome.entries, outcome.report)
    return outcome


def wait_study(outcome: StudyOutcome) -> dict[str, str]:
    """Wait until every submitted job (and the report) ended; their final Slurm states by job id."""
    from cyclone_kit.backends.slurm import SlurmBackend

    slurm = SlurmBackend()
    ids = [e["job_id"] for e in outcome.entries] + ([outcome.report["job_id"]] if outcome.report else [])
    return {job_id: slurm.wait(job_id, timeout=7 * 24 * 3600, poll=2.0).state.value for job_id in ids}
