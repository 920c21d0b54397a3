"""Rank bootstrap: who am I, how many are we, where do we meet? (pure, table-testable).

:func:`detect` reads a Mapping passed in (``os.environ`` at the edge, plain dicts in tests) and
returns a frozen :class:`DistEnv`. Detection order, first match wins:

1. **torchrun / torchelastic** (``TORCHELASTIC_RUN_ID``, or ``RANK`` + ``LOCAL_RANK`` +
   ``WORLD_SIZE``). Checked first because ``torchrun`` is often started by ``srun`` with one task
   per node: its children then see both the Slurm variables of the *agent* task and torchrun's
   own, and only torchrun's describe the process.
2. **Slurm srun task** (``SLURM_PROCID`` and ``SLURM_STEP_ID``/``SLURM_STEPID``): ranks from
   ``SLURM_PROCID``/``SLURM_LOCALID``/``SLURM_NODEID``, sizes from the *step* variables
   (``SLURM_STEP_NUM_TASKS``, ``SLURM_STEP_TASKS_PER_NODE`` in its ``2(x3),1`` form,
   ``SLURM_STEP_NODELIST``) falling back to the job's. submitit's Slurm executor starts its
   tasks with srun, so it lands here too (launcher ``"submitit"`` when ``SUBMITIT_EXECUTOR`` is
   set). Inside a Slurm job *without* a step (the batch script itself, or an ``salloc`` shell)
   with more than one task requested, nothing was launched per task: that is the classic
   "forgot srun" mistake and an error, not a silent single-process run.
3. **Open MPI** (``OMPI_COMM_WORLD_RANK`` ...), from ``mpirun``/``horovodrun``.
4. **MPICH / Intel MPI / PMI** (``PMI_RANK``, ``PMI_SIZE``; local rank from ``MPI_LOCALRANKID``).
5. **submitit local executor** (``SUBMITIT_LOCAL_GLOBALID`` ...).
6. **single process** (world size 1), also inside a one-task Slurm job.

Rendezvous: ``MASTER_ADDR``/``MASTER_PORT`` from the environment win; else the first host of the
node list (python-hostlist expansion) and :func:`default_port`, derived from the job and step id.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cyclone_kit.core.errors import ValidationError
from cyclone_kit.core.ports import PORT_BASE, job_port
from cyclone_kit.slurm.hostlist import expand, expand_tasks_per_node

#: Launcher names :func:`detect` reports.
LAUNCHERS = ("torchrun", "slurm", "submitit", "openmpi", "mpich", "single")
_LOCALHOST = "127.0.0.1"


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in a distributed run.

    Attributes:
        rank: global rank, 0 .. world_size-1.
        local_rank: rank among the processes of this node.
        world_size: number of processes in the run.
        local_world_size: processes on this node.
        node_rank: index of this node, 0 .. num_nodes-1.
        num_nodes: nodes in the run.
        master_addr: rendezvous host (rank 0's node).
        master_port: rendezvous TCP port.
        launcher: one of :data:`LAUNCHERS`.
        hostnames: the run's node names in order (empty when the launcher does not say).
        job_id: the scheduler's job id (Slurm, submitit local), else None.
        step_id: the Slurm step id, else None.
        restart_count: how often the job was requeued/restarted (SLURM_RESTART_COUNT,
            TORCHELASTIC_RESTART_COUNT); 0 on the first run.
        host: this process's node name as the launcher knows it (SLURMD_NODENAME, the node
            list at node_rank, or HOSTNAME); empty when unknown (use socket.gethostname()).
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str = _LOCALHOST
    master_port: int = PORT_BASE
    launcher: str = "single"
    hostnames: tuple[str, ...] = ()
    job_id: str | None = None
    step_id: str | None = None
    restart_count: int = 0
    host: str = ""

    def __post_init__(self) -> None:
        check_consistent(self)

    @property
    def is_distributed(self) -> bool:
        """True when more than one process takes part."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """True on global rank 0 (the rank that writes metrics and checkpoints)."""
        return self.rank == 0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (hostnames as a list)."""
        out = dataclasses.asdict(self)
        out["hostnames"] = list(self.hostnames)
        return out


