"""``--backend local``: run a job right here, in the foreground, through the srun emulator.

The backend (:class:`LocalBackend`: the Backend protocol), its launch plan (:class:`LocalPlan`: the
ranks' command, working folder and the variables the launcher sets on each, what ``submit
--backend local --dry-run`` prints as the :class:`~cyclone_kit.backends.plan.SubmissionPlan`'s text and
``launch.json`` records for the real run), what ``run``
builds for it (:func:`local_job`) and the status of a finished foreground run
(:func:`run_dir_status`). The processes themselves are
:mod:`cyclone_kit.backends.srun_emulator`'s; their Slurm-like environments are
:mod:`cyclone_kit.backends.local_env`'s.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from cyclone_kit.backends.base import Finished, JobHandle
from cyclone_kit.backends.base import log_files as run_log_files
from cyclone_kit.backends.local_env import (
    available_cores,
    launcher_variables,
    rank_environments,
    threads_per_rank,
    working_directory,
)
from cyclone_kit.backends.plan import SubmissionPlan, run_dir_files
from cyclone_kit.backends.srun_emulator import (
    GRACE_S,
    STOP_GRACE_S,
    LaunchResult,
    failure_record,
    format_failure,
    launch,
    record_submission,
)
from cyclone_kit.config.container import container_environment, container_runtime
from cyclone_kit.config.validate import spec_json
from cyclone_kit.core.errors import RankFailure, ValidationError
from cyclone_kit.launchers import LOCAL, Wrapped
from cyclone_kit.rundir import failures
from cyclone_kit.rundir.entry import rank_argv
from cyclone_kit.rundir.layout import LAUNCH_FILE, RunDir, last_end_record

if TYPE_CHECKING:
    from cyclone_kit.config.job import JobSpec
    from cyclone_kit.config.validate import ResolvedJob
    from cyclone_kit.slurm.parse import JobInfo

__all__ = ["AT_LAUNCH_JOB_ID", "AT_LAUNCH_PORT", "NO_JOB_ID", "LocalBackend", "LocalPlan", "launch_facts", "local_job",
           "run_dir_status"]

#: What ``status`` shows as a local run's job id: no scheduler gave it one.
NO_JOB_ID = "-"
#: What a dry run shows for the two values drawn when the ranks start: the fake job id and a free port.
AT_LAUNCH_JOB_ID, AT_LAUNCH_PORT = "<job id drawn at launch>", "<free port found at launch>"


@dataclass(frozen=True)
class LocalPlan:
    """What the local launcher runs for a job: one command on every rank, in one working folder,
    each rank with the variables the launcher sets on it (laid on this process's environment,
    cleaned of an enclosing launcher's variables). ``launch.json`` records the same for the real run.
    """

    run_dir: str
    cwd: str
    threads_per_rank: int
    command: tuple[str, ...]
    ranks: tuple[Mapping[str, str], ...]

    def to_dict(self) -> dict[str, Any]:
        """The plan as ``launch.json`` has it (without what only the launch knows: job id, pids)."""
        return {
            "launcher": LOCAL.name,
            "run_dir": self.run_dir,
            "cwd": self.cwd,
            "nodelist": self.ranks[0]["SLURM_JOB_NODELIST"],
            "threads_per_rank": self.threads_per_rank,
            "command": list(self.command),
            "ranks": [{"rank": r, "host": env["SLURMD_NODENAME"], "env": dict(env)} for r, env in enumerate(self.ranks)],
        }

    def text(self) -> str:
        """The plan as a dry run prints it (JSON)."""
        return json.dumps(self.to_dict(), indent=2) + "\n"


class LocalBackend:
    """``--backend local``: run the job right here, in the foreground, with the local launcher.

    The world size and node count come from the resolved job; torch threads per rank are the
    cores of this machine shared evenly.
    """

    name = "local"
    batch_script = False
    foreground = True  # the ranks run here; schedule returns when they have ended

    def __init__(self, *, echo: IO[str] | None = None, quiet: bool = False, grace_s: float = GRACE_S,
                 threads: int | None = None, timeout_s: float | None = None, stop_grace_s: float | None = None,
                 extra_env: Mapping[str, str] | None = None, fit_threads: bool = False) -> None:
        """``echo``: where rank 0's output goes (default stdout; ``quiet``: nowhere);
        ``threads``: torch threads per rank (default: this machine's cores shared evenly; ``fit_threads``:
        at most the job's CPUs per task, as a study's points get); ``timeout_s``: stop every rank after so
        long; ``stop_grace_s``: after an interrupt or the timeout, the ranks' time for their stop checkpoint
        before SIGKILL (default :data:`STOP_GRACE_S`); ``extra_env``: variables for every rank."""
        self.echo: IO[str] | None = None if quiet else sys.stdout if echo is None else echo
        self.grace_s = grace_s
        self.stop_grace_s = STOP_GRACE_S if stop_grace_s is None else stop_grace_s
        self.threads = threads
        self.timeout_s = timeout_s
        self.extra_env = dict(extra_env or {})
        self.fit_threads = fit_threads

    def for_study(self) -> LocalBackend:
        """This backend for a study's points: each point's ranks get its CPUs per task as threads, at most this
        machine's cores shared among its ranks (so that the points of a scaling study compare)."""
        backend = copy.copy(self)
        backend.extra_env = dict(self.extra_env)
        backend.fit_threads = True
        return backend

    def plan(self, job: ResolvedJob, run_dir: Path, *, script: str | None = None,
             after: Sequence[str] = (), rerun: bool = False) -> SubmissionPlan:
        """``job``'s plan in ``run_dir`` (pure): ``spec.json`` with the threads each rank gets, a user script's
        copy; the command every rank runs, its folder, the variables the backend adds, and as the text a dry
        run prints, the ranks' launch plan (:meth:`launch_plan`, JSON). No batch script runs (``script`` unused).
        ``rerun``: the run directory exists with its files (``run --resume``): the plan holds none.

        Raises:
            ValidationError: ``after`` is not empty (a foreground run cannot wait for another job); the
                ranks do not split evenly over the nodes, or would share a GPU.
        """
        if after:
            raise ValidationError("the local backend runs in the foreground and cannot wait for other jobs",
                                  hint="drop the dependency, or use --backend slurm")
        run_dir = Path(run_dir).absolute()
        threads = self.threads_for(job)
        launch_plan = self.launch_plan(job, run_dir)
        files = {} if rerun else run_dir_files(job, spec_text=spec_json(dataclasses.replace(job, cpus_per_task=threads)))
        return SubmissionPlan(self.name, run_dir, job, files, launch_plan.text(), (launch_plan.command,),
                              cwd=Path(launch_plan.cwd), parameters={"threads_per_rank": threads},
                              environment=self.rank_env(job, os.environ),
                              text_at=f"{LAUNCH_FILE} (written at launch, with the job id and port)",
                              summary=f"{job.world_size} rank(s), {threads} thread(s) each")

    def launch_plan(self, job: ResolvedJob, run_dir: Path | str, *, job_id: str = AT_LAUNCH_JOB_ID,
                    master_port: int | str = AT_LAUNCH_PORT, environ: Mapping[str, str] | None = None) -> LocalPlan:
        """What the local launcher runs for ``job`` in ``run_dir`` (the job id and port as placeholders unless given).

        Raises:
            ValidationError: the ranks do not split evenly over the nodes, or would share a GPU.
        """
        run_dir = str(Path(run_dir).absolute())
        threads = self.threads_for(job)
        cwd = working_directory(job.spec) or os.getcwd()
        base = os.environ if environ is None else environ
        ranks = launcher_variables(job.world_size, job.nodes, job_id=job_id, master_port=master_port,
                                   threads=threads, run_dir=run_dir, job_name=job.spec.name, submit_dir=cwd,
                                   base=base, extra_env=self.rank_env(job, base))
        return LocalPlan(run_dir, cwd, threads, tuple(rank_command(job, run_dir)), tuple(ranks))

    def rank_env(self, job: ResolvedJob, environ: Mapping[str, str]) -> dict[str, str]:
        """The variables every rank gets on top of the launcher's: a container's (its venv on ``PYTHONPATH``,
        ``USER``), then the backend's ``extra_env``."""
        import getpass

        box = job.spec.container
        return {**(container_environment(box, environ, getpass.getuser()) if box is not None else {}), **self.extra_env}

    def threads_for(self, job: ResolvedJob) -> int:
        """Torch threads per rank of ``job``: the backend's, else this machine's cores shared evenly (with
        ``fit_threads``: at most the job's CPUs per task)."""
        if self.threads:
            return self.threads
        shared = threads_per_rank(job.world_size, available_cores())
        return max(1, min(job.cpus_per_task, shared)) if self.fit_threads else shared

    def launch(self, plan: SubmissionPlan) -> LaunchResult:
        """Run ``plan`` (its files written) until every rank has ended: its command in its folder with its
        variables, on its threads; the result says how it went. The caller reports a failure's root
        cause first, then records the submission (:meth:`record`)."""
        job = plan.job
        return launch(plan.run_dir, job.world_size, job.nodes, threads=int(plan.parameters["threads_per_rank"]),
                      job_name=job.spec.name, echo=self.echo, grace_s=self.grace_s, stop_grace_s=self.stop_grace_s,
                      command=plan.commands[0], cwd=plan.cwd, timeout_s=self.timeout_s, extra_env=plan.environment)

    def run_here(self, plan: SubmissionPlan, *, echo: IO[str] | None = None) -> Finished:
        """Run ``plan`` until every rank has ended (rank 0's output to ``echo``), record it; how it went
        (a failure's report names the root cause first; Ctrl-C stops the ranks and says ``interrupted``)."""
        echoing = copy.copy(self)
        echoing.echo = echo
        result = echoing.launch(plan)
        self.record(plan.run_dir, result)
        report = "" if result.ok or result.interrupted else format_failure(result)
        return Finished(result.job_id, result.ok, result.wall_time_s, result.interrupted, report)

    def record(self, run_dir: Path, result: LaunchResult) -> None:
        """Record the launch's job id and this backend in ``run_dir`` (a full disk: a warning line)."""
        record_submission(RunDir(run_dir), result.job_id, self.name)

    def schedule(self, plan: SubmissionPlan) -> JobHandle:
        """Run ``plan`` until it ends (:meth:`launch`), record it; its handle (a fake job id, already finished).

        Raises:
            RankFailure: a rank failed or the run was interrupted; the message is the root cause
                line, ``failure.json`` holds the details, the full report went to stderr.
        """
        rd = RunDir(plan.run_dir)
        result = self.launch(plan)
        if not result.ok:
            sys.stderr.write(format_failure(result) + "\n")
            self.record(rd.path, result)
            raise RankFailure(
                failure_record(result)["summary"],
                hint=f"see {rd.failure} and {rd.logs}",
            )
        self.record(rd.path, result)
        return JobHandle(result.job_id, self.name, rd.path)

    def submit_run(self, job: ResolvedJob, run_dir: Path, *, after: Sequence[str] = ()) -> JobHandle:
        """Run ``job`` in the prepared ``run_dir`` until it ends (:meth:`schedule` of :meth:`plan`).

        Raises:
            ValidationError: ``after`` is not empty: a foreground run cannot wait for another job.
            RankFailure: as :meth:`schedule`.
        """
        return self.schedule(self.plan(job, run_dir, after=after))

    def status(self, job: str) -> JobInfo:
        """What the run directory says: a foreground run has ended by the time anyone asks.

        Its job id is :data:`NO_JOB_ID`: no scheduler gave one (the ranks' ``SLURM_JOB_ID`` is the
        launcher's own, for the srun-like environment only).
        """
        return dataclasses.replace(run_dir_status(str(job), getattr(job, "run_dir", None)), job_id=NO_JOB_ID)

    def status_many(self, jobs: Sequence[str]) -> dict[str, JobInfo]:
        """:meth:`status` of each job (run directories only: nothing to ask)."""
        return {str(j): self.status(j) for j in jobs}

    def cancel(self, job: str) -> None:
        """A foreground run stops with Ctrl-C; afterwards there is nothing to cancel.

        Raises:
            ValidationError: always (the run has finished).
        """
        raise ValidationError(f"local job {job} ran in the foreground and has finished",
                              hint="stop a local run with Ctrl-C while it runs")

    def log_files(self, job: JobHandle) -> list[Path]:
        """Per-rank logs: ``logs/rank-N.out`` and ``.err``."""
        return run_log_files(job)


def run_dir_status(job_id: str, run_dir: Path | None) -> JobInfo:
    """The state of a foreground run that has ended, from its run directory's records.

    What the local launcher recorded (``launch.json``) fills in what a scheduler would say: the
    nodes (the pretend nodes' hosts), the wall time of the launch (else rank 0's shim end record's),
    and, as the reason, the ranks and their hosts (``2 ranks on localhost``).
    """
    from cyclone_kit.slurm.parse import JobInfo
    from cyclone_kit.slurm.states import JobState

    rd = RunDir(run_dir) if run_dir is not None else None
    end = rd.end_status() if rd is not None else None
    cause = failures.root_cause(rd.path) if rd is not None else None
    state = {"completed": JobState.COMPLETED, "preempted": JobState.PREEMPTED, "cancelled": JobState.CANCELLED,
             "failed": JobState.FAILED}.get(
        end or "", JobState.FAILED if cause else JobState.UNKNOWN)
    name = str(rd.read_spec().get("name", rd.path.name)) if rd is not None else ""
    nodes, nodelist, elapsed, reason = launch_facts(rd.read_launch() if rd is not None else None,
                                                    last_end_record(rd.shim) if rd is not None else None)
    return JobInfo(job_id, name, state, nodes, nodelist, elapsed, reason, None, None, source="local")


def launch_facts(launch: Mapping[str, Any] | None, shim_end: Mapping[str, Any] | None) -> tuple[int, str, int, str]:
    """(nodes, nodelist, elapsed seconds, ``N ranks on HOSTS``) of a local launch from its records (pure).

    Unknown parts are 0 or ''. The wall time is ``launch.json``'s (every rank ended), else rank 0's.
    """
    ranks = [r for r in (launch or {}).get("ranks") or [] if isinstance(r, dict)]
    hosts = list(dict.fromkeys(str(r.get("host")) for r in ranks if r.get("host")))
    wall = (launch or {}).get("wall_time_s")
    if not isinstance(wall, (int, float)):
        wall = (shim_end or {}).get("wall_time_s")
    elapsed = max(1, round(wall)) if isinstance(wall, (int, float)) and wall >= 0 else 0
    nodelist = str((launch or {}).get("nodelist") or ",".join(hosts))
    reason = f"{len(ranks)} rank{'s' if len(ranks) != 1 else ''} on {', '.join(hosts)}" if ranks and hosts else ""
    return len(hosts), nodelist, elapsed, reason


def rank_command(job: ResolvedJob, run_dir: Path | str) -> list[str]:
    """What each rank of ``job`` runs in ``run_dir`` (pure): the local launcher's command, in the job's container
    when it has one (:class:`~cyclone_kit.launchers.registry.Wrapped`, the image's python)."""
    box = job.spec.container
    runtime = container_runtime(job.spec, run_dir)
    launcher = LOCAL if runtime is None else Wrapped(LOCAL, runtime)
    return launcher.rank_command(rank_argv(job.spec, run_dir, python=box.python if box is not None else None))


def local_job(spec: JobSpec, nproc: int, nodes: int = 1, threads: int | None = None) -> ResolvedJob:
    """A ResolvedJob for ``run``: ``nproc`` CPU ranks on ``nodes`` pretend nodes, no profile checks.

    The spec's resources are rewritten to what actually runs (nodes, tasks per node, no GPUs
    requested, ``threads`` CPUs per task). No cluster and no scheduler took part, so the job names
    no partition and no account (its ``spec.json`` records ``partition = ""``), and its profile is
    this machine under the spec's profile name, kept for the record.

    Raises:
        ValidationError: ``nproc`` does not split evenly over ``nodes``.
    """
    from cyclone_kit.config.profile import ClusterProfile, Partition
    from cyclone_kit.config.validate import ResolvedJob
    from cyclone_kit.slurm.walltime import parse_time

    if nproc < 1 or nodes < 1 or nproc % nodes:
        rank_environments(nproc, nodes, job_id="0", master_port=0, threads=1, run_dir=".")  # raises the error
    per_node = nproc // nodes
    threads = threads or threads_per_rank(nproc, available_cores())
    res = dataclasses.replace(spec.resources, nodes=nodes, ntasks_per_node=per_node, gpus_per_node=0,
                              cpus_per_task=threads, partition="", account="")
    spec = dataclasses.replace(spec, resources=res)
    part = Partition(name="", nodes=nodes, cpus_per_node=per_node * threads, max_time=res.time)
    profile = ClusterProfile(name=res.profile, partitions=(part,), description="this machine (local launcher)")
    return ResolvedJob(spec, profile, part, nodes, 0, per_node, threads, parse_time(res.time), "")
