"""Sharded FSDP checkpoints with torch.distributed.checkpoint (``checkpoint.sharded = true``).

Every rank writes its own shards of the model and optimizer state into
``checkpoints/ckpt-NNNNNNNNN.dcp/`` (no rank ever holds the full model, unlike the default
full-state checkpoint that gathers everything on rank 0). The engine's small
``ckpt-NNNNNNNNN.pt`` (scheduler, step, sampler position, RNG) is written by rank 0 only after
every shard is in place, and names the shard directory; so a ``.pt`` file that exists is a
complete checkpoint, and the engine's newest-loadable-checkpoint logic and ``keep`` apply
unchanged. Shard directories without their ``.pt`` are removed by :func:`prune`.

With ``checkpoint.async_write`` (the default) every rank writes its shards in the background
(:func:`start_sharded`: ``async_save``, the copy to host memory at the step, the write in a thread);
the ``.pt`` is written when the next checkpoint starts, at the end of the segment or before a
stop/requeue, once every rank's write is done and the ranks agreed on it (``Session.finish_shards``).
A torch without ``async_save`` writes them blocking (:func:`save_sharded`), with one line.

Resuming needs the same number of ranks only for the RNG streams: DCP reshards the tensors.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from torch import nn

from cyclone_kit.runtime.dist import side_group

#: The optimizer_format of a checkpoint whose model and optimizer live in a DCP directory.
FORMAT = "dcp"


def shard_dir_name(step: int) -> str:
    """The DCP directory of the checkpoint after ``step`` (next to ``ckpt-<step>.pt``)."""
    return f"ckpt-{step:09d}.dcp"


def fresh_target(folder: Path, step: int) -> Path:
    """The shard directory of ``step``, empty on every rank's return (rank 0 removes one left by a run
    killed between its shards and its ``.pt``; the others wait for it on the gloo side group)."""
    import torch.distributed as dist

    target = Path(folder) / shard_dir_name(step)
    if dist.get_rank() == 0:
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():  # left by a run killed between the shards and the .pt file
            shutil.rmtree(target)
    dist.barrier(group=side_group())  # rank 0 may take long to remove a stale folder: wait on gloo
    return target


def _states(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}


def _entries(step: int) -> dict[str, Any]:
    return {"model": {"dcp": shard_dir_name(step)}, "optimizer": None, "optimizer_format": FORMAT}


def save_sharded(folder: Path, step: int, model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """Write this rank's shards (a collective: every rank calls it); returns the entries for the
    ``.pt`` state (``model`` names the directory, ``optimizer_format`` is :data:`FORMAT`)."""
    import torch.distributed.checkpoint as dcp

    target = fresh_target(folder, step)
    dcp.save(_states(model, optimizer), checkpoint_id=str(target))
    return _entries(step)


def start_sharded(folder: Path, step: int, model: nn.Module, optimizer: Any) -> tuple[dict[str, Any], Any]:
    """Start writing this rank's shards in the background (a collective: every rank calls it, at the
    same step); returns the ``.pt`` entries (as :func:`save_sharded`) and the write's future.

    ``torch.distributed.checkpoint.async_save`` copies the shards to host memory here (later optimizer
    steps cannot reach the files), then plans and writes them in a thread of its own, whose collectives
    go over :func:`~cyclone_kit.runtime.dist.background_group`. The shard directory holds no ``.pt``
    until every rank's future is done (``Session.finish_shards``): until then it is no checkpoint, and
    :func:`prune` removes it if the run dies first. Call only with no other write in flight.
    """
    import torch.distributed.checkpoint as dcp

    from cyclone_kit.runtime.dist import background_group

    target = fresh_target(folder, step)
    group = background_group()  # a collective the first time: every rank is here, at this step
    future = dcp.async_save(_states(model, optimizer), checkpoint_id=str(target), process_group=group)
    return _entries(step), future


def is_sharded(state: dict[str, Any]) -> bool:
    """True for the ``.pt`` state of a sharded checkpoint."""
    return state.get("optimizer_format") == FORMAT


def load_sharded(folder: Path, state: dict[str, Any], model: nn.Module, optimizer: Any) -> None:
    """Load the shards named by ``state`` into the FSDP ``model`` and ``optimizer`` (a collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    target = Path(folder) / state["model"]["dcp"]
    if not target.is_dir():
        raise FileNotFoundError(f"the shards of checkpoint step {state['step']} are missing: {target}")
    current = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(current, checkpoint_id=str(target))
    set_model_state_dict(model, current["model"])
    set_optimizer_state_dict(model, optimizer, current["optim"])


def prune(folder: Path) -> None:
    """Remove shard directories whose ``.pt`` file is gone (dropped by ``keep``, or never written)."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    for d in folder.glob("ckpt-*.dcp"):
        if d.is_dir() and not (folder / f"{d.name[:-4]}.pt").exists():
            shutil.rmtree(d, ignore_errors=True)