def check_consistent(env: DistEnv) -> None:
    """Raise a ValidationError naming the fix when the numbers of a DistEnv contradict each other."""
    where = f"launcher {env.launcher}"
    if env.world_size < 1 or env.local_world_size < 1 or env.num_nodes < 1:
        raise ValidationError(
            f"{where}: world size {env.world_size}, local world size {env.local_world_size} and "
            f"{env.num_nodes} node(s) must all be at least 1",
            hint="check the launcher's task counts (e.g. srun --ntasks / torchrun --nproc-per-node)",
        )
    if not 0 <= env.rank < env.world_size:
        raise ValidationError(
            f"{where}: rank {env.rank} is outside world size {env.world_size}",
            hint="the rank and size variables come from different launches; start every process with one launcher",
        )
    if not 0 <= env.local_rank < env.local_world_size:
        raise ValidationError(
            f"{where}: local rank {env.local_rank} is outside local world size {env.local_world_size}",
            hint="the tasks per node do not match the processes started on this node; check --ntasks-per-node",
        )
    if not 0 <= env.node_rank < env.num_nodes:
        raise ValidationError(
            f"{where}: node rank {env.node_rank} is outside {env.num_nodes} node(s)",
            hint="the node list does not contain this node; start the tasks with srun inside the allocation",
        )
    if env.local_world_size > env.world_size:
        raise ValidationError(
            f"{where}: {env.local_world_size} processes on this node but world size {env.world_size}",
            hint="set the per-node process count no larger than the total (e.g. --ntasks-per-node <= --ntasks)",
        )
    if not 0 < env.master_port < 65536:
        raise ValidationError(f"{where}: MASTER_PORT {env.master_port} is not a TCP port", hint="use 1024-65535")


def default_port(job_id: str | None, step_id: str | None = None) -> int:
    """The rendezvous port of a job step when MASTER_PORT is not set: :func:`cyclone_kit.core.ports.job_port`."""
    return job_port(job_id, step_id)


