"""Check a job spec against a cluster profile and fill in what the profile decides (pure).

Every check raises a one-line :class:`ValidationError` whose HINT names the fix, so a
request that cannot run never reaches the queue (``sbatch -N3`` on a 2-node partition is
accepted by Slurm and then pends forever). :func:`check_backend` and :func:`check_restart_backend`
refuse what the chosen backend cannot run; :func:`spec_json` is the resolved spec as the run
directory records it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from cyclone_kit.config.container import merged
from cyclone_kit.config.job import JobSpec, spec_to_dict
from cyclone_kit.config.profile import ClusterProfile, Partition
from cyclone_kit.core.errors import ValidationError
from cyclone_kit.core.version import torch_release
from cyclone_kit.launchers import Launcher, get_launcher
from cyclone_kit.launchers.containers import RUNTIMES
from cyclone_kit.slurm.memory import parse_mem_mb
from cyclone_kit.slurm.walltime import format_time, parse_time


@dataclass(frozen=True)
class ResolvedJob:
    """A spec whose resources are fully decided for one partition of one profile."""

    spec: JobSpec
    profile: ClusterProfile
    partition: Partition
    nodes: int
    gpus_per_node: int
    ntasks_per_node: int
    cpus_per_task: int
    time_s: int
    account: str
    spare_nodes: int = 0
    min_nodes: int = 0

    @property
    def alloc_nodes(self) -> int:
        """Nodes the allocation holds: the step's ``nodes`` and the spares beside them."""
        return self.nodes + self.spare_nodes

    @property
    def restarts_in_job(self) -> bool:
        """Whether a lost node can be left out inside the job: a spare to take its place, or room to shrink."""
        return self.spare_nodes > 0 or 0 < self.min_nodes < self.nodes

    @property
    def launcher(self) -> Launcher:
        """The launcher that starts the ranks (``resources.launcher`` from the registry)."""
        return get_launcher(self.spec.resources.launcher)

    @property
    def world_size(self) -> int:
        """Number of training ranks (one per GPU, or per task on CPU partitions)."""
        return self.nodes * self.procs_per_node

    @property
    def procs_per_node(self) -> int:
        """Training processes per node: the tasks, or what each task's agent starts (torchrun: one
        per GPU, or on CPU nodes ``resources.ntasks_per_node`` workers, its ``--nproc-per-node``)."""
        return self.launcher.procs_per_node(self.ntasks_per_node, self.gpus_per_node,
                                            self.spec.resources.ntasks_per_node)

    @property
    def time(self) -> str:
        """The wall time in Slurm's canonical form."""
        return format_time(self.time_s)


def installed_torch_release() -> tuple[int, int] | None:
    """The release of the torch installed beside cyclone_kit (what the job's interpreter runs), without
    importing it; None when it is not installed."""
    from importlib import metadata

    try:
        return torch_release(metadata.version("torch"))
    except metadata.PackageNotFoundError:
        return None


