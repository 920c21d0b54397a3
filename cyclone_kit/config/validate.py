"""Check a job spec against a cluster profile and fill in what the profile decides (pure).

Every check raises a one-line :class:`ValidationError` whose HINT names the fix, so a
request that cannot run never reaches the queue (``sbatch -N3`` on a 2-node partition is
accepted by Slurm and then pends forever).
"""

from __future__ import annotations

from dataclasses import dataclass

from cyclone_kit.config.job import JobSpec
from cyclone_kit.config.profile import ClusterProfile, Partition
from cyclone_kit.config.toolbox import parse_mem_mb
from cyclone_kit.core.errors import ValidationError
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
    def world_size(self) -> int:
        """Number of training ranks (one per GPU, or per task on CPU partitions)."""
        if self.spec.resources.launcher == "torchrun":
            return self.nodes * self.procs_per_node
        return self.nodes * self.ntasks_per_node

    @property
    def procs_per_node(self) -> int:
        """Training processes per node (torchrun starts this many per task: one per GPU, or on CPU
        nodes ``resources.ntasks_per_node`` workers, its ``--nproc-per-node``)."""
        if self.spec.resources.launcher == "torchrun":
            return self.gpus_per_node or self.spec.resources.ntasks_per_node or 1
        return self.ntasks_per_node

    @property
    def time(self) -> str:
        """The wall time in Slurm's canonical form."""
        return format_time(self.time_s)


def resolve(spec: JobSpec, profile: ClusterProfile) -> ResolvedJob:
    """Decide every resource of ``spec`` on ``profile``, or raise the first problem found."""
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

    launcher = res.launcher
    if launcher == "torchrun":
        tasks = 1  # one torchrun agent per node; it starts the workers
        if gpus and res.ntasks_per_node not in (None, 1, gpus):
            raise ValidationError(
                f"--ntasks-per-node={res.ntasks_per_node} with the torchrun launcher on {where}, whose workers are "
                f"one per GPU ({gpus} per node)",
                hint=f"drop --ntasks-per-node (torchrun starts {gpus} workers per node), or use "
                f"--gpus-per-node={res.ntasks_per_node}",
            )
    elif gpus:
        tasks = gpus if res.ntasks_per_node is None else res.ntasks_per_node
        if tasks != gpus:
            raise ValidationError(
                f"--ntasks-per-node={tasks} but --gpus-per-node={gpus}: with the {launcher} launcher each task drives one GPU",
                hint=f"use --ntasks-per-node={gpus} or --gpus-per-node={tasks}",
            )
    else:
        tasks = res.ntasks_per_node or 1

    if res.cpus_per_task is not None:
        cpus = res.cpus_per_task
    elif gpus:
        cpus = min(profile.cpus_per_gpu or part.cpus_per_gpu, part.cpus_per_gpu)
        if launcher == "torchrun":
            cpus *= gpus  # one task per node drives every GPU of it
    else:
        cpus = max(1, part.cpus_per_node // max(tasks, 1))
    workers = res.ntasks_per_node or 1
    if launcher == "torchrun" and not gpus and workers > cpus:
        raise ValidationError(
            f"--ntasks-per-node={workers} torchrun workers per node but --cpus-per-task={cpus}: each worker "
            "needs a core of the node's one task",
            hint=f"use --cpus-per-task={min(workers, part.cpus_per_node)} or more, or fewer workers "
            f"(at most {cpus})" if workers <= part.cpus_per_node else
            f"use at most {part.cpus_per_node} workers per node (the cores of a node of {where})",
        )
    if gpus and cpus > part.cpus_per_gpu and launcher != "torchrun":
        raise ValidationError(
            f"--cpus-per-task={cpus} is more than the {part.cpus_per_gpu} cores per GPU of {where}",
            hint=f"use --cpus-per-task={part.cpus_per_gpu} or fewer",
        )
    total_cpus = cpus * (tasks if launcher != "torchrun" else 1)
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
    job = ResolvedJob(spec, profile, part, res.nodes, gpus, tasks, cpus, time_s, account, spares,
                      res.min_nodes or res.nodes)
    _check_pipeline(job)
    return job


def check_restart_layout(nodes: int, spares: int, min_nodes: int, launcher: str, partition_nodes: int,
                         where: str) -> None:
    """Spare nodes and a shrink floor against the partition and the launcher (pure).

    Raises:
        ValidationError: more nodes and spares than the partition has, or in-job restarts with torchrun.
    """
    if spares and nodes + spares > partition_nodes:
        raise ValidationError(
            f"--nodes={nodes} and --spare-nodes={spares} need {nodes + spares} nodes but {where} has {partition_nodes}",
            hint=f"use --spare-nodes={max(partition_nodes - nodes, 0)} or fewer, or fewer --nodes",
        )
    if launcher == "torchrun" and (spares or 0 < min_nodes < nodes):
        raise ValidationError(
            "--spare-nodes / --min-nodes restart the step inside the job with the srun and horovod launchers; "
            "torchrun has its own elastic restarts",
            hint="use --launcher srun (the ranks get torchrun's variables all the same), or drop "
                 "--spare-nodes and --min-nodes",
        )


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
    per_node = gpus if spec.resources.launcher == "torchrun" else tasks
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
