"""Facts about the current Slurm job, read from an environment mapping passed in (pure).

Pass ``os.environ`` from the edge; tests pass plain dicts.
"""

from __future__ import annotations

from collections.abc import Mapping

from cyclone_kit.core.errors import ValidationError


def requeue_target(environ: Mapping[str, str]) -> str:
    """The id to hand to ``scontrol requeue`` from inside a job.

    For a job-array task that is ``ARRAYJOBID_TASKID`` (requeueing SLURM_JOB_ID would address
    the task's own numeric id, and the parent id would requeue every task); otherwise
    SLURM_JOB_ID.

    Raises:
        ValidationError: no SLURM_JOB_ID (not inside a Slurm job), or a non-numeric id.
    """
    job_id = environ.get("SLURM_JOB_ID", "").strip()
    array_job = environ.get("SLURM_ARRAY_JOB_ID", "").strip()
    array_task = environ.get("SLURM_ARRAY_TASK_ID", "").strip()
    if array_job and array_task:
        if not (array_job.isdigit() and array_task.isdigit()):
            raise ValidationError(
                f"SLURM_ARRAY_JOB_ID={array_job!r} and SLURM_ARRAY_TASK_ID={array_task!r} are not job ids",
                hint="both must be numbers, as Slurm sets them inside an array task",
            )
        return f"{array_job}_{array_task}"
    if not job_id:
        raise ValidationError(
            "SLURM_JOB_ID is not set: this is not running inside a Slurm job",
            hint="requeue from the batch script or a task it started (srun), not from a login shell",
        )
    if not job_id.isdigit():
        raise ValidationError(f"SLURM_JOB_ID={job_id!r} is not a job id", hint="Slurm sets it to a number")
    return job_id


def restart_count(environ: Mapping[str, str]) -> int:
    """How many times this job was requeued: SLURM_RESTART_COUNT, absent (0) on the first run.

    Raises:
        ValidationError: the variable is set but not a non-negative integer.
    """
    raw = environ.get("SLURM_RESTART_COUNT", "").strip()
    if not raw:
        return 0
    if not raw.isdigit():
        raise ValidationError(f"SLURM_RESTART_COUNT={raw!r} is not a count", hint="Slurm sets it to 0, 1, 2, ...")
    return int(raw)
