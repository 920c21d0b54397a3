"""The Slurm backend: sbatch / squeue / sacct / scontrol / scancel on the machine it runs on.

Commands are built by :mod:`cyclone_kit.slurm.argv`, run by :func:`cyclone_kit.core.proc.run_command`
and read by :mod:`cyclone_kit.slurm.parse`; this module only decides which to run and turns
failures into :class:`~cyclone_kit.core.errors.SlurmError` with a HINT.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

from cyclone_kit.backends.base import JobHandle, log_files
from cyclone_kit.core.errors import SlurmError, ValidationError
from cyclone_kit.core.proc import CompletedCommand, run_command
from cyclone_kit.rundir.layout import RunDir
from cyclone_kit.slurm import argv as slurm_argv
from cyclone_kit.slurm.parse import (
    JobInfo,
    parse_sacct,
    parse_sbatch_parsable,
    parse_scontrol_job,
    parse_squeue,
    select_job,
)

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


class SlurmBackend:
    """Submit, inspect, cancel and requeue batch jobs with Slurm's own commands.

    Args:
        timeout: seconds any single Slurm command may take.
    """

    name = "slurm"
    batch_script = True

    def __init__(self, *, timeout: float = 30) -> None:
        self.timeout = timeout

    def _run(self, argv: Sequence[str], cwd: Path | None = None) -> CompletedCommand:
        """Run a Slurm command without raising on a non-zero exit."""
        return run_command(argv, timeout=self.timeout, check=False, cwd=cwd)

    def submit(self, script_path: Path, run_dir: Path, *, after: Sequence[str] = (), cwd: Path | None = None) -> str:
        """Submit ``script_path`` with ``sbatch --parsable`` from ``cwd`` (default ``run_dir``); return the job id.

        ``cwd`` is the job's ``SLURM_SUBMIT_DIR`` (a script job's working directory, which its
        batch script also ``cd``s into). The rendered ``#SBATCH --output`` paths are absolute.
        ``after``: job ids the job waits for (``sbatch --dependency=afterany:ID:ID``).

        Raises:
            ValidationError: the script or the run directory does not exist.
            SlurmError: sbatch rejected the job (the message quotes sbatch's reason).
        """
        script = Path(script_path)
        run_dir = Path(run_dir)
        if not script.is_file():
            raise ValidationError(f"batch script {script} does not exist", hint="render the job before submitting it")
        if not run_dir.is_dir():
            raise ValidationError(f"run directory {run_dir} does not exist", hint="create it before submitting")
        extra = [f"--dependency={slurm_argv.dependency(after)}"] if after else []
        argv = slurm_argv.sbatch(script.resolve(), extra)
        result = self._run(argv, cwd=Path(cwd) if cwd else run_dir)
        if not result.ok:
            raise SlurmError(
                f"sbatch rejected {script}: {_first_line(result.stderr or result.stdout)}",
                hint=_sbatch_hint(result.stderr),
            )
        return parse_sbatch_parsable(result.stdout)

    def submit_run(self, job: object, run_dir: Path, *, after: Sequence[str] = ()) -> JobHandle:
        """Submit a prepared run directory's ``job.sbatch`` and record the submission in it."""
        rd = RunDir(run_dir)
        script = getattr(getattr(job, "spec", None), "script", None)
        workdir = Path(script.chdir) if script is not None and script.chdir else None
        job_id = self.submit(rd.script, rd.path, after=after, cwd=workdir)
        rd.write_submission(job_id, self.name)
        return JobHandle(job_id, self.name, rd.path)

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
