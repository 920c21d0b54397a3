"""The Slurm backend: sbatch / squeue / sacct / scontrol / scancel on the machine it runs on.

Commands are built by :mod:`cyclone_kit.slurm.argv`, run by :func:`cyclone_kit.core.proc.run_command`
and read by :mod:`cyclone_kit.slurm.parse`; this module only decides which to run and turns
failures into :class:`~cyclone_kit.core.errors.SlurmError` with a HINT.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING

from cyclone_kit.backends.base import Finished, JobHandle, log_files
from cyclone_kit.backends.plan import SubmissionPlan, run_dir_files
from cyclone_kit.core.errors import SlurmError, ValidationError
from cyclone_kit.core.proc import CompletedCommand, run_command
from cyclone_kit.rundir.layout import SCRIPT_FILE, RunDir
from cyclone_kit.slurm import argv as slurm_argv
from cyclone_kit.slurm.parse import (
    JobInfo,
    parse_sacct,
    parse_sbatch_parsable,
    parse_scontrol_job,
    parse_squeue,
    select_job,
)

if TYPE_CHECKING:
    from cyclone_kit.config.validate import ResolvedJob

_INVALID_ID = "Invalid job id specified"
_NO_ACCOUNTING = "accounting storage is disabled"
_CONTROLLER_HINT = "is Slurm up? check with `sinfo` (for the local test cluster: scripts/local-slurm.sh status)"


def _first_line(text: str) -> str:
    """The first non-empty line of a command's output, for error messages."""
    return next((line.strip() for line in text.splitlines() if line.strip()), "no output")


def _sbatch_hint(stderr: str) -> str:
    """The fix for the sbatch rejections users meet most."""
    low = stderr.lower()
    if "invalid partition" in low:
        return "use a partition that `sinfo -s` lists (e.g. cpu or gpu)"
    if "node configuration is not available" in low or "node count specification invalid" in low:
        return "ask for no more nodes, CPUs, memory or GPUs per node than the partition has (see `sinfo -N -l`)"
    if "invalid account" in low:
        return "pass an account you belong to (`sacctmgr show assoc user=$USER`)"
    if "time limit" in low:
        return "lower --time to the partition's MaxTime (`sinfo -o '%P %l'`)"
    if "unable to contact slurm controller" in low:
        return _CONTROLLER_HINT
    return "fix the #SBATCH option the message names and submit again"


def sbatch_argv(script: Path, after: Sequence[str] = ()) -> list[str]:
    """``sbatch --parsable [--dependency=afterany:...] SCRIPT`` (pure)."""
    return slurm_argv.sbatch(script, [f"--dependency={slurm_argv.dependency(after)}"] if after else [])


