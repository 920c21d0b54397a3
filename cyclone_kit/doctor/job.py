"""``cyclone-kit doctor``'s side-effect edge: ask the cluster, run the smoke job, collect the reports.

The judging is pure (:mod:`cyclone_kit.doctor.checks`); this module gathers the facts it judges:

* the request, resolved as ``submit`` would resolve it (:func:`doctor_request`);
* the partition, its nodes, accounting and the user's associations (:mod:`cyclone_kit.slurm.query`);
* the profile's modules, where Lmod or Environment Modules is installed (:func:`module_facts`);
* the smoke job: rendered from templates/doctor.sbatch.j2 (which extends base.sbatch.j2, so it
  gets the profile's own modules, env, setup and python), planned by the slurm backend
  (:func:`smoke_plan`: the one value that is shown and submitted), its files written and the plan
  scheduled, waited for by its job state, then read back (:func:`run_smoke_job`).

Nothing here imports torch: the CLI process stays light; only the job's ranks import it.
"""

from __future__ import annotations

import getpass
import importlib.metadata
import json
import os
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from cyclone_kit.config.container import ContainerConfig
from cyclone_kit.config.job import CheckpointConfig, JobSpec, Resources
from cyclone_kit.config.profile import load_profile
from cyclone_kit.config.validate import ResolvedJob, resolve
from cyclone_kit.core.errors import CommandError, CycloneError
from cyclone_kit.doctor.checks import Check, HostVersions, ModuleFacts, SmokeResult
from cyclone_kit.launchers import SRUN
from cyclone_kit.rundir.network import NetworkFigures

if TYPE_CHECKING:
    from cyclone_kit.backends.plan import SubmissionPlan

#: the smoke job's name (``--job-name``) and the prefix of its run directory.
JOB_NAME = "ck-doctor"
#: its wall-time request; the probe itself is bounded by PROBE_TIMEOUT_S per stage.
JOB_TIME = "00:03:00"
#: seconds a rank waits for the others in init_process_group.
PROBE_TIMEOUT_S = 30
#: size of the bandwidth all-reduce.
PROBE_MEGABYTES = 8
#: the smoke job's run directory's note in its rank reports' folder.
README = ("doctor/README", "rank reports of cyclone-kit doctor's smoke job\n")


@dataclass(frozen=True)
class DoctorOptions:
    """What ``cyclone-kit doctor`` was asked (already parsed from the command line).

    Attributes:
        profile: profile name or .toml path.
        partition: partition name; ``""`` for the profile's default.
        nodes: nodes for the smoke job; ``None`` for 2 (1 on a one-node partition).
        account: ``--account``; ``""`` for the profile's.
        runs_dir: where the smoke job's run directory is created (must be visible from the nodes).
        wait_timeout_s: how long to wait for the smoke job (queue and run) before cancelling it.
        static_only: skip the smoke job.
        python: the interpreter for the job; ``None`` for the profile's, else this one.
        ntasks_per_node: tasks per node (``None``: one per GPU, one on CPU partitions); 2 or more
            also measure the network inside a node.
        container: an image the smoke job's probes run in (``""``: the profile's default image, if any);
            container_runtime: its runtime (``""``: the profile's).
    """

    profile: str
    partition: str = ""
    nodes: int | None = None
    account: str = ""
    runs_dir: Path = Path("runs")
    wait_timeout_s: float = 300
    static_only: bool = False
    python: str | None = None
    ntasks_per_node: int | None = None
    container: str = ""
    container_runtime: str = ""


def doctor_request(profile: str, partition: str, nodes: int | None, account: str,
                   ntasks_per_node: int | None = None, container: ContainerConfig | None = None) -> ResolvedJob:
    """The smoke job's request: what ``submit`` would ask for on that profile and partition (in ``container``,
    over the profile's ``[container]``).

    Raises:
        ValidationError: unknown profile or partition, or a request the profile cannot hold.
    """
    prof = load_profile(profile)
    part = prof.partition(partition) if partition else prof.default_partition
    if nodes is None:
        nodes = min(2, part.nodes)
    spec = JobSpec(
        name=JOB_NAME,
        resources=Resources(profile=prof.name, partition=part.name, nodes=nodes, account=account, time=JOB_TIME,
                            ntasks_per_node=ntasks_per_node,
                            launcher=SRUN.name),
        checkpoint=CheckpointConfig(requeue=False, resume=False, every_steps=0),
        container=container,
    )
    return resolve(spec, prof)


