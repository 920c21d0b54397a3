"""Slurm job states, and the mapping from every spelling Slurm prints onto :class:`JobState`."""

from __future__ import annotations

import enum


class JobState(enum.Enum):
    """The state of a Slurm job, reduced to the cases a caller acts on."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    COMPLETING = "COMPLETING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TIMEOUT = "TIMEOUT"
    PREEMPTED = "PREEMPTED"
    REQUEUED = "REQUEUED"
    NODE_FAIL = "NODE_FAIL"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    SUSPENDED = "SUSPENDED"
    UNKNOWN = "UNKNOWN"

    @property
    def is_terminal(self) -> bool:
        """True when the job will not run again by itself (REQUEUED and PREEMPTED are not final)."""
        return self in _TERMINAL

    @property
    def is_active(self) -> bool:
        """True while the job waits, runs, or is winding down."""
        return self in _ACTIVE


_TERMINAL = frozenset(
    {
        JobState.COMPLETED,
        JobState.FAILED,
        JobState.CANCELLED,
        JobState.TIMEOUT,
        JobState.NODE_FAIL,
        JobState.OUT_OF_MEMORY,
    }
)
_ACTIVE = frozenset({JobState.PENDING, JobState.RUNNING, JobState.COMPLETING, JobState.SUSPENDED, JobState.REQUEUED})

# Every base state of Slurm 22.05 (long name and squeue's %t code) and what it means for a caller.
_RAW: dict[str, JobState] = {
    "PENDING": JobState.PENDING,
    "PD": JobState.PENDING,
    "CONFIGURING": JobState.PENDING,  # nodes still booting: user code not started
    "CF": JobState.PENDING,
    "RESV_DEL_HOLD": JobState.PENDING,
    "RD": JobState.PENDING,
    "RUNNING": JobState.RUNNING,
    "R": JobState.RUNNING,
    "RESIZING": JobState.RUNNING,
    "RS": JobState.RUNNING,
    "SIGNALING": JobState.RUNNING,
    "SI": JobState.RUNNING,
    "COMPLETING": JobState.COMPLETING,
    "CG": JobState.COMPLETING,
    "STAGE_OUT": JobState.COMPLETING,
    "SO": JobState.COMPLETING,
    "COMPLETED": JobState.COMPLETED,
    "CD": JobState.COMPLETED,
    "FAILED": JobState.FAILED,
    "F": JobState.FAILED,
    "CANCELLED": JobState.CANCELLED,
    "CA": JobState.CANCELLED,
    "REVOKED": JobState.CANCELLED,  # a federated sibling ran it instead
    "RV": JobState.CANCELLED,
    "TIMEOUT": JobState.TIMEOUT,
    "TO": JobState.TIMEOUT,
    "DEADLINE": JobState.TIMEOUT,
    "DL": JobState.TIMEOUT,
    "PREEMPTED": JobState.PREEMPTED,
    "PR": JobState.PREEMPTED,
    "REQUEUED": JobState.REQUEUED,
    "RQ": JobState.REQUEUED,
    "REQUEUE_HOLD": JobState.REQUEUED,
    "RH": JobState.REQUEUED,
    "REQUEUE_FED": JobState.REQUEUED,
    "RF": JobState.REQUEUED,
    "SPECIAL_EXIT": JobState.REQUEUED,  # requeued and held after a special exit code
    "SE": JobState.REQUEUED,
    "NODE_FAIL": JobState.NODE_FAIL,
    "NF": JobState.NODE_FAIL,
    "BOOT_FAIL": JobState.NODE_FAIL,
    "BF": JobState.NODE_FAIL,
    "OUT_OF_MEMORY": JobState.OUT_OF_MEMORY,
    "OOM": JobState.OUT_OF_MEMORY,
    "SUSPENDED": JobState.SUSPENDED,
    "S": JobState.SUSPENDED,
    "STOPPED": JobState.SUSPENDED,
    "ST": JobState.SUSPENDED,
}


def parse_state(raw: str) -> JobState:
    """Map a state string from squeue, sacct or scontrol onto :class:`JobState`.

    Accepts long names (``RUNNING``), squeue's short codes (``R``), sacct's decorations
    (``CANCELLED by 0``, a truncated ``CANCELLED+``) and flag suffixes (``COMPLETING+``,
    ``RUNNING,REQUEUE_HOLD``: the first word wins). Anything unrecognised is
    :attr:`JobState.UNKNOWN` rather than an error, so a newer Slurm cannot break status polling.
    """
    text = raw.strip().upper()
    if not text:
        return JobState.UNKNOWN
    word = text.split()[0].split(",")[0].rstrip("+*")
    return _RAW.get(word, JobState.UNKNOWN)


#: Why a job waits, in words (Slurm's pending reasons users meet most; ``{id}`` is the job id).
PENDING_REASONS: dict[str, str] = {
    "JobHeldUser": "held by its owner; `scontrol release {id}` lets it run",
    "JobHeldAdmin": "held by an administrator; ask them to release it",
    "Dependency": "waits until the jobs it depends on have ended",
    "DependencyNeverSatisfied": "a job it depends on did not end as required, so it will never start; cancel it",
    "BeginTime": "waits for its begin time (sbatch --begin)",
    "Resources": "waits for free nodes",
    "Priority": "waits behind jobs with a higher priority",
    "ReqNodeNotAvail": "a node it needs is down, drained or reserved",
    "PartitionNodeLimit": "asks for more nodes than the partition allows; it will not start",
    "PartitionTimeLimit": "asks for more time than the partition allows; it will not start",
    "QOSMaxJobsPerUserLimit": "waits: you have as many jobs running as your QOS allows",
    "AssocMaxJobsLimit": "waits: your account has as many jobs running as it may",
    "None": "just submitted; the scheduler has not looked at it yet",
}


def explain_state(job_id: str, state: JobState, reason: str, restart_count: int | None = None) -> str | None:
    """One line saying why a job that has not started waits (pure), or None when it is not waiting.

    ``job 44 is PENDING (JobHeldUser): held by its owner; `scontrol release 44` lets it run``.
    A requeued job says so: Slurm holds it (reason ``BeginTime``) for a short while before it
    starts again from its checkpoint.
    """
    if state not in (JobState.PENDING, JobState.REQUEUED, JobState.SUSPENDED):
        return None
    head = f"job {job_id} is {state.value}" + (f" ({reason})" if reason else "")
    if state is JobState.SUSPENDED:
        return f"{head}: suspended by the scheduler; it resumes where it stopped"
    if restart_count or state is JobState.REQUEUED:
        times = f"{restart_count} time(s)" if restart_count else "again"
        held = " and held; `scontrol release {id}` lets it run"
        why = {"BeginTime": "; Slurm holds a requeued job until its begin time, a short delay after the requeue",
               "JobHeldUser": " and held by its owner; `scontrol release {id}` lets it run",
               "job requeued in held state": held, "job_requeued_in_held_state": held,
               "JobHeldAdmin": " and held by an administrator"}.get(reason)
        if why is None:
            why = f"; {PENDING_REASONS[reason]}" if reason in PENDING_REASONS else ""
        return f"{head}: requeued {times}{why.format(id=job_id)}; it then resumes from its last checkpoint"
    why = PENDING_REASONS.get(reason or "None")
    return f"{head}: {why.format(id=job_id)}" if why else head
