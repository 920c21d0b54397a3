"""The submitit backend: submit the training entry point as a pickled Python callable.

``--backend submitit`` hands :func:`train` (which calls
:func:`cyclone_kit.runtime.__main__.run_training` on the run directory) to submitit:

* ``executor="slurm"``: :class:`submitit.SlurmExecutor` writes its own sbatch script (nodes,
  tasks per node, CPUs per task, GPUs, time, partition, account, signal) and starts one task per
  rank with ``srun``; every task unpickles the callable and finds its rank in the Slurm
  variables srun set (the runtime reports launcher ``submitit``).
* ``executor="local"``: :class:`submitit.LocalExecutor` starts the ranks as local processes
  (one node only; they see ``SUBMITIT_LOCAL_*`` variables and the MASTER_ADDR/MASTER_PORT set
  here). The run happens in the foreground: submitit cancels a local job when its handle is
  garbage-collected, so returning early would kill it.
* ``executor="auto"`` (the default): Slurm where ``sbatch`` is on PATH, else local. The
  environment variable ``CYCLONE_SUBMITIT_EXECUTOR`` (``slurm``/``local``) overrides ``auto``,
  e.g. ``CYCLONE_SUBMITIT_EXECUTOR=local cyclone-kit submit --backend submitit ...``.

submitit keeps its pickles and per-task logs in ``RUN_DIR/submitit``; the runtime writes the
same ``metrics.jsonl`` as with the other backends.

What its batch script holds (``submit --backend submitit --dry-run`` prints it: the text of
:meth:`SubmititBackend.plan`, submitit's own renderer on the very keywords :meth:`SubmititBackend.schedule`
hands the executor, so it is what submitit writes; the local executor writes none, and its plan's
text is its keywords, the ranks' variables and the command, as JSON): the profile's set-up,
the run directory, threads and malloc settings, and the same rendezvous as the sbatch templates (the
first host and a port derived from the job id that is free on it, :func:`rendezvous_lines`). What it
lacks, and says in a comment line of that script (:data:`NO_STEP_WATCHER`): submitit writes the
``srun`` line itself, so no step watcher runs around it; a node whose processes die is then found only
when its peers' collective times out, and a stalled step ends the job instead of requeuing it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import shutil
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from cyclone_kit.backends.base import Finished, JobHandle, log_files
from cyclone_kit.backends.plan import SubmissionPlan, run_dir_files
from cyclone_kit.backends.slurm import SlurmBackend
from cyclone_kit.core.errors import CycloneError, RankFailure, SlurmError, ValidationError
from cyclone_kit.core.malloc import GLIBC_TUNABLES
from cyclone_kit.core.ports import PORT_BASE, PORT_SPAN
from cyclone_kit.rundir.layout import SUBMITIT_DIR, RunDir
from cyclone_kit.slurm import argv as slurm_argv

if TYPE_CHECKING:
    from cyclone_kit.config.validate import ResolvedJob
    from cyclone_kit.slurm.parse import JobInfo

EXECUTORS = ("auto", "slurm", "local")
#: The comment line a submitit batch script carries about the protection it lacks.
NO_STEP_WATCHER = ("# cyclone_kit: submitit writes the srun line itself, so no step watcher runs around it: a node "
                   "whose processes die is found only when its peers' collective times out, and a stalled step "
                   "ends the job instead of requeuing it (--backend slurm has both)")


def train(run_dir: str) -> int:
    """The callable submitit runs on every rank: train the run directory's ``spec.json``.

    A failure (an exception, or a non-zero status) leaves ``failure.json`` in the run directory
    (first writer wins; :func:`cyclone_kit.rundir.failures.record_rank_failure`).

    Raises:
        RankFailure: training returned a non-zero status (so the Slurm task, and the job, fail).
    """
    from cyclone_kit.runtime.__main__ import run_training

    try:
        code = int(run_training(Path(run_dir)) or 0)
    except BaseException as e:
        _record_failure(Path(run_dir), 1, e)
        raise
    if code:
        rank = os.environ.get("SLURM_PROCID") or os.environ.get("SUBMITIT_LOCAL_GLOBALID") or "0"
        _record_failure(Path(run_dir), code, None)
        raise RankFailure(f"training exited {code} on rank {rank}", hint=f"see {Path(run_dir) / 'logs'} and "
                          f"{Path(run_dir) / 'submitit'}")
    return code


def _record_failure(run_dir: Path, code: int, error: BaseException | None) -> None:
    """This rank's error record (unless the runtime wrote one) and ``failure.json`` (first writer wins)."""
    import traceback

    from cyclone_kit.rundir import failures

    rank, host = failures.rank_guess(os.environ), failures.host_guess(os.environ)
    with contextlib.suppress(OSError):
        if error is not None and failures.read_error_record(run_dir, rank) is None:
            failures.write_error_record(run_dir, rank, host, error, traceback.format_exc())
        fallback = failures.death_record(rank, host, os.getpid(), code, failures.utc_now(),
                                         os.environ.get("SLURM_JOB_ID"))
        failures.record_rank_failure(run_dir, rank, written_by="submitit", job_id=os.environ.get("SLURM_JOB_ID"),
                                     exit_code=code, fallback=fallback)