def host_versions() -> HostVersions:
    """This host's python and (installed, not imported) torch versions."""
    try:
        torch = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch = ""
    return HostVersions(python=platform.python_version(), torch=torch)


def module_facts(modules: Sequence[str], environ: Mapping[str, str]) -> ModuleFacts:
    """Ask Lmod (``$LMOD_CMD``) or Environment Modules (``$MODULES_CMD``) for each module."""
    from cyclone_kit.core.proc import run_command

    if not modules:
        return ModuleFacts()
    if environ.get("LMOD_CMD"):
        system, cmd = "lmod", environ["LMOD_CMD"]

        def argv(name: str) -> list[str]:
            return [cmd, "bash", "-t", "avail", name]
    elif environ.get("MODULES_CMD"):
        system, cmd = "environment-modules", environ["MODULES_CMD"]

        def argv(name: str) -> list[str]:
            return [cmd, "bash", "avail", "-t", name]
    else:
        return ModuleFacts()
    listings = {}
    for name in modules:
        try:
            result = run_command(argv(name), timeout=60, check=False)
        except CommandError as e:
            return ModuleFacts(system=system, error=f"{system} could not run: {e.message}")
        listings[name] = result.stdout + "\n" + result.stderr  # both print the list on stderr
    return ModuleFacts(system=system, listings=listings)


def _read_reports(folder: Path) -> tuple[dict, ...]:
    """The rank reports in rank order (unreadable ones are skipped: the rank died mid-write)."""
    reports = []
    for path in folder.glob("rank-*.json"):
        try:
            reports.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return tuple(sorted(reports, key=lambda r: int(r.get("slurm", {}).get("SLURM_PROCID", 1 << 30))))


def _read_logs(logs: Path, suffix: str) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(logs.glob(f"*{suffix}")))


def smoke_plan(job: ResolvedJob, run_dir: Path, *, python: str | None = None) -> SubmissionPlan:
    """The smoke job in ``run_dir`` as the slurm backend plans it (pure): the doctor template's batch script
    (what a dry run would print) as ``job.sbatch``, the ``sbatch`` line that submits it, and the rank reports'
    folder. Its run directory is no run: it holds no ``spec.json``, so status, report and run lookups over the
    runs directory never take it for a training run.

    Raises:
        ValidationError: a value the template refuses.
    """
    from cyclone_kit.backends.slurm import SlurmBackend
    from cyclone_kit.rundir.layout import SPEC_FILE
    from cyclone_kit.submit.render import render_script

    run_dir = Path(run_dir).absolute()
    script = render_script(job, run_dir, python=python, template="doctor.sbatch.j2",
                           extra={"probe_timeout_s": PROBE_TIMEOUT_S, "probe_megabytes": PROBE_MEGABYTES,
                                  "probe_dir": str(run_dir / "doctor")})
    plan = SlurmBackend().plan(job, run_dir, script=script)
    return replace(plan, files={**{rel: data for rel, data in plan.files.items() if rel != SPEC_FILE}, README[0]: README[1]})


