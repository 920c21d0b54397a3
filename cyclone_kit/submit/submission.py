"""Create a run directory for a resolved job and hand it to a backend (the side-effect edge)."""

from __future__ import annotations

from pathlib import Path

from cyclone_kit.backends import get_backend
from cyclone_kit.config.validate import ResolvedJob
from cyclone_kit.core.errors import RankFailure
from cyclone_kit.rundir.layout import RunDir, remove_run_dir
from cyclone_kit.submit.render import render_script


def prepare_run_dir(job: ResolvedJob, runs_dir: Path, extra_files: dict[str, str] | None = None, *,
                    batch_script: bool = True) -> Path:
    """Write ``spec.json`` (the resolved spec: the one writer of it), a user script's copy and, with
    ``batch_script``, ``job.sbatch`` into a new run directory, all or nothing.

    Every run directory a job runs in is made here: ``submit`` on every backend, and ``run``
    (the local backend, ``batch_script=False``: no batch script runs there).
    """
    from cyclone_kit.config.jobspec import script_files, spec_json

    runs_dir = Path(runs_dir).absolute()
    rd = RunDir.create(runs_dir, job.spec.name, spec_json(job), {**script_files(job.spec), **(extra_files or {})})
    if not batch_script:
        return rd.path
    try:  # rendered once, for the directory's final name; a bad value leaves no directory behind
        rd.write_script(render_script(job, rd.path))
    except BaseException:
        remove_run_dir(rd.path)
        raise
    return rd.path


def submit_job(job: ResolvedJob, runs_dir: Path, backend: str = "slurm") -> tuple[Path, str]:
    """Prepare a run directory and submit it; on failure the directory is removed again.

    The backend records the job id and its own name in the run directory.
    """
    chosen = get_backend(backend)
    run_dir = prepare_run_dir(job, runs_dir, batch_script=chosen.batch_script)
    try:
        handle = chosen.submit_run(job, run_dir)
    except RankFailure:
        raise  # the run happened (local backend): keep its logs and failure.json
    except BaseException:
        remove_run_dir(run_dir)
        raise
    return run_dir, handle.job_id
