"""Strategy ``horovod``: Horovod's ranks and gradient allreduce inside the engine's loop.

The engine (:func:`cyclone_kit.runtime.engine.dataparallel.train`) calls three hooks for this strategy:

* :func:`horovod_env` first: ``hvd.init()`` and a :class:`DistEnv` from Horovod's own ranks
  (``hvd.rank()``, ``hvd.size()``, ``hvd.local_rank()`` ...). Who gives Horovod its ranks:

  - ``horovodrun`` (``HOROVOD_RANK`` & co. already set): Horovod's own launcher, nothing to do;
  - an MPI-built Horovod (``hvd.mpi_built()``, e.g. Cyclone's EasyBuild module) started by
    ``srun``/``mpirun``: MPI, through the MPI library's PMI support;
  - any other launcher that cyclone_kit understands (``srun`` with a Gloo-only build, torchrun,
    submitit, ``mpirun`` without Horovod MPI; or ``HOROVOD_CONTROLLER=gloo`` to prefer Gloo over
    MPI): cyclone_kit does what ``horovodrun --gloo`` does, from inside the job. Rank 0 starts
    Horovod's HTTP rendezvous server (:class:`horovod.runner.http.http_server.RendezvousServer`)
    on a free port and publishes the port through a ``torch.distributed.TCPStore`` at
    ``MASTER_ADDR:MASTER_PORT``; every rank sets Horovod's ``HOROVOD_RANK``/``SIZE``/
    ``LOCAL_*``/``CROSS_*``/``GLOO_RENDEZVOUS_*`` variables from its :class:`DistEnv`
    (:func:`gloo_slot_env`, pure) before ``hvd.init()``. No ssh and no second launcher: the
    ranks stay srun's tasks (signals, ``--kill-on-bad-exit``, accounting).

  Rank 0 also picks a TCP address for the engine's small side channel (a gloo process group
  for loss averaging, the stop flag and checkpoint bookkeeping; gradients never use it) and
  broadcasts it with Horovod. The device comes from ``hvd.local_rank()``.
* :func:`wrap_horovod` (the strategy's wrap): broadcast of the parameters from rank 0; no
  wrapper module.
* :func:`distributed_optimizer` after the optimizer exists: ``hvd.DistributedOptimizer``
  (``backward_passes_per_step = train.grad_accum``, fp16 compression when
  ``train.fp16_allreduce``) and the broadcast of the optimizer state from rank 0.

The learning rate is the engine's: scaled by the global batch, i.e. by ``hvd.size()`` x
batch x grad_accum under the linear rule, as in Horovod's examples (``lr * hvd.size()``).
Checkpoints and metrics are the DDP ones (rank 0 writes).

Launch: the sbatch template ``horovod.sbatch.j2`` runs ``srun python -m cyclone_kit.runtime``;
ranks come from MPI/PMI with an MPI-built Horovod, else from the Gloo rendezvous above (so the
Gloo-only build of ``scripts/build-horovod.sh`` runs on Slurm too). Outside Slurm, the local
launcher (``cyclone-kit run --nproc N``) works the same way, and so does
``horovodrun --gloo -np 2 -H localhost:2 --network-interfaces lo python -m cyclone_kit.runtime --run-dir DIR``
(:func:`horovodrun_command`).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from cyclone_kit.core.errors import ValidationError
from cyclone_kit.runtime.env import DistEnv

#: How to get Horovod, for the error when it is not importable.
HOW_TO_GET = ("on the cluster: module load Horovod/<version> (EasyBuild); here: scripts/build-horovod.sh "
              "(Horovod 0.28.1 with Gloo, built against the venv's torch)")


def import_horovod() -> Any:
    """``horovod.torch``, or a one-line ValidationError saying how to get it."""
    try:
        import horovod.torch as hvd
    except Exception as exc:  # ImportError, or OSError/undefined symbol from a broken build
        raise ValidationError(
            f"train.strategy 'horovod' needs Horovod, but 'import horovod.torch' failed "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})",
            hint=HOW_TO_GET,
        ) from None
    return hvd


#: The TCPStore key under which rank 0 publishes the Gloo rendezvous port.
RENDEZVOUS_KEY = "cyclone_kit/horovod_gloo_rendezvous_port"
#: Objects that must live as long as the process: rank 0's rendezvous server and the TCPStore.
_KEEP_ALIVE: list[Any] = []


def uses_gloo_rendezvous(env: DistEnv, environ: Mapping[str, str], mpi_built: bool) -> bool:
    """Whether cyclone_kit must run Horovod's Gloo rendezvous for this process (pure; module doc)."""
    if env.world_size < 2 or "HOROVOD_RANK" in environ:
        return False  # one process, or horovodrun already did it
    return not mpi_built or environ.get("HOROVOD_CONTROLLER", "").lower() == "gloo"