def run_smoke_job(job: ResolvedJob, runs_dir: Path, *, wait_timeout_s: float, python: str | None = None,
                  progress: Callable[[str], None] = lambda _: None) -> SmokeResult:
    """Plan (:func:`smoke_plan`), write, schedule and wait for the smoke job; return what it left.

    The job is waited for by its state (squeue, then sacct / scontrol), never by a fixed sleep;
    after ``wait_timeout_s`` it is cancelled and reported as not finished.
    """
    from cyclone_kit.backends.slurm import SlurmBackend
    from cyclone_kit.rundir.layout import RunDir, create_run_dir, remove_run_dir, run_dir_name
    from cyclone_kit.submit.submission import write_plan

    runs_dir = Path(runs_dir).absolute()
    smoke_plan(job, runs_dir / run_dir_name(JOB_NAME), python=python)  # fail before creating anything
    run_dir = create_run_dir(runs_dir, JOB_NAME, {})
    try:
        plan = smoke_plan(job, run_dir, python=python)
        write_plan(plan)
    except BaseException:
        remove_run_dir(run_dir)
        raise
    rd = RunDir(run_dir)
    backend = SlurmBackend(timeout=30)
    try:
        job_id = backend.schedule(plan).job_id  # records the job id and the backend in the run directory
    except CycloneError as e:
        remove_run_dir(run_dir)
        return SmokeResult(job_id="", state="", finished=False, reason=str(e))
    progress(f"smoke job {job_id}: {job.nodes} node(s) x {job.ntasks_per_node} task(s) on {job.partition.name}; "
             f"run dir {run_dir}")
    deadline = time.monotonic() + wait_timeout_s
    last_state = ""
    while True:
        try:
            info = backend.status(job_id)
        except CycloneError as e:  # the controller stopped answering mid-way
            return SmokeResult(job_id, last_state or "UNKNOWN", False, f"lost contact with Slurm: {e.message}",
                               reports=_read_reports(run_dir / "doctor"), stderr=_read_logs(rd.logs, ".err"),
                               run_dir=str(run_dir))
        if info.state.value != last_state:
            last_state = info.state.value
            progress(f"smoke job {job_id}: {last_state}" + (f" ({info.reason})" if info.reason else ""))
        if info.state.is_terminal:
            break
        if time.monotonic() > deadline:
            backend.cancel(job_id)
            return SmokeResult(job_id, info.state.value, False, info.reason, info.elapsed, info.nodelist,
                               _read_reports(run_dir / "doctor"), _read_logs(rd.logs, ".err"), str(run_dir),
                               cancelled=True)
        time.sleep(0.2)
    return SmokeResult(job_id, info.state.value, True, info.reason, info.elapsed, info.nodelist,
                       _read_reports(run_dir / "doctor"), _read_logs(rd.logs, ".err"), str(run_dir))


def run_doctor(options: DoctorOptions, *, environ: Mapping[str, str] | None = None,
               progress: Callable[[str], None] = lambda _: None) -> list[Check]:
    """Every check of ``options``: static against the live cluster, then the smoke job's.

    Raises:
        ValidationError: bad input (unknown profile or partition, impossible request): exit 2.
    """
    from cyclone_kit.doctor import checks as doctor
    from cyclone_kit.slurm.query import cluster_facts

    environ = os.environ if environ is None else environ
    box = (ContainerConfig(runtime=options.container_runtime, image=options.container)
           if options.container or options.container_runtime else None)
    job = doctor_request(options.profile, options.partition, options.nodes, options.account, options.ntasks_per_node,
                         box)
    if job.spec.container is not None:  # the image, runtime and binds here, before the job (exit 2 when wrong)
        from cyclone_kit.config.container import check_container

        job = check_container(job, options.runs_dir)
    user = environ.get("USER") or getpass.getuser()
    try:
        facts = cluster_facts(job.partition.name, user)
    except CycloneError as e:
        return [Check("slurm", False, f"cannot ask the cluster: {e.message}", e.hint)]
    checks = doctor.static_checks(
        job, facts.partition, facts.nodes, accounting=facts.accounting, associations=facts.associations,
        associations_error=facts.associations_error, user=user, modules=module_facts(job.profile.modules, environ),
    )
    if options.static_only:
        return checks
    problems = doctor.request_problems(job, facts.partition, facts.nodes)
    if problems:
        return checks + doctor.skipped_live_checks("smoke job not submitted: " + "; ".join(problems))
    result = run_smoke_job(job, options.runs_dir, wait_timeout_s=options.wait_timeout_s, python=options.python,
                           progress=progress)
    figures = save_network_figures(job, result, progress)
    return checks + doctor.live_checks(job, result, host_versions(), figures)


def save_network_figures(job: ResolvedJob, result: SmokeResult,
                         progress: Callable[[str], None] = lambda _: None) -> NetworkFigures | None:
    """Fit the smoke job's all-reduce sweep and write ``network.json`` into its run directory."""
    from cyclone_kit.doctor.checks import network_figures
    from cyclone_kit.rundir.contract import utc_now
    from cyclone_kit.rundir.layout import RunDir
    from cyclone_kit.rundir.network import save_network

    figures = network_figures(job, result, time=utc_now())
    if figures is not None and result.run_dir:
        path = RunDir(Path(result.run_dir)).network
        save_network(path, figures)
        progress(f"network figures: {path} (cyclone-kit predict ... --network {path})")
    return figures