def rendezvous_lines(python: str) -> list[str]:
    """The batch script's rendezvous, as in templates/base.sbatch.j2 (pure): the allocation's first host,
    and a port derived from the job id that is free there (:mod:`cyclone_kit.core.ports`) unless
    MASTER_PORT was exported before submitting."""
    py = shlex.quote(python)
    return [
        'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)"',
        "export MASTER_ADDR",
        f'if [ -z "${{MASTER_PORT:-}}" ]; then MASTER_PORT="$({py} -m cyclone_kit.core.ports {PORT_BASE} {PORT_SPAN} '
        f'"$SLURM_JOB_ID" 2>/dev/null)" || MASTER_PORT=$(( {PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN} )); fi',
        "export MASTER_PORT",
        'echo "cyclone_kit: job ${SLURM_JOB_ID} on ${SLURM_JOB_NODELIST} master ${MASTER_ADDR}:${MASTER_PORT} '
        'restart ${SLURM_RESTART_COUNT:-0}"',
    ]


def slurm_parameters(job: ResolvedJob, run_dir: Path | str, python: str | None = None) -> dict[str, Any]:
    """``SlurmExecutor.update_parameters`` keywords for a resolved job (pure).

    The checkpoint signal and requeue flag of the spec are carried over, the profile's modules,
    environment and setup lines become submitit ``setup`` lines (values shell-quoted), followed by
    the rendezvous of :func:`rendezvous_lines` (``python`` runs the port check; default this
    interpreter) and the :data:`NO_STEP_WATCHER` comment, and srun is told ``--cpus-per-task``
    (since Slurm 22.05 srun no longer inherits it from sbatch).
    """
    spec, prof = job.spec, job.profile
    ck = spec.checkpoint
    setup: list[str] = []
    if prof.modules:
        setup.append("module purge")
        setup += [f"module load {shlex.quote(m)}" for m in prof.modules]
    setup += [f"export {k}={shlex.quote(v)}" for k, v in prof.env]
    setup += list(prof.setup)
    setup += [
        f"export CYCLONE_RUN_DIR={shlex.quote(str(run_dir))}",
        f"export OMP_NUM_THREADS={int(job.cpus_per_task)}",
        f'export GLIBC_TUNABLES="${{GLIBC_TUNABLES-{GLIBC_TUNABLES}}}"',
        f"export SUBMITIT_PREEMPT_SIGNAL={shlex.quote(ck.signal)}",
        *rendezvous_lines(python or sys.executable),
        NO_STEP_WATCHER,
    ]
    extra: dict[str, Any] = {"signal": f"{ck.signal}@{ck.signal_lead_s}"}
    if ck.requeue:
        extra["requeue"] = True
    if spec.resources.mem:
        extra["mem"] = spec.resources.mem
    params: dict[str, Any] = {
        "job_name": spec.name,
        "nodes": job.nodes,
        "ntasks_per_node": job.ntasks_per_node,
        "cpus_per_task": job.cpus_per_task,
        "time": max(1, math.ceil(job.time_s / 60)),
        "partition": job.partition.name,
        "signal_delay_s": ck.signal_lead_s,
        "setup": setup,
        "srun_args": [*prof.srun_binding, "--cpus-per-task", str(job.cpus_per_task)],
        "additional_parameters": extra,
        "stderr_to_stdout": False,
    }
    if job.gpus_per_node:
        if prof.gpu_request == "gres":
            params["gres"] = f"gpu:{job.gpus_per_node}"
        else:
            params["gpus_per_node"] = job.gpus_per_node
    if job.account:
        params["account"] = job.account
    if spec.resources.exclusive:
        params["exclusive"] = True
    return params


