"""argv builders for Slurm's commands (pure: they run nothing).

The output formats asked for here are the ones :mod:`cyclone_kit.slurm.parse` reads; change
them together.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

from cyclone_kit.core.errors import ValidationError

#: squeue --Format fields, in the order parse_squeue reads them. ``exit_code`` is a raw wait
#: status; the name comes last so that a "|" inside it cannot shift the other fields.
SQUEUE_FIELDS = (
    "JobArrayID",
    "State",
    "NumNodes",
    "NodeList",
    "TimeUsed",
    "Reason",
    "RestartCnt",
    "exit_code",
    "Name",
)

#: sacct --format fields, in the order parse_sacct reads them (the name last, as above).
SACCT_FIELDS = ("JobID", "State", "NNodes", "NodeList", "ElapsedRaw", "Reason", "ExitCode", "JobName")

# 123, 123_4 (array task), 123+1 (het job component); nothing a shell or Slurm would reinterpret.
_JOB_ID = re.compile(r"\d+(?:_\d+|\+\d+)?")


def check_job_id(job_id: str) -> str:
    """Return ``job_id`` if it is a Slurm job id (``123``, ``123_4``, ``123+1``).

    Raises:
        ValidationError: anything else (a name, a list, an id with spaces).
    """
    text = str(job_id).strip()
    if not _JOB_ID.fullmatch(text):
        raise ValidationError(
            f"{job_id!r} is not a Slurm job id",
            hint="use the number sbatch printed, e.g. 123, or 123_4 for task 4 of array job 123",
        )
    return text


def dependency(after: Sequence[str], kind: str = "afterany") -> str:
    """``afterany:1:2``: the sbatch dependency on every job in ``after`` (pure).

    Raises:
        ValidationError: an id is not a Slurm job id.
    """
    return f"{kind}:{':'.join(check_job_id(str(j)) for j in after)}"


def sbatch(script: str | os.PathLike[str], extra: Sequence[str] = ()) -> list[str]:
    """``sbatch --parsable [extra...] SCRIPT``: prints ``JOBID`` or ``JOBID;CLUSTER``."""
    return ["sbatch", "--parsable", *extra, os.fspath(script)]


def _id_list(job_ids: Sequence[str]) -> str:
    """``1,2,3_4``: checked, deduplicated job ids for ``--jobs`` (pure).

    Raises:
        ValidationError: the list is empty or an id is not a Slurm job id.
    """
    ids = list(dict.fromkeys(check_job_id(str(j)) for j in job_ids))
    if not ids:
        raise ValidationError("no job id to ask Slurm about", hint="give at least one job id")
    return ",".join(ids)


def squeue(job_id: str | Sequence[str]) -> list[str]:
    """squeue for one job or several (and all tasks of an array job), every state still in the controller.

    Several ids make one call: ``status`` of a whole runs directory asks once.
    """
    fields = ",".join(f"{f}:|" for f in SQUEUE_FIELDS)
    ids = _id_list([job_id] if isinstance(job_id, str) else job_id)
    return ["squeue", "--noheader", "--states=all", f"--jobs={ids}", f"--Format={fields}"]


def sacct(job_id: str | Sequence[str]) -> list[str]:
    """sacct for the allocation record(s) (no steps) of one job or several, ``|``-separated, no header."""
    ids = _id_list([job_id] if isinstance(job_id, str) else job_id)
    return [
        "sacct",
        "--noheader",
        "--parsable2",
        "--allocations",
        f"--jobs={ids}",
        f"--format={','.join(SACCT_FIELDS)}",
    ]


def sacct_attempts(job_id: str) -> list[str]:
    """sacct for every run of a requeued job (``--duplicates``), oldest first, same fields as :func:`sacct`."""
    return [*sacct(job_id), "--duplicates"]


def scontrol_show_job(job_id: str) -> list[str]:
    """``scontrol show job ID``: exits 1 with "Invalid job id specified" for an unknown id."""
    return ["scontrol", "show", "job", check_job_id(job_id)]


def scancel(job_id: str, signal: str | None = None) -> list[str]:
    """``scancel [--signal=SIG] ID``. Note: scancel exits 0 for an unknown id."""
    argv = ["scancel"]
    if signal is not None:
        if not re.fullmatch(r"[A-Z0-9]+", signal):
            raise ValidationError(f"bad signal name {signal!r}", hint="use a name like USR1 or TERM, or a number")
        argv.append(f"--signal={signal}")
    return [*argv, check_job_id(job_id)]


def scontrol_requeue(job_id: str) -> list[str]:
    """``scontrol requeue ID``: back to PENDING; it runs again with SLURM_RESTART_COUNT+1."""
    return ["scontrol", "requeue", check_job_id(job_id)]