def gloo_slot_env(env: DistEnv, address: str, port: int) -> dict[str, str]:
    """Horovod's per-rank variables for a Gloo rendezvous at ``address:port`` (pure).

    The same variables ``horovodrun --gloo`` gives each slot: ranks and sizes from ``env``
    (cross rank = node index, cross size = nodes), ``HOROVOD_HOSTNAME`` = the node's key in the
    rendezvous scopes, Gloo as controller and CPU operations.

    Raises:
        ValidationError: the nodes run different numbers of ranks (Horovod's cross-node groups
            need one rank per local rank on every node).
    """
    if env.local_world_size * env.num_nodes != env.world_size:
        raise ValidationError(
            f"train.strategy 'horovod': {env.world_size} ranks on {env.num_nodes} node(s) with {env.local_world_size} "
            f"on this one: Horovod's Gloo rendezvous needs the same number of ranks on every node",
            hint="request --ntasks-per-node (resources.ntasks_per_node) instead of a total task count",
        )
    return {
        "HOROVOD_HOSTNAME": node_key(env, env.node_rank),
        "HOROVOD_RANK": str(env.rank), "HOROVOD_SIZE": str(env.world_size),
        "HOROVOD_LOCAL_RANK": str(env.local_rank), "HOROVOD_LOCAL_SIZE": str(env.local_world_size),
        "HOROVOD_CROSS_RANK": str(env.node_rank), "HOROVOD_CROSS_SIZE": str(env.num_nodes),
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": address, "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
        "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
    }


def node_key(env: DistEnv, node_rank: int) -> str:
    """The name of node ``node_rank`` in Horovod's rendezvous scopes: its host name when the
    launcher listed every node, else ``node<k>`` (pure; the same on every rank)."""
    if len(env.hostnames) == env.num_nodes:
        return env.hostnames[node_rank]
    return f"node{node_rank}"


def rendezvous_plan(env: DistEnv) -> list[Any]:
    """Horovod's ``SlotInfo`` for every rank of a homogeneous run (what rank 0's rendezvous
    server needs to size its global, local and cross scopes)."""
    from horovod.runner.common.util.hosts import SlotInfo

    per = env.local_world_size
    return [SlotInfo(hostname=node_key(env, n), rank=n * per + lr, local_rank=lr, cross_rank=n,
                     size=env.world_size, local_size=per, cross_size=env.num_nodes)
            for n in range(env.num_nodes) for lr in range(per)]