def submitit_command(python: str, folder: Path) -> str:
    """The command submitit's batch script runs on every task (``SlurmExecutor._submitit_command_str``)."""
    return " ".join([python, "-u -m submitit.core._submit", shlex.quote(str(folder))])


def sbatch_text(job: ResolvedJob, run_dir: Path | str, python: str | None = None) -> str:
    """The batch script submitit writes for ``job`` in ``run_dir``: submitit's own renderer on
    :func:`slurm_parameters` (what ``submit --backend submitit --dry-run`` prints)."""
    py = python or sys.executable
    folder = submitit_folder(run_dir)
    return submitit_sbatch(submitit_command(shlex.quote(py), folder), folder,
                           slurm_parameters(job, Path(run_dir).absolute(), python=py))


def submitit_folder(run_dir: Path | str) -> Path:
    """Where submitit keeps its pickles, task logs and batch script for ``run_dir``."""
    return Path(RunDir(Path(run_dir).absolute()).submitit).expanduser().absolute()


def submitit_sbatch(command: str, folder: Path, parameters: Mapping[str, Any]) -> str:
    """submitit's own renderer (what ``SlurmExecutor`` writes as ``<job id>_submission.sh``) on ``parameters``."""
    from submitit.slurm.slurm import _make_sbatch_string

    return _make_sbatch_string(command=command, folder=folder, **parameters)


def local_environment(job: ResolvedJob, run_dir: Path | str, master_port: str) -> dict[str, str]:
    """The variables submitit's local executor hands its ranks (pure; ``master_port``: a port or a placeholder)."""
    from cyclone_kit.backends.local_env import available_cores, threads_per_rank

    threads = str(threads_per_rank(job.world_size, available_cores()))
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": master_port,
        "OMP_NUM_THREADS": threads,
        "TORCHINDUCTOR_COMPILE_THREADS": threads,  # torch.compile's workers: the rank's share too (launchers/local.py)
        "CYCLONE_RUN_DIR": str(Path(run_dir).absolute()),
        "PYTHONUNBUFFERED": "1",
    }


def local_parameters(job: ResolvedJob, timeout_min: float | None = None) -> dict[str, Any]:
    """``LocalExecutor.update_parameters`` keywords for a resolved job (pure).

    Raises:
        ValidationError: the job spans several nodes (submitit's local executor has one).
    """
    if job.nodes != 1:
        raise ValidationError(
            f"submitit's local executor runs on one node, but the job asks for --nodes={job.nodes}",
            hint="use --nodes 1, --backend local (pretend nodes), or run where Slurm is (sbatch on PATH)",
        )
    return {
        "tasks_per_node": job.ntasks_per_node,
        "timeout_min": timeout_min if timeout_min is not None else max(1.0, job.time_s / 60),
        "signal_delay_s": job.spec.checkpoint.signal_lead_s,
        "gpus_per_node": job.gpus_per_node,
    }


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    """Set ``values`` in os.environ and drop an enclosing launcher's variables; restore afterwards.

    submitit's local executor copies os.environ into the job when it starts it.
    """
    from cyclone_kit.backends.local_env import clean_environment

    saved = dict(os.environ)
    try:
        cleaned = clean_environment(os.environ)
        os.environ.clear()
        os.environ.update({**cleaned, **values})
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


