"""A job's submission plan, its run directory and its hand-over to the backend (the side-effect edge).

The one path of ``submit`` (every backend), ``run`` and a study's points: the backend builds the
plan (:func:`plan_submission`, pure: what ``--dry-run`` prints), this module writes exactly the
plan's files into a new run directory (:func:`prepare`), and the backend schedules that same plan
(:func:`submit_job`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from cyclone_kit.backends import get_backend
from cyclone_kit.backends.base import Backend
from cyclone_kit.backends.plan import SubmissionPlan
from cyclone_kit.config.validate import ResolvedJob
from cyclone_kit.core.errors import RankFailure
from cyclone_kit.rundir.fileio import write_atomic
from cyclone_kit.rundir.layout import RunDir, create_run_dir, remove_run_dir
from cyclone_kit.submit.render import render_script


def plan_submission(job: ResolvedJob, run_dir: Path, backend: Backend, *,
                    after: Sequence[str] = ()) -> SubmissionPlan:
    """``backend``'s plan for ``job`` in ``run_dir`` (pure: nothing is written): the batch script is
    rendered here, once, for the backends that submit it (``Backend.batch_script``)."""
    run_dir = Path(run_dir).absolute()
    script = render_script(job, run_dir) if backend.batch_script else None
    return backend.plan(job, run_dir, script=script, after=after)


def write_plan(plan: SubmissionPlan) -> None:
    """Write the plan's files into its (existing) run directory: the batch script (executable), the rest
    as they are, and ``spec.json`` (the one writer of it) last; each file atomically. A directory is a run
    once its ``spec.json`` exists (``RunDir.is_run_dir``), so one cut short here (a kill, a full disk) is
    never taken for a run with missing files."""
    rd = RunDir(plan.run_dir)
    for rel, data in sorted(plan.files.items(), key=lambda item: rd.path / item[0] == rd.spec):
        target = rd.path / rel
        if target == rd.spec:
            rd.write_spec(str(data))
        elif target == rd.script:
            rd.write_script(str(data))
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(target, data)


def prepare(job: ResolvedJob, runs_dir: Path, backend: Backend, *,
            after: Sequence[str] = ()) -> SubmissionPlan:
    """Make a new run directory for ``job`` under ``runs_dir``, plan the job there and write the plan's
    files, all or nothing (a value the plan refuses leaves no directory behind).

    Every run directory a job runs in is made here: ``submit`` on every backend and ``run`` (a
    study's points get theirs in :mod:`cyclone_kit.submit.study`, from the same plans).
    """
    path = create_run_dir(Path(runs_dir).absolute(), job.spec.name, {})
    try:
        plan = plan_submission(job, path, backend, after=after)
        write_plan(plan)
    except BaseException:
        remove_run_dir(path)
        raise
    return plan


def prepare_run_dir(job: ResolvedJob, runs_dir: Path, backend: str = "slurm") -> Path:
    """:func:`prepare`'s run directory, for the backend registered as ``backend``."""
    return prepare(job, runs_dir, get_backend(backend)).run_dir


def submit_job(job: ResolvedJob, runs_dir: Path, backend: Backend) -> tuple[Path, str]:
    """Prepare a run directory (:func:`prepare`) and schedule its plan; on failure the directory is removed again.

    The backend records the job id and its own name in the run directory.
    """
    plan = prepare(job, runs_dir, backend)
    try:
        handle = backend.schedule(plan)
    except RankFailure:
        raise  # the run happened (local backend): keep its logs and failure.json
    except BaseException:
        remove_run_dir(plan.run_dir)
        raise
    return plan.run_dir, handle.job_id
