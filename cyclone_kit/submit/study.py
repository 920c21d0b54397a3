"""Sweeps as a library: plan a scaling study, create its directory, run or submit every point.

``cyclone-kit sweep`` (:mod:`cyclone_kit.cli.sweep`) only parses arguments, calls these
functions and runs the report; anything else (a notebook, a script, issue 14's script sweeps)
can call them the same way::

    sweep = load_sweep("jobs/strong_scaling.toml")
    runs = plan(sweep)                                  # one validated job per point and repeat
    study = create_study(sweep, runs, "slurm", "runs")  # all or nothing
    outcome = submit_study(sweep, runs, study, "slurm") # every point, then the report job
                                                        # (a foreground backend: every point here, in turn)

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


def study_backend(backend: str) -> Backend:
    """The backend registered as ``backend``, as it runs a study's points (:meth:`Backend.for_study`: the local
    launcher gives each point's ranks its CPUs per task as threads, at most this machine's cores shared)."""
    return get_backend(backend).for_study()


def plan_text(sweep: SweepSpec, runs: Sequence[SweepRun], backend: str, runs_dir: Path) -> str:
    """The dry run: the plan, then every point's submission plan as its backend would schedule it, then the
    report job (or, for a backend that runs the points here, that the report runs here after them) (pure)."""
    chosen = study_backend(backend)
    study = StudyDir(Path(runs_dir) / run_dir_name(sweep.name))
    parts = [f"# study dir (would be): {study.path}\n# backend: {backend}\n", plan_table(sweep, runs)]
    if chosen.foreground:
        parts.append(f"# {backend}: the runs execute one after another on this machine"
                     f"{', then the report' if sweep.report else ''}\n")
    seen = set()
    for r in runs:
        if r.name in seen:
            continue
        seen.add(r.name)
        point = plan_submission(r.job, study.run(r.name).path, chosen)
        parts.append(f"\n# ---- {r.name}/{point.text_at} ----\n")
        parts.append(point.text())
    if sweep.report and not chosen.foreground:
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
    chosen = study_backend(backend)
    runs_dir = Path(runs_dir).absolute()
    placeholder = runs_dir / run_dir_name(sweep.name)
    for r in runs:  # a value that cannot be planned fails before anything exists
        plan_submission(r.job, placeholder / r.name, chosen)
    study = StudyDir(create_run_dir(runs_dir, sweep.name, {}))
    try:
        for r in runs:
            rd = study.run(r.name)
            rd.logs.mkdir(parents=True)
            write_plan(plan_submission(r.job, rd.path, chosen))
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


def run_here(runs: Sequence[SweepRun], study: StudyDir, backend: Backend, *, echo: IO[str] | None = None,
             out: IO[str] | None = None, err: IO[str] | None = None) -> StudyOutcome:
    """Run every point here, one after another, on a backend that runs its jobs in the foreground
    (:attr:`Backend.foreground`; ``submitted.json`` kept current). Ctrl-C stops the point that runs and the
    study (``interrupted``); a failed point is reported and the next one runs.

    Args:
        backend: as :func:`study_backend` gives it (the one :func:`create_study` planned the points with).
        echo: receives rank 0's output of each run, where the backend shows it (None: silent).
        out, err: progress lines and failure reports (default: nowhere).
    """
    out, err = out or io.StringIO(), err or io.StringIO()
    outcome = StudyOutcome(study, foreground=True)
    try:
        for r in runs:
            plan = plan_submission(r.job, study.run(r.name).path, backend)  # the plan whose files create_study wrote
            print(f"== {r.name}: {plan.summary or f'{r.world_size} rank(s)'}", file=out, flush=True)
            ended = backend.run_here(plan, echo=echo)
            outcome.entries.append({"name": r.name, "run_dir": r.name, "job_id": ended.job_id,
                                    "status": "completed" if ended.ok else "failed",
                                    "wall_time_s": round(ended.wall_time_s, 3)})
            write_submitted(study, backend.name, outcome.entries, None)
            if ended.interrupted:
                outcome.interrupted = True
                print(f"error: interrupted during {r.name}; the study is incomplete: {study.path}", file=err)
                return outcome
            if not ended.ok:
                outcome.failed += 1
                print(ended.report, file=err)
            else:
                print(f"== {r.name}: completed in {ended.wall_time_s:.1f} s", file=out, flush=True)
    finally:
        write_submitted(study, backend.name, outcome.entries, None)
    return outcome


def submit_study(sweep: SweepSpec, runs: Sequence[SweepRun], study: StudyDir, backend: str, *,
                 echo: IO[str] | None = None, out: IO[str] | None = None, err: IO[str] | None = None) -> StudyOutcome:
    """Submit every point through ``backend`` (chained ``afterany`` when the sweep is serial), then the
    report job after all of them; all or nothing (a failure cancels what was submitted).

    A backend that runs its jobs here (the local launcher, submitit's local executor) runs the points in the
    foreground instead (:func:`run_here`, rank 0's output to ``echo``); the caller runs the report after them.
    """
    from cyclone_kit.backends.slurm import SlurmBackend

    out, err = out or io.StringIO(), err or io.StringIO()
    chosen = study_backend(backend)
    if chosen.foreground:
        return run_here(runs, study, chosen, echo=echo, out=out, err=err)
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
