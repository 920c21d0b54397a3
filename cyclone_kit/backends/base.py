"""The Backend protocol: what every backend (slurm, submitit, local) implements, as a type.

A backend plans a resolved job in a run directory (:meth:`Backend.plan`: a
:class:`~cyclone_kit.backends.plan.SubmissionPlan`, pure) and runs that plan once the submit side
has written its files (:meth:`Backend.schedule`). Callers that come back later (``status``,
``cancel``, ``logs``) rebuild the :class:`JobHandle` from what the run directory recorded
(:func:`handle_of`) and dispatch on the backend named there, never on a hard-coded name.
Dependencies are an argument (``after``: job ids this one waits for, ``afterany``), never text
spliced into a rendered script. A backend says itself whether its jobs run here, in the foreground
(:attr:`Backend.foreground`), and how it runs a study's points (:meth:`Backend.for_study`,
:meth:`Backend.run_here`): a study never asks for a backend's name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Protocol, runtime_checkable

from cyclone_kit.rundir.layout import RunDir

if TYPE_CHECKING:
    from cyclone_kit.backends.plan import SubmissionPlan
    from cyclone_kit.config.validate import ResolvedJob
    from cyclone_kit.slurm.parse import JobInfo


class JobHandle(str):
    """A submitted job: its id (the string itself, so it prints and compares as the id), its
    backend's name and its run directory.

    Attributes:
        backend: the registered name of the backend that runs it.
        run_dir: the run directory (None where unknown, e.g. a bare id typed by the user).
    """

    backend: str
    run_dir: Path | None

    def __new__(cls, job_id: str, backend: str = "slurm", run_dir: Path | str | None = None) -> JobHandle:
        """Build a handle for ``job_id``."""
        obj = super().__new__(cls, str(job_id))
        obj.backend = backend
        obj.run_dir = None if run_dir is None else Path(run_dir)
        return obj

    @property
    def job_id(self) -> str:
        """The job id as a plain string."""
        return str.__str__(self)

    def __repr__(self) -> str:
        """``JobHandle('123', backend='slurm')``."""
        return f"JobHandle({self.job_id!r}, backend={self.backend!r})"


@dataclass(frozen=True)
class Finished:
    """How a job that ran here, in the foreground, ended (:meth:`Backend.run_here`).

    Attributes:
        job_id: its job id ('' when it never started).
        ok: every rank completed.
        wall_time_s: seconds it ran.
        interrupted: it was stopped by Ctrl-C (or SIGTERM) and its ranks were stopped with it.
        report: what went wrong, root cause first, for the user ('' when ``ok`` or ``interrupted``).
    """

    job_id: str
    ok: bool
    wall_time_s: float
    interrupted: bool = False
    report: str = ""


@runtime_checkable
class Backend(Protocol):
    """Plan a job and run that plan, ask its state, cancel it, find its logs."""

    name: str
    #: Whether its plan holds the batch script the templates render (``job.sbatch``, passed to
    #: :meth:`plan` as ``script``); submitit writes its own, the local launcher runs none.
    batch_script: bool

    @property
    def foreground(self) -> bool:
        """Whether its jobs run here, in the foreground: :meth:`schedule` returns once the job has ended
        (the local launcher; submitit's local executor). A study runs such points one after another with
        :meth:`run_here`, then its report here; the others' points are queued together."""
        ...

    def for_study(self) -> Backend:
        """This backend as it runs the points of a study (itself, or a copy with the settings a study's
        points share, e.g. the local launcher's threads per rank: each point's CPUs per task)."""
        ...

    def run_here(self, plan: SubmissionPlan, *, echo: IO[str] | None = None) -> Finished:
        """Run ``plan`` (its files written) here until it ends and record it in its run directory; a failed
        or interrupted run is said in the result, not raised. ``echo``: where rank 0's output goes (None:
        nowhere), where the backend shows it.

        Raises:
            ValidationError: the backend does not run jobs here (:attr:`foreground` is false).
        """
        ...

    def plan(self, job: ResolvedJob, run_dir: Path, *, script: str | None = None,
             after: Sequence[str] = ()) -> SubmissionPlan:
        """What this backend will do for ``job`` in ``run_dir`` (pure: writes and runs nothing).

        ``script``: the rendered batch script, given when :attr:`batch_script` is true; ``after``:
        job ids this job waits for (afterany).
        """
        ...

    def schedule(self, plan: SubmissionPlan) -> JobHandle:
        """Run ``plan`` (its files already written into its run directory) and record the
        submission there (job id and this backend's name)."""
        ...

    def submit_run(self, job: ResolvedJob, run_dir: Path, *, after: Sequence[str] = ()) -> JobHandle:
        """Run the resolved ``job`` already prepared in ``run_dir`` (its plan's files written):
        :meth:`schedule` of :meth:`plan`."""
        ...

    def status(self, job: str) -> JobInfo:
        """The job's state now (a :class:`~cyclone_kit.slurm.parse.JobInfo`)."""
        ...

    def status_many(self, jobs: Sequence[str]) -> dict[str, JobInfo]:
        """The state now of each job among ``jobs`` the backend knows (absent: unknown), asking the
        scheduler once for all of them where it can."""
        ...

    def cancel(self, job: str) -> None:
        """Stop the job (a finished job is left as it is)."""
        ...

    def log_files(self, job: JobHandle) -> list[Path]:
        """Every log file of the job, in a stable order."""
        ...


def log_files(job: JobHandle) -> list[Path]:
    """The files under the run directory's ``logs/`` (every backend writes its logs there)."""
    if job.run_dir is None:
        return []
    logs = RunDir(job.run_dir).logs
    return sorted(p for p in logs.glob("*") if p.is_file()) if logs.is_dir() else []


def handle_of(run_dir: Path | str) -> JobHandle | None:
    """The handle a run directory recorded at submission (None when it was never submitted).

    Run directories from before ``backend`` was recorded count as Slurm jobs.
    """
    rd = RunDir(Path(run_dir))
    job_id = rd.job_id()
    if not job_id:
        return None
    backend = rd.backend() or ("local" if job_id.startswith("local") else "slurm")
    return JobHandle(job_id, backend, rd.path)