class SlurmBackend:
    """Submit, inspect, cancel and requeue batch jobs with Slurm's own commands.

    Args:
        timeout: seconds any single Slurm command may take.
    """

    name = "slurm"
    batch_script = True
    foreground = False  # its jobs wait in Slurm's queue

    def __init__(self, *, timeout: float = 30) -> None:
        self.timeout = timeout

    def for_study(self) -> SlurmBackend:
        """A study's points are submitted as any job is: this backend."""
        return self

    def run_here(self, plan: SubmissionPlan, *, echo: IO[str] | None = None) -> Finished:
        """A Slurm job runs in the queue, not here.

        Raises:
            ValidationError: always (use :meth:`schedule`).
        """
        raise ValidationError("a Slurm job runs in Slurm's queue, not in the foreground", hint="schedule it (submit)")

    def _run(self, argv: Sequence[str], cwd: Path | None = None) -> CompletedCommand:
        """Run a Slurm command without raising on a non-zero exit."""
        return run_command(argv, timeout=self.timeout, check=False, cwd=cwd)

    def submit(self, script_path: Path, run_dir: Path, *, after: Sequence[str] = (), cwd: Path | None = None) -> str:
        """Submit ``script_path`` with ``sbatch --parsable`` from ``cwd`` (default ``run_dir``); return the job id.

        ``cwd`` is the job's ``SLURM_SUBMIT_DIR`` (a script job's working directory, which its
        batch script also ``cd``s into). The rendered ``#SBATCH --output`` paths are absolute.
        ``after``: job ids the job waits for (``sbatch --dependency=afterany:ID:ID``). A job's own
        batch script goes through :meth:`plan` and :meth:`schedule`; this is for others (a study's report).

        Raises:
            ValidationError: the script or the run directory does not exist.
            SlurmError: sbatch rejected the job (the message quotes sbatch's reason).
        """
        return self._sbatch(sbatch_argv(Path(script_path).resolve(), after), Path(script_path), Path(run_dir),
                            Path(cwd) if cwd else Path(run_dir))

    def _sbatch(self, argv: Sequence[str], script: Path, run_dir: Path, cwd: Path) -> str:
        """Run ``argv`` (an ``sbatch --parsable`` line for ``script``) from ``cwd``; the job id."""
        if not script.is_file():
            raise ValidationError(f"batch script {script} does not exist", hint="render the job before submitting it")
        if not run_dir.is_dir():
            raise ValidationError(f"run directory {run_dir} does not exist", hint="create it before submitting")
        result = self._run(argv, cwd=cwd)
        if not result.ok:
            raise SlurmError(
                f"sbatch rejected {script}: {_first_line(result.stderr or result.stdout)}",
                hint=_sbatch_hint(result.stderr),
            )
        return parse_sbatch_parsable(result.stdout)

    def plan(self, job: ResolvedJob, run_dir: Path, *, script: str | None = None,
             after: Sequence[str] = ()) -> SubmissionPlan:
        """``job``'s plan in ``run_dir`` (pure): ``spec.json``, a user script's copy and ``script`` (the
        rendered batch script, what a dry run prints) as ``job.sbatch``; the ``sbatch`` line that submits
        it from the job's working directory (a script's ``chdir``, else the run directory).

        Raises:
            ValidationError: no batch script was given.
        """
        if script is None:
            raise ValidationError("the slurm backend submits a rendered batch script, and none was given",
                                  hint="plan it through cyclone_kit.submit.submission.plan_submission")
        rd = RunDir(Path(run_dir).absolute())
        chdir = job.spec.script.chdir if job.spec.script is not None else None
        return SubmissionPlan(self.name, rd.path, job, {**run_dir_files(job), SCRIPT_FILE: script}, script,
                              (tuple(sbatch_argv(rd.script.resolve(), after)),), cwd=Path(chdir) if chdir else rd.path,
                              after=tuple(after), text_at=SCRIPT_FILE)

    def schedule(self, plan: SubmissionPlan) -> JobHandle:
        """Run the plan's ``sbatch`` line (its batch script written) and record the submission.

        Raises:
            ValidationError: the batch script or the run directory does not exist.
            SlurmError: sbatch rejected the job.
        """
        rd = RunDir(plan.run_dir)
        job_id = self._sbatch(plan.commands[0], rd.script, rd.path, plan.cwd or rd.path)
        rd.write_submission(job_id, self.name)
        return JobHandle(job_id, self.name, rd.path)

    def submit_run(self, job: ResolvedJob, run_dir: Path, *, after: Sequence[str] = ()) -> JobHandle:
        """Submit a prepared run directory's ``job.sbatch`` (:meth:`schedule` of its :meth:`plan`)."""
        rd = RunDir(Path(run_dir).absolute())
        if not rd.script.is_file():
            raise ValidationError(f"batch script {rd.script} does not exist", hint="render the job before submitting it")
        return self.schedule(self.plan(job, rd.path, script=rd.script.read_text(), after=after))

    def log_files(self, job: JobHandle) -> list[Path]:
        """The job's ``logs/`` (``#SBATCH --output`` / ``--error`` point there)."""
        return log_files(job)

    def status(self, job_id: str) -> JobInfo:
        """The job's current :class:`JobInfo`.

        Asks squeue first (every job the controller still holds, finished ones for MinJobAge);
        for a job that left the controller, sacct; where accounting is disabled, ``scontrol
        show job``. For an array job's parent id the tasks are summarised (see
        :func:`~cyclone_kit.slurm.parse.select_job`).

        Raises:
            ValidationError: ``job_id`` is not a job id.
            SlurmError: no command knows the job, or Slurm cannot be reached.
        """
        job_id = slurm_argv.check_job_id(str(job_id))
        sources = (
            (slurm_argv.squeue, parse_squeue),
            (slurm_argv.sacct, parse_sacct),
            (slurm_argv.scontrol_show_job, parse_scontrol_job),
        )
        problems = []
        for build, parse in sources:
            argv = build(job_id)
            result = self._run(argv)
            if result.ok:
                info = select_job(job_id, parse(result.stdout))
                if info is not None:
                    return info
                continue
            err = result.stderr.strip()
            if _INVALID_ID in err or _NO_ACCOUNTING in err:
                continue  # this source does not know the job; ask the next one
            problems.append(f"{argv[0]}: {_first_line(err or result.stdout)}")
        if problems:
            raise SlurmError(f"cannot get the status of job {job_id}: {'; '.join(problems)}", hint=_CONTROLLER_HINT)
        raise SlurmError(
            f"job {job_id} not found",
            hint="check the id (squeue --me lists your jobs); finished jobs stay in the controller only "
            "MinJobAge seconds unless accounting (sacct) is enabled",
        )

    def status_many(self, job_ids: Sequence[str]) -> dict[str, JobInfo]:
        """The :class:`JobInfo` of every job Slurm knows among ``job_ids``, in two calls at most.

        One ``squeue`` for all of them (whatever the controller still holds), then one ``sacct``
        for those it no longer holds; a job neither knows is left out (the caller falls back to
        its run directory). The cost does not grow with the number of runs (``status --runs-dir``).

        Raises:
            ValidationError: an id is not a job id.
            SlurmError: Slurm cannot be reached (squeue fails for another reason than unknown ids).
        """
        ids = list(dict.fromkeys(slurm_argv.check_job_id(str(j)) for j in job_ids))
        found: dict[str, JobInfo] = {}
        for build, parse, needed in ((slurm_argv.squeue, parse_squeue, True), (slurm_argv.sacct, parse_sacct, False)):
            missing = [j for j in ids if j not in found]
            if not missing:
                break
            result = self._run(build(missing))
            err = result.stderr.strip()
            if not result.ok:
                if _INVALID_ID in err or (_NO_ACCOUNTING in err and not needed):
                    continue  # none of them known here (one unknown id alone makes squeue fail)
                raise SlurmError(f"cannot get the status of {len(missing)} job(s): "
                                 f"{build(missing)[0]}: {_first_line(err or result.stdout)}", hint=_CONTROLLER_HINT)
            records = parse(result.stdout)
            for job_id in missing:
                info = select_job(job_id, records)
                if info is not None:
                    found[job_id] = info
        return found

    def attempts(self, job_id: str) -> list[JobInfo]:
        """Every run of a requeued job, oldest first, as accounting recorded it (``sacct --duplicates``:
        REQUEUED, NODE_FAIL, PREEMPTED ..., then the last run's state).

        Raises:
            SlurmError: sacct fails (accounting disabled included).
        """
        argv = slurm_argv.sacct_attempts(slurm_argv.check_job_id(str(job_id)))
        result = self._run(argv)
        if not result.ok:
            raise SlurmError(f"sacct: {_first_line(result.stderr or result.stdout)}", hint=_CONTROLLER_HINT)
        return [j for j in parse_sacct(result.stdout) if j.job_id == str(job_id)]

    def cancel(self, job_id: str) -> None:
        """Cancel the job (all tasks of an array job when given the parent id).

        A job that already finished is left as it is. scancel exits 0 for ids it does not know,
        so the job is looked up first.

        Raises:
            SlurmError: the job does not exist, or scancel failed.
        """
        info = self.status(job_id)
        if info.state.is_terminal:
            return
        result = self._run(slurm_argv.scancel(info.job_id))
        if not result.ok:
            raise SlurmError(
                f"scancel {info.job_id} failed: {_first_line(result.stderr or result.stdout)}",
                hint="only the job's owner or an administrator may cancel it",
            )

    def requeue(self, job_id: str) -> None:
        """Put the job back in the queue (``scontrol requeue``); it restarts with SLURM_RESTART_COUNT+1.

        For an array task, pass ``ARRAYJOBID_TASKID`` (see :func:`cyclone_kit.slurm.env.requeue_target`).

        Raises:
            SlurmError: the job does not exist or Slurm refused to requeue it.
        """
        info = self.status(job_id)
        result = self._run(slurm_argv.scontrol_requeue(info.job_id))
        if not result.ok:
            raise SlurmError(
                f"scontrol requeue {info.job_id} refused: {_first_line(result.stderr or result.stdout)}",
                hint="only batch jobs submitted with requeue allowed (sbatch --requeue, the default "
                "unless JobRequeue=0) can be requeued, and only while Slurm still holds them",
            )

    def wait(
        self,
        job_id: str,
        *,
        until: Callable[[JobInfo], bool] = lambda info: info.state.is_terminal,
        timeout: float = 300,
        poll: float = 0.25,
    ) -> JobInfo:
        """Poll :meth:`status` until ``until(info)`` holds (default: the job finished); return that info.

        Raises:
            SlurmError: ``timeout`` seconds passed first (the message names the last state).
        """
        deadline = time.monotonic() + timeout
        while True:
            info = self.status(job_id)
            if until(info):
                return info
            if time.monotonic() >= deadline:
                raise SlurmError(
                    f"job {job_id} still {info.state.value} after {timeout:g} s"
                    + (f" (reason: {info.reason})" if info.reason else ""),
                    hint="see `scontrol show job " + job_id + "`; a PENDING reason names what it waits for",
                )
            time.sleep(poll)