def gloo_rendezvous(env: DistEnv, timeout_s: int) -> dict[str, str]:
    """Meet the other ranks at ``MASTER_ADDR:MASTER_PORT`` and return this rank's Horovod
    variables (rank 0 starts the Horovod rendezvous server first; see the module doc)."""
    from horovod.runner.http.http_server import RendezvousServer
    from torch.distributed import TCPStore

    slots = gloo_slot_env(env, env.master_addr, 1)  # checks the layout before anyone waits
    try:
        store = TCPStore(env.master_addr, env.master_port, env.world_size, env.rank == 0,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
    except Exception as exc:
        raise RuntimeError(f"Horovod Gloo rendezvous: no TCPStore at {env.master_addr}:{env.master_port} "
                           f"within {timeout_s} s ({type(exc).__name__}: {exc})") from exc
    _KEEP_ALIVE.append(store)
    if env.rank == 0:
        server = RendezvousServer()
        port = server.start()
        server.init(rendezvous_plan(env))
        _KEEP_ALIVE.append(server)
        store.set(RENDEZVOUS_KEY, str(port))
    port = int(store.get(RENDEZVOUS_KEY).decode())
    return {**slots, "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port)}


def horovod_env(env: DistEnv, environ: Mapping[str, str], timeout_s: int = 600) -> DistEnv:
    """Initialise Horovod and describe this process by Horovod's ranks (see the module doc).

    ``env`` is what the launcher variables said (a single-process view under
    ``horovodrun --gloo``); its host names and job ids are kept. ``timeout_s`` bounds the wait
    for the other ranks at the Gloo rendezvous.
    """
    hvd = import_horovod()
    launcher = "horovodrun" if "HOROVOD_RANK" in environ else env.launcher
    if uses_gloo_rendezvous(env, environ, hvd.mpi_built()):
        os.environ.update(gloo_rendezvous(env, timeout_s))  # Horovod reads them in hvd.init()
    hvd.init()
    size, local_size = hvd.size(), hvd.local_size()
    if env.world_size > 1 and size != env.world_size:
        raise ValidationError(
            f"train.strategy 'horovod': the {env.launcher} launcher started {env.world_size} processes, but Horovod "
            f"sees {size} (each process alone): this Horovod is built with MPI, but MPI did not start the ranks",
            hint="start them with srun --mpi=pmix (or mpirun), or set HOROVOD_CONTROLLER=gloo to let cyclone_kit "
                 "run Horovod's Gloo rendezvous",
        )
    address: list[Any] = [None]
    if hvd.rank() == 0:
        host = _side_channel_host(env, environ, size == local_size)
        with socket.socket() as s:  # a free port on this host
            s.bind(("", 0))
            address = [(host, int(s.getsockname()[1]))]
    host, port = hvd.broadcast_object(address[0], root_rank=0, name="cyclone_kit.side_channel")
    return dataclasses.replace(
        env, rank=hvd.rank(), local_rank=hvd.local_rank(), world_size=size, local_world_size=local_size,
        node_rank=hvd.cross_rank(), num_nodes=max(1, size // local_size), master_addr=host, master_port=port,
        launcher=launcher, hostnames=env.hostnames if len(env.hostnames) == size // local_size else (),
    )


def _side_channel_host(env: DistEnv, environ: Mapping[str, str], one_node: bool) -> str:
    if environ.get("MASTER_ADDR"):
        return environ["MASTER_ADDR"]
    if one_node:
        return "127.0.0.1"
    return env.hostnames[0] if env.hostnames else socket.gethostname()


def wrap_horovod(model: Any, device: Any, train: Any, distributed: bool) -> Any:
    """The strategy's wrap: every rank starts from rank 0's parameters and buffers."""
    hvd = import_horovod()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return model


def distributed_optimizer(optimizer: Any, model: Any, train: Any) -> Any:
    """``hvd.DistributedOptimizer`` over ``optimizer`` (gradients averaged over ``hvd.size()``
    ranks every ``train.grad_accum`` backward passes), its state broadcast from rank 0."""
    hvd = import_horovod()
    compression = hvd.Compression.fp16 if train.fp16_allreduce else hvd.Compression.none
    wrapped = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                       compression=compression, backward_passes_per_step=train.grad_accum)
    hvd.broadcast_optimizer_state(wrapped, root_rank=0)
    _accept_set_to_none(wrapped)
    return wrapped


def _accept_set_to_none(optimizer: Any) -> None:
    """Horovod 0.28's ``zero_grad()`` takes no ``set_to_none`` (the engine passes it); its check
    for pending allreduces is kept, then torch's ``zero_grad(set_to_none)`` runs."""
    import torch

    check = type(optimizer).zero_grad

    def zero_grad(set_to_none: bool = True) -> None:
        if getattr(optimizer, "_handles", None):
            check(optimizer)  # raises Horovod's "zero_grad() before step()" error
        torch.optim.Optimizer.zero_grad(optimizer, set_to_none=set_to_none)

    optimizer.zero_grad = zero_grad


def horovodrun_command(run_dir: str, np: int, hosts: Sequence[str] = ("localhost",), python: str = sys.executable,
                       interface: str | None = "lo") -> list[str]:
    """The ``horovodrun --gloo`` command line that runs the engine on ``run_dir`` with ``np``
    ranks spread evenly over ``hosts`` (for Gloo-only Horovod builds; pure)."""
    if np < 1 or not hosts or np % len(hosts):
        raise ValidationError(f"cannot spread {np} Horovod rank(s) evenly over {len(hosts)} host(s)",
                              hint="use a multiple of the host count")
    per = np // len(hosts)
    cmd = ["horovodrun", "--gloo", "-np", str(np), "-H", ",".join(f"{h}:{per}" for h in hosts)]
    if interface:
        cmd += ["--network-interfaces", interface]
    from cyclone_kit.rundir.entry import trainer_words

    return [*cmd, python, *trainer_words(run_dir)]