def detect(environ: Mapping[str, str]) -> DistEnv:
    """Detect this process's DistEnv from an environment mapping (pure).

    Args:
        environ: the process environment (pass ``os.environ``) or a test table.

    Returns:
        The frozen DistEnv.

    Raises:
        ValidationError: the environment is inconsistent (sizes disagree, rank out of range,
            a multi-task Slurm job without srun, a malformed hostlist or count).
    """
    # 1. torchrun / torchelastic, also when started by srun inside Slurm (it overrides Slurm).
    if environ.get("TORCHELASTIC_RUN_ID") or all(k in environ for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")):
        return _torchrun(environ)
    # 2. a Slurm task started by srun (also submitit's Slurm executor, which uses srun).
    if "SLURM_PROCID" in environ and _slurm_step(environ) is not None:
        return _slurm(environ)
    _check_forgot_srun(environ)
    # 3. Open MPI's mpirun / horovodrun.
    if "OMPI_COMM_WORLD_RANK" in environ:
        return _mpi(environ, "openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                    "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")
    # 4. MPICH / Intel MPI (Hydra) and other PMI launchers.
    if "PMI_RANK" in environ:
        return _mpi(environ, "mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
    # 5. submitit's local executor (its Slurm executor was handled as a Slurm task above).
    if "SUBMITIT_LOCAL_GLOBALID" in environ:
        return _submitit_local(environ)
    # 6. a single process (a laptop, or a one-task Slurm job).
    return _single(environ)


# --------------------------------------------------------------------------- launchers
def _torchrun(environ: Mapping[str, str]) -> DistEnv:
    rank = _int(environ, "RANK", 0)
    world = _int(environ, "WORLD_SIZE", 1)
    local_rank = _int(environ, "LOCAL_RANK", 0)
    local_world = _int(environ, "LOCAL_WORLD_SIZE", world)
    if world % local_world:
        raise ValidationError(
            f"torchrun: WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local_world}",
            hint="start the same --nproc-per-node on every node",
        )
    num_nodes = world // local_world
    node_rank = _int(environ, "GROUP_RANK", rank // local_world)
    hosts = _nodelist(environ, ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")) if "SLURM_JOB_ID" in environ else ()
    if hosts and len(hosts) != num_nodes:
        hosts = ()  # a torchrun run that does not span the whole allocation
    restarts = max(_int(environ, "TORCHELASTIC_RESTART_COUNT", 0), _int(environ, "SLURM_RESTART_COUNT", 0))
    job_id = environ.get("SLURM_JOB_ID") or None
    return DistEnv(
        rank=rank, local_rank=local_rank, world_size=world, local_world_size=local_world,
        node_rank=node_rank, num_nodes=num_nodes,
        master_addr=environ.get("MASTER_ADDR") or (hosts[0] if hosts else _LOCALHOST),
        master_port=_port(environ, job_id, _slurm_step(environ)),
        launcher="torchrun", hostnames=hosts, job_id=job_id, step_id=_slurm_step(environ),
        restart_count=restarts, host=_host(environ, hosts, node_rank),
    )


def _slurm(environ: Mapping[str, str]) -> DistEnv:
    step = _slurm_step(environ)
    rank = _int(environ, "SLURM_PROCID", 0)
    world = _int_first(environ, ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"), 1)
    hosts = _nodelist(environ, ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"))
    node_rank = _int(environ, "SLURM_NODEID", 0)
    local_rank = _int(environ, "SLURM_LOCALID", 0)
    tasks_key = next((k for k in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE") if environ.get(k)), None)
    if tasks_key is not None:
        per_node = expand_tasks_per_node(environ[tasks_key])
        if sum(per_node) != world:
            raise ValidationError(
                f"Slurm: {tasks_key}={environ[tasks_key]} adds up to {sum(per_node)} tasks but the step has {world}",
                hint="make --ntasks equal to --nodes x --ntasks-per-node (or drop --ntasks)",
            )
        if hosts and len(per_node) != len(hosts):
            raise ValidationError(
                f"Slurm: {tasks_key}={environ[tasks_key]} lists {len(per_node)} node(s) but the node list has "
                f"{len(hosts)}: {','.join(hosts)}",
                hint="launch the tasks with srun inside the allocation so the step variables are consistent",
            )
        if not 0 <= node_rank < len(per_node):
            raise ValidationError(
                f"Slurm: SLURM_NODEID={node_rank} is outside the {len(per_node)} node(s) of {tasks_key}",
                hint="start the tasks with srun inside the allocation",
            )
        local_world = per_node[node_rank]
        num_nodes = len(per_node)
    else:
        num_nodes = len(hosts) or _int_first(environ, ("SLURM_STEP_NUM_NODES", "SLURM_NNODES"), 1)
        local_world = world // num_nodes if world % num_nodes == 0 else 1
    job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID") or None
    if not hosts:
        raise ValidationError(
            "Slurm: neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST is set",
            hint="run inside a Slurm allocation with srun (these variables are set by Slurm)",
        )
    launcher = "submitit" if environ.get("SUBMITIT_EXECUTOR") == "slurm" else "slurm"
    return DistEnv(
        rank=rank, local_rank=local_rank, world_size=world, local_world_size=local_world,
        node_rank=node_rank, num_nodes=num_nodes,
        master_addr=environ.get("MASTER_ADDR") or hosts[0],
        master_port=_port(environ, job_id, step), launcher=launcher, hostnames=hosts,
        job_id=job_id, step_id=step, restart_count=_int(environ, "SLURM_RESTART_COUNT", 0),
        host=_host(environ, hosts, node_rank),
    )


def _check_forgot_srun(environ: Mapping[str, str]) -> None:
    """Inside a Slurm job, several tasks requested, but this process is no srun task."""
    if not (environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")):
        return
    if any(k in environ for k in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "SUBMITIT_LOCAL_GLOBALID")):
        return  # mpirun inside an allocation: MPI describes the process
    tasks = _int_first(environ, ("SLURM_NTASKS", "SLURM_NPROCS"), 1)
    if tasks > 1:
        raise ValidationError(
            f"this process runs in Slurm job {environ.get('SLURM_JOB_ID') or environ.get('SLURM_JOBID')} "
            f"which asked for {tasks} tasks, but it is not an srun task (no SLURM_STEP_ID): "
            "the batch script started the training directly, so only 1 of the ranks would exist",
            hint="launch it as 'srun python -m cyclone_kit.runtime ...' (or use a cyclone_kit template)",
        )


def _mpi(environ: Mapping[str, str], launcher: str, rank_k: str, size_k: str, lrank_k: str, lsize_k: str) -> DistEnv:
    rank = _int(environ, rank_k, 0)
    world = _int(environ, size_k, 1)
    if lrank_k not in environ and lsize_k not in environ:
        # No per-node information: assume one node (the only safe guess without MASTER_ADDR).
        local_rank, local_world = rank, world
    else:
        local_rank = _int(environ, lrank_k, 0)
        local_world = _int(environ, lsize_k, world)
    if world % local_world:
        raise ValidationError(
            f"{launcher}: {size_k}={world} is not a multiple of {lsize_k}={local_world}",
            hint="start the same number of processes on every host (e.g. mpirun -npernode N)",
        )
    num_nodes = world // local_world
    if num_nodes > 1 and not environ.get("MASTER_ADDR"):
        raise ValidationError(
            f"{launcher}: {num_nodes} hosts but MASTER_ADDR is not set, so the ranks cannot find rank 0",
            hint="export MASTER_ADDR=<first host> and pass it on (mpirun -x MASTER_ADDR -x MASTER_PORT)",
        )
    job_id = environ.get("SLURM_JOB_ID") or None
    return DistEnv(
        rank=rank, local_rank=local_rank, world_size=world, local_world_size=local_world,
        node_rank=rank // local_world, num_nodes=num_nodes,
        master_addr=environ.get("MASTER_ADDR") or _LOCALHOST,
        master_port=_port(environ, job_id, None), launcher=launcher, job_id=job_id,
        restart_count=_int(environ, "SLURM_RESTART_COUNT", 0), host=_host(environ, (), 0),
    )


def _submitit_local(environ: Mapping[str, str]) -> DistEnv:
    world = _int(environ, "SUBMITIT_LOCAL_NTASKS", 1)
    job_id = environ.get("SUBMITIT_LOCAL_JOB_ID") or None
    return DistEnv(
        rank=_int(environ, "SUBMITIT_LOCAL_GLOBALID", 0), local_rank=_int(environ, "SUBMITIT_LOCAL_LOCALID", 0),
        world_size=world, local_world_size=world, node_rank=0,
        num_nodes=_int(environ, "SUBMITIT_LOCAL_JOB_NUM_NODES", 1),
        master_addr=environ.get("MASTER_ADDR") or _LOCALHOST, master_port=_port(environ, job_id, None),
        launcher="submitit", job_id=job_id, host=_host(environ, (), 0),
    )


def _single(environ: Mapping[str, str]) -> DistEnv:
    job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID") or None
    hosts = _nodelist(environ, ("SLURM_JOB_NODELIST",)) if job_id else ()
    return DistEnv(
        master_addr=environ.get("MASTER_ADDR") or _LOCALHOST, master_port=_port(environ, job_id, None),
        launcher="single", hostnames=hosts[:1], job_id=job_id,
        restart_count=_int(environ, "SLURM_RESTART_COUNT", 0), host=_host(environ, hosts, 0),
    )


# --------------------------------------------------------------------------- helpers
def _slurm_step(environ: Mapping[str, str]) -> str | None:
    return environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID") or None


def _port(environ: Mapping[str, str], job_id: str | None, step_id: str | None) -> int:
    raw = environ.get("MASTER_PORT", "").strip()
    if raw:
        if not raw.isdigit() or not 0 < int(raw) < 65536:
            raise ValidationError(f"MASTER_PORT={raw!r} is not a TCP port", hint="export MASTER_PORT=<1024-65535>")
        return int(raw)
    return default_port(job_id, step_id)


def _nodelist(environ: Mapping[str, str], keys: tuple[str, ...]) -> tuple[str, ...]:
    for key in keys:
        value = environ.get(key, "").strip()
        if value:
            return tuple(expand(value))
    return ()


def _host(environ: Mapping[str, str], hosts: tuple[str, ...], node_rank: int) -> str:
    if environ.get("SLURMD_NODENAME"):
        return environ["SLURMD_NODENAME"]
    if 0 <= node_rank < len(hosts):
        return hosts[node_rank]
    return environ.get("HOSTNAME", "")


def _int(environ: Mapping[str, str], key: str, default: int) -> int:
    raw = environ.get(key)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw.strip())
    except ValueError:
        raise ValidationError(f"{key}={raw!r} is not an integer", hint=f"unset {key} or set it to a number") from None


def _int_first(environ: Mapping[str, str], keys: tuple[str, ...], default: int) -> int:
    for key in keys:
        if environ.get(key, "").strip():
            return _int(environ, key, default)
    return default
