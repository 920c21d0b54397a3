"""Strategy ``horovod``: Horovod's ranks and gradient allreduce inside the engine's loop.

The engine (:func:`cyclone_kit.runtime.train.train`) calls three hooks for this strategy:

* :func:`horovod_env` first: ``hvd.init()`` and a :class:`DistEnv` from Horovod's own ranks
  (``hvd.rank()``, ``hvd.size()``, ``hvd.local_rank()`` ...), whoever started the processes
  (``srun`` with an MPI-built Horovod, ``horovodrun``/``mpirun``, or ``horovodrun --gloo``).
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

Launch: the sbatch template ``horovod.sbatch.j2`` runs ``srun python -m cyclone_kit.runtime``
(ranks from MPI/PMI, for a Horovod built with MPI, e.g. ``module load Horovod/...``). With a
Gloo-only build (``scripts/build-horovod.sh``) start the ranks with
``horovodrun --gloo -np 2 -H localhost:2 --network-interfaces lo python -m cyclone_kit.runtime --run-dir DIR``
(:func:`horovodrun_command`).
"""

from __future__ import annotations

import dataclasses
import socket
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from cyclone_kit.errors import ValidationError
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


def horovod_env(env: DistEnv, environ: Mapping[str, str]) -> DistEnv:
    """Initialise Horovod and describe this process by Horovod's ranks (see the module doc).

    ``env`` is what the launcher variables said (it may be a single-process view under
    ``horovodrun --gloo``); its host names and job ids are kept.
    """
    hvd = import_horovod()
    hvd.init()
    size, local_size = hvd.size(), hvd.local_size()
    if env.world_size > 1 and size != env.world_size:
        raise ValidationError(
            f"train.strategy 'horovod': the {env.launcher} launcher started {env.world_size} processes, but Horovod "
            f"sees {size} (each process alone): its ranks did not come from Horovod's launcher or MPI",
            hint="start the ranks with horovodrun (horovodrun --gloo -np N -H host:N python -m cyclone_kit.runtime "
                 "--run-dir DIR) or with srun and an MPI-built Horovod (templates/horovod.sbatch.j2)",
        )
    address: list[Any] = [None]
    if hvd.rank() == 0:
        host = _side_channel_host(env, environ, size == local_size)
        with socket.socket() as s:  # a free port on this host
            s.bind(("", 0))
            address = [(host, int(s.getsockname()[1]))]
    host, port = hvd.broadcast_object(address[0], root_rank=0, name="cyclone_kit.side_channel")
    launcher = "horovodrun" if "HOROVOD_RANK" in environ else env.launcher
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
    return [*cmd, python, "-m", "cyclone_kit.runtime", "--run-dir", str(run_dir)]