def resolve(spec: JobSpec, profile: ClusterProfile) -> ResolvedJob:
    """Decide every resource of ``spec`` on ``profile``, or raise the first problem found."""
    container = merged(spec.container, profile.container)  # the job's [container] over the profile's
    if container != spec.container:
        spec = dataclasses.replace(spec, container=container)
    res = spec.resources
    part = profile.partition(res.partition) if res.partition else profile.default_partition
    where = f"partition {part.name!r} of profile {profile.name!r}"

    if res.nodes > part.nodes:
        raise ValidationError(
            f"--nodes={res.nodes} but {where} has {part.nodes} nodes",
            hint=f"use --nodes between 1 and {part.nodes}, or another partition",
        )

    gpus = part.gpus_per_node if res.gpus_per_node is None else res.gpus_per_node
    if gpus > part.gpus_per_node:
        raise ValidationError(
            f"--gpus-per-node={gpus} but {where} has {part.gpus_per_node} GPUs per node",
            hint=f"use --gpus-per-node={part.gpus_per_node} or fewer" if part.gpus_per_node
            else "use --partition with GPUs (e.g. gpu) or --gpus-per-node=0",
        )

    if part.gpus_per_node and gpus == 0:
        raise ValidationError(
            f"--gpus-per-node=0 on {where}, whose nodes have {part.gpus_per_node} GPUs: "
            "that would be a CPU job holding GPU nodes",
            hint=f"use --gpus-per-node between 1 and {part.gpus_per_node}, or a CPU partition",
        )

    launcher = get_launcher(res.launcher)  # its rules: tasks per node, CPUs per task, in-job restarts
    error = launcher.layout_error(res.ntasks_per_node, gpus, where)
    if error is not None:
        raise error
    tasks = launcher.tasks_per_node(res.ntasks_per_node, gpus)

    if res.cpus_per_task is not None:
        cpus = res.cpus_per_task
    elif gpus:
        cpus = launcher.cpus_per_task(min(profile.cpus_per_gpu or part.cpus_per_gpu, part.cpus_per_gpu), gpus)
    else:
        cpus = max(1, part.cpus_per_node // max(tasks, 1))
    error = launcher.cpu_error(res.ntasks_per_node, cpus, gpus, part.cpus_per_gpu, part.cpus_per_node, where)
    if error is not None:
        raise error
    total_cpus = cpus * tasks
    if total_cpus > part.cpus_per_node:
        raise ValidationError(
            f"{tasks} tasks x {cpus} CPUs per task = {total_cpus} CPUs, but {where} nodes have {part.cpus_per_node}",
            hint=f"lower --cpus-per-task to {max(1, part.cpus_per_node // max(tasks, 1))} or --ntasks-per-node",
        )

    time_s = parse_time(res.time)
    if time_s > part.max_time_s:
        raise ValidationError(
            f"--time={res.time} is above the {part.max_time} limit of {where}",
            hint=f"use --time={part.max_time} or less; cyclone_kit checkpoints and requeues long runs",
        )

    if res.mem and part.memory_gb and parse_mem_mb(res.mem) > part.memory_gb * 1024:
        raise ValidationError(
            f"resources.mem={res.mem} is more than the {part.memory_gb} GB of a node of {where}",
            hint=f"use resources.mem={part.memory_gb}G or less, or leave it out",
        )

    check_script_gpu_layout(spec, profile, gpus, tasks)
    account = res.account or profile.account
    spares = profile.spare_nodes if res.spare_nodes is None else res.spare_nodes
    check_restart_layout(res.nodes, spares, res.min_nodes, launcher, part.nodes, where)
    error = launcher.signal_error(spec.checkpoint.signal, installed_torch_release())
    if error is not None:
        raise error
    job = ResolvedJob(spec, profile, part, res.nodes, gpus, tasks, cpus, time_s, account, spares,
                      res.min_nodes or res.nodes)
    _check_pipeline(job)
    return job


def check_restart_layout(nodes: int, spares: int, min_nodes: int, launcher: Launcher, partition_nodes: int,
                         where: str) -> None:
    """Spare nodes and a shrink floor against the partition and the launcher (pure).

    Raises:
        ValidationError: more nodes and spares than the partition has, or in-job restarts with a
            launcher that refuses them (torchrun's agent restarts on its own).
    """
    if spares and nodes + spares > partition_nodes:
        raise ValidationError(
            f"--nodes={nodes} and --spare-nodes={spares} need {nodes + spares} nodes but {where} has {partition_nodes}",
            hint=f"use --spare-nodes={max(partition_nodes - nodes, 0)} or fewer, or fewer --nodes",
        )
    error = launcher.restart_error(spares, min_nodes, nodes)
    if error is not None:
        raise error


def _check_pipeline(job: ResolvedJob) -> None:
    """The pipeline's layout against the job's ranks (the runtime checks the same; here it fails before the queue)."""
    tc = getattr(job.spec, "train", None)
    if tc is None or tc.strategy != "pipeline":
        return
    world = job.world_size
    stages = tc.pipeline_stages or world
    if world % stages:
        raise ValidationError(
            f"train.pipeline_stages={stages} does not divide the job's {world} ranks",
            hint=f"use a divisor of {world} (world / pipeline_stages data-parallel replicas), or change --nodes",
        )
    if tc.batch_size % tc.microbatches:
        raise ValidationError(
            f"train.batch_size {tc.batch_size} does not split into {tc.microbatches} equal micro-batches",
            hint="with strategy=pipeline make train.batch_size a multiple of train.microbatches",
        )
    if tc.pipeline_schedule != "gpipe" and tc.microbatches < stages:
        raise ValidationError(
            f"train.pipeline_schedule={tc.pipeline_schedule} needs train.microbatches >= {stages} stages",
            hint=f"--set train.microbatches={stages} (or more), or train.pipeline_schedule=gpipe",
        )


#: ``--gpu-bind`` values that leave a task one GPU of its node (``none`` leaves it all of them).
_ONE_GPU_BINDS = ("single", "per_task", "map_gpu", "mask_gpu", "closest")


def check_script_gpu_layout(spec: JobSpec, profile: ClusterProfile, gpus: int, tasks: int) -> None:
    """Refuse a script job whose tasks would each see one GPU of a node running several ranks (pure).

    The launch shim gives a script torchrun's variables, and torchrun's workers see every GPU of
    their node: scripts take ``cuda:LOCAL_RANK``. Under ``--gpus-per-task=1`` or ``--gpu-bind=single:1``
    each task sees its GPU as ``cuda:0``, so local rank 1 fails with "invalid device ordinal"
    (the built-in trainer and ``ck.init()``'s ``ctx.device`` cope with both layouts; a script may not).

    Raises:
        ValidationError: a script job with several ranks per node and such a binding or request.
    """
    per_node = get_launcher(spec.resources.launcher).procs_per_node(tasks, gpus, spec.resources.ntasks_per_node)
    if spec.script is None or not gpus or per_node < 2:
        return
    binds = [b.split("=", 1)[1] for b in profile.srun_binding if b.startswith("--gpu-bind=")]
    extra = [d for d in (*profile.extra_sbatch, *spec.resources.extra_sbatch)
             if d.replace(" ", "=").startswith("--gpus-per-task")]
    one_gpu = [f"gpu_bind = {b!r}" for b in binds if b.split(":")[0].split(",")[-1] in _ONE_GPU_BINDS] + extra
    if one_gpu:
        raise ValidationError(
            f"script job with {per_node} ranks per node, but {one_gpu[0]} gives each task one GPU: a script that "
            "takes cuda:LOCAL_RANK (torchrun's layout, which the launch shim gives scripts) fails on local rank 1",
            hint="let every task see its node's GPUs: gpu_bind = \"none\" in the profile and no --gpus-per-task "
                 "(or read the device from ck.init()'s ctx.device, which copes with either layout)",
        )


def check_backend(spec: JobSpec, backend: str) -> None:
    """Refuse a backend that cannot run a user's script (submitit runs the built-in trainer's callable),
    or a container (the submitit backend never wraps its ranks; the local one cannot run Pyxis, which needs srun)."""
    box = spec.container
    if box is not None and (backend == "submitit" or (backend == "local" and not RUNTIMES[box.runtime].local)):
        raise ValidationError(f"a container job ({box.runtime} image {box.image}) with the {backend} backend, which "
                              f"cannot run {box.runtime}",
                              hint="use --backend slurm (default), or drop --container"
                              + (" (the local backend runs charliecloud and apptainer images)" if backend == "local" else ""))
    if spec.script is not None and backend == "submitit":
        raise ValidationError(f"the submitit backend runs the built-in trainer, not {spec.script.label}",
                              hint="use --backend slurm (default) or --backend local for a script")


def check_restart_backend(job: ResolvedJob, backend: str) -> None:
    """Refuse spare nodes or a shrink floor on a backend without the step watcher that uses them.

    Only the slurm backend's batch script restarts a step inside the job (``--spare-nodes``,
    ``--min-nodes``, or the profile's ``spare_nodes``); the local and submitit backends would
    silently ignore them.

    Raises:
        ValidationError: ``job`` restarts in the job and ``backend`` is not slurm.
    """
    if backend == "slurm" or not job.restarts_in_job:
        return
    asked, drop = [], []
    if job.spare_nodes and job.spec.resources.spare_nodes is None:
        asked.append(f"profile {job.profile.name!r} spare_nodes={job.spare_nodes}")
        drop.append("pass --spare-nodes 0")
    elif job.spare_nodes:
        asked.append(f"--spare-nodes={job.spare_nodes}")
        drop.append("drop --spare-nodes (resources.spare_nodes)")
    if 0 < job.min_nodes < job.nodes:
        asked.append(f"--min-nodes={job.min_nodes}")
        drop.append("drop --min-nodes (resources.min_nodes)")
    refuse_restart_flags(asked, drop, f"the {backend} backend", "use --backend slurm (default), or")


def refuse_restart_flags(asked: list[str], drop: list[str], where: str, fix: str) -> None:
    """The refusal of in-job restart settings that ``where`` would ignore (pure).

    Args:
        asked: the settings asked for, as the user wrote them (``--spare-nodes=1``).
        drop: how to take each back.
        where: what would ignore them; fix: the hint's first choice, ending in "or".

    Raises:
        ValidationError: always.
    """
    raise ValidationError(
        f"{' and '.join(asked)}: in-job restarts (spare nodes, a shrink floor) need the slurm backend's step "
        f"watcher; {where} would ignore them",
        hint=f"{fix} {' and '.join(drop)}",
    )


def resolved_spec(job: ResolvedJob) -> JobSpec:
    """The spec with every resource the profile decided written in (what the run records)."""
    res = dataclasses.replace(
        job.spec.resources,
        partition=job.partition.name,
        gpus_per_node=job.gpus_per_node,
        # torchrun on CPU nodes: the workers per node (its --nproc-per-node), as the flag meant
        ntasks_per_node=job.launcher.recorded_tasks_per_node(job.ntasks_per_node, job.procs_per_node,
                                                             job.gpus_per_node),
        cpus_per_task=job.cpus_per_task,
        time=job.time,
        account=job.account,
        spare_nodes=job.spare_nodes,
        min_nodes=job.min_nodes,
    )
    return dataclasses.replace(job.spec, resources=res)


def spec_json(job: ResolvedJob) -> str:
    """The resolved spec as the run directory's ``spec.json`` text."""
    return json.dumps(spec_to_dict(resolved_spec(job)), indent=2, sort_keys=True) + "\n"