class SubmititBackend:
    """Submit jobs as Python callables through submitit (Slurm or local executor).

    Args:
        executor: ``"auto"`` (Slurm when ``sbatch`` is on PATH, else local), ``"slurm"`` or ``"local"``.
        python: the interpreter the job runs (default: this one).
        wait: wait for Slurm jobs to finish before :meth:`submit_run` returns (local jobs always do).
    """

    name = "submitit"
    batch_script = False  # submitit writes its own batch script (its plan's text), not the templates' one

    def __init__(self, *, executor: str = "auto", python: str | None = None, wait: bool = False) -> None:
        if executor not in EXECUTORS:
            raise ValidationError(f"unknown submitit executor {executor!r}", hint=f"use one of: {', '.join(EXECUTORS)}")
        self.executor = executor
        self.python = python
        self.wait = wait
        self.jobs: dict[str, Any] = {}

    def chosen_executor(self) -> str:
        """``slurm`` or ``local``: what ``auto`` means on this machine."""
        if self.executor != "auto":
            return self.executor
        forced = os.environ.get("CYCLONE_SUBMITIT_EXECUTOR", "").strip()
        if forced:
            if forced not in ("slurm", "local"):
                raise ValidationError(f"CYCLONE_SUBMITIT_EXECUTOR={forced!r} is not an executor",
                                      hint="set it to slurm or local (or unset it)")
            return forced
        return "slurm" if shutil.which("sbatch") else "local"

    @property
    def foreground(self) -> bool:
        """The local executor runs the job here and returns when it has ended; Slurm's queues it."""
        return self.chosen_executor() == "local"

    def for_study(self) -> SubmititBackend:
        """A study's points run as any job does: this backend."""
        return self

    def run_here(self, plan: SubmissionPlan, *, echo: IO[str] | None = None) -> Finished:
        """Run ``plan`` on the local executor until it ends (:meth:`schedule`), record it; how it went (a
        failure: submitit's error; Ctrl-C cancels the job and says ``interrupted``). Its ranks' output
        goes to submitit's task logs, not to ``echo``.

        Raises:
            ValidationError: the plan is for Slurm's executor (it runs in the queue).
        """
        if plan.parameters.get("executor") != "local":
            raise ValidationError("a job on submitit's Slurm executor runs in Slurm's queue, not in the foreground",
                                  hint="schedule it (submit), or set CYCLONE_SUBMITIT_EXECUTOR=local")
        rd = RunDir(plan.run_dir)
        start = time.monotonic()
        ok, interrupted, report = False, False, ""
        try:
            job_id = self.schedule(plan).job_id
            ok = True
        except CycloneError as e:
            job_id = rd.submitit_job_id() or ""
            report = f"error: {e}"
        except KeyboardInterrupt:  # _run_local cancelled the job
            job_id = rd.submitit_job_id() or ""
            interrupted = True
        rd.write_backend(self.name)
        if job_id:
            rd.write_job_id(job_id)
        return Finished(job_id, ok, time.monotonic() - start, interrupted, report)

    def plan(self, job: ResolvedJob, run_dir: Path, *, script: str | None = None, after: Sequence[str] = (),
             dependency: str | None = None) -> SubmissionPlan:
        """``job``'s plan in ``run_dir`` (pure): ``spec.json`` and a user script's copy; the executor (see
        :meth:`chosen_executor`) and its ``update_parameters`` keywords; the command every task runs.

        Slurm's executor: what a dry run prints is the batch script submitit writes from those same
        keywords (:func:`submitit_sbatch`). The local executor writes none: the dry run prints its
        keywords, the variables the ranks get and the command, as JSON. ``after``: job ids this job
        waits for (``afterany``); ``dependency``: a raw sbatch dependency such as ``afterok:123`` instead.
        ``script`` (the templates' batch script) is not used: submitit writes its own.

        Raises:
            ValidationError: both ``after`` and ``dependency``; a dependency on the local executor; a
                multi-node job on the local executor.
        """
        from cyclone_kit.backends.local import AT_LAUNCH_PORT

        run_dir = Path(run_dir).absolute()
        if after:
            if dependency:
                raise ValidationError("give after= or dependency=, not both", hint="use after=[job ids]")
            dependency = slurm_argv.dependency(after)
        executor = self.chosen_executor()
        py = self.python or sys.executable
        folder = submitit_folder(run_dir)
        command = submitit_command(shlex.quote(py), folder)
        env: dict[str, str] = {}
        if executor == "slurm":
            params = slurm_parameters(job, run_dir, python=py)
            if dependency:
                params["dependency"] = dependency
            text = submitit_sbatch(command, folder, params)
        else:
            if dependency:
                raise ValidationError("submitit's local executor runs in the foreground and cannot wait for other "
                                      "jobs", hint="drop the dependency, or submit to Slurm")
            params = local_parameters(job)
            env = local_environment(job, run_dir, AT_LAUNCH_PORT)
            text = json.dumps({"executor": executor, "parameters": params, "environment": env, "command": command},
                              indent=2) + "\n"
        return SubmissionPlan(self.name, run_dir, job, run_dir_files(job), text, (tuple(shlex.split(command)),),
                              parameters={"executor": executor, **params}, environment=env, after=tuple(after),
                              text_at=f"{SUBMITIT_DIR}/<job id>_submission.sh (written by submitit)" if executor == "slurm"
                              else f"{SUBMITIT_DIR}/ (submitit's local executor writes no batch script)",
                              summary=f"{job.world_size} rank(s) via submitit ({executor} executor)")

    def schedule(self, plan: SubmissionPlan) -> JobHandle:
        """Hand the plan's keywords and :func:`train` to its executor (the plan's files written); returns the
        Slurm job id (or, once it has ended, the local controller's pid).

        Raises:
            SlurmError: submitit could not submit to Slurm (sbatch missing or refusing).
            RankFailure: a local run failed (the message quotes submitit's error).
        """
        params = dict(plan.parameters)
        executor = params.pop("executor")
        if executor == "slurm":
            job_id = self._submit_slurm(plan.run_dir, params)
        else:
            job_id = self._run_local(plan.run_dir, params, plan.environment)
        return JobHandle(job_id, self.name, plan.run_dir)

    def submit_run(self, job: ResolvedJob, run_dir: Path, *, after: Sequence[str] = (),
                   dependency: str | None = None) -> JobHandle:
        """Submit ``job`` for the prepared ``run_dir`` (:meth:`schedule` of :meth:`plan`).

        Raises:
            as :meth:`plan` and :meth:`schedule`.
        """
        return self.schedule(self.plan(job, run_dir, after=after, dependency=dependency))

    def _executor_python(self) -> str:
        """The interpreter submitit starts, quoted for its command line."""
        return shlex.quote(self.python or sys.executable)

    def _submit_slurm(self, run_dir: Path, params: Mapping[str, Any]) -> str:
        import submitit

        try:
            ex = submitit.SlurmExecutor(folder=submitit_folder(run_dir), python=self._executor_python())
            ex.update_parameters(**params)
            handle = ex.submit(train, str(run_dir))
        except RuntimeError as e:  # "Could not detect srun", sbatch failures (FailedJobError is one)
            raise SlurmError(f"submitit could not submit to Slurm: {' '.join(str(e).split())[:400]}",
                             hint="check that Slurm is reachable (sinfo) or use --backend local") from None
        job_id = str(handle.job_id)
        self.jobs[job_id] = handle
        RunDir(run_dir).write_submitit_job_id(job_id)
        RunDir(run_dir).write_submission(job_id, self.name)
        if self.wait:
            handle.wait()
        return job_id

    def _run_local(self, run_dir: Path, params: Mapping[str, Any], environment: Mapping[str, str]) -> str:
        import submitit

        from cyclone_kit.backends.local import AT_LAUNCH_PORT
        from cyclone_kit.backends.local_env import free_port

        folder = submitit_folder(run_dir)
        env = {k: str(free_port()) if v == AT_LAUNCH_PORT else v for k, v in environment.items()}
        ex = submitit.LocalExecutor(folder=folder, python=self._executor_python())
        ex.update_parameters(**params)
        with _environment(env):
            handle = ex.submit(train, str(run_dir))
        job_id = str(handle.job_id)
        self.jobs[job_id] = handle
        RunDir(run_dir).write_submitit_job_id(job_id)
        RunDir(run_dir).write_submission(job_id, self.name)
        try:
            handle.wait()
            error = handle.exception()
        except KeyboardInterrupt:
            handle.cancel()
            raise
        if error is not None:
            lines = [line for line in str(error).splitlines() if line.strip()]
            raise RankFailure(
                f"submitit local job {job_id} failed: {lines[-1] if lines else type(error).__name__}",
                hint=f"see the task logs in {folder}",
            )
        return job_id

    def status(self, job: str) -> JobInfo:
        """The job's state: Slurm's view for a Slurm job; for a local one (finished when
        :meth:`submit_run` returned), what its run directory says."""
        if self.chosen_executor() == "local":
            from cyclone_kit.backends.local import run_dir_status

            return run_dir_status(str(job), getattr(job, "run_dir", None))
        return SlurmBackend().status(str(job))

    def status_many(self, jobs: Sequence[str]) -> dict[str, JobInfo]:
        """:meth:`status` of each job; Slurm's jobs in one squeue (and one sacct) call."""
        if self.chosen_executor() == "local":
            return {str(j): self.status(j) for j in jobs}
        return SlurmBackend().status_many([str(j) for j in jobs])

    def cancel(self, job: str) -> None:
        """Cancel a Slurm job (``scancel``); a local one has finished already.

        Raises:
            ValidationError: a local job (it ran in the foreground).
            SlurmError: as :meth:`cyclone_kit.backends.slurm.SlurmBackend.cancel`.
        """
        if self.chosen_executor() == "local":
            raise ValidationError(f"submitit local job {job} ran in the foreground and has finished",
                                  hint="stop a local run with Ctrl-C while it runs")
        SlurmBackend().cancel(str(job))

    def log_files(self, job: JobHandle) -> list[Path]:
        """The run's ``logs/`` plus submitit's own task logs (``submitit/*.out``, ``*.err``)."""
        if job.run_dir is None:
            return []
        folder = RunDir(job.run_dir).submitit
        own = sorted(p for p in folder.glob("*_log.*") if p.is_file()) if folder.is_dir() else []
        return log_files(job) + own

    def job_state(self, job_id: str) -> str:
        """submitit's view of a job submitted by this backend object (``RUNNING``, ``COMPLETED`` ...)."""
        handle = self.jobs.get(job_id)
        if handle is None:
            raise ValidationError(f"job {job_id} was not submitted by this backend object",
                                  hint="use `cyclone-kit status JOBID`")
        return str(handle.state)

    def wait_for(self, job_id: str) -> str:
        """Block until a job submitted by this backend object ends; returns its final state."""
        handle = self.jobs[job_id]
        handle.wait()
        return str(handle.state)
