"""Sharded FSDP checkpoints with torch.distributed.checkpoint (``checkpoint.sharded = true``).

Every rank writes its own shards of the model and optimizer state into
``checkpoints/ckpt-NNNNNNNNN.dcp/`` (no rank ever holds the full model, unlike the default
full-state checkpoint that gathers everything on rank 0). The engine's small
``ckpt-NNNNNNNNN.pt`` (scheduler, step, sampler position, RNG) is written by rank 0 only after
every shard is in place, and names the shard directory; so a ``.pt`` file that exists is a
complete checkpoint, and the engine's newest-loadable-checkpoint logic and ``keep`` apply
unchanged. Shard directories without their ``.pt`` are removed by :func:`prune`.

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


def save_sharded(folder: Path, step: int, model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """Write this rank's shards (a collective: every rank calls it); returns the entries for the
    ``.pt`` state (``model`` names the directory, ``optimizer_format`` is :data:`FORMAT`)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    folder = Path(folder)
    name = shard_dir_name(step)
    target = folder / name
    if dist.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        if target.exists():  # left by a run killed between the shards and the .pt file
            shutil.rmtree(target)
    dist.barrier(group=side_group())  # rank 0 may take long to remove a stale folder: wait on gloo
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=str(target))
    return {"model": {"dcp": name}, "optimizer": None, "optimizer_format": FORMAT}


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
