"""Pipeline checkpoints with torch.distributed.checkpoint, under the full model's names.

Every rank writes the tensors of its stages into ``checkpoints/ckpt-NNNNNNNNN.dcp/`` as one flat
state dict: ``model.<name>`` for each entry of the *unsplit* model's state dict and
``momentum.<name>`` for each parameter's SGD momentum. Replicas of a stage hold the same tensors;
DCP's planner writes each key once. Rank 0's small ``ckpt-NNNNNNNNN.pt`` (scheduler, step,
sampler position, RNG, the split) names the directory and is written after every shard, so a
``.pt`` that exists is a complete checkpoint (:func:`cyclone_kit.runtime.checkpoint.fsdp.prune`
removes directories left without one). With ``checkpoint.async_write`` (the default) the stages are
written as FSDP's shards are (:func:`start_stages`): copied to host memory at the step, written in
DCP's thread, the ``.pt`` once every rank's write is done (``Session.finish_shards``).

Because the names are the full model's, a DDP run on any number of ranks loads the weights and
momentum (:func:`load_full`), and a pipeline with another split loads its own share.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cyclone_kit.runtime.checkpoint.fsdp import fresh_target, shard_dir_name
from cyclone_kit.runtime.dist import side_group

#: The optimizer_format of a pipeline checkpoint (tensors in a DCP directory).
FORMAT = "pipeline-dcp"
MODEL, MOMENTUM = "model.", "momentum."


def _named(modules: Sequence[Any]) -> tuple[dict[str, torch.Tensor], dict[str, nn.Parameter]]:
    """(full name -> state tensor, full name -> parameter) of the stage modules."""
    tensors: dict[str, torch.Tensor] = {}
    params: dict[str, nn.Parameter] = {}
    for module in modules:
        names = module.full_names()
        for key, value in module.state_dict().items():
            tensors[names[key]] = value
        for key, p in module.named_parameters():
            params[names[key]] = p
    return tensors, params


def flat_state(tensors: Mapping[str, torch.Tensor], params: Mapping[str, Any], optimizer: Any) -> dict[str, Any]:
    """The flat DCP state: ``model.<name>`` tensors and ``momentum.<name>`` buffers (those that exist)."""
    state: dict[str, Any] = {MODEL + k: v for k, v in tensors.items()}
    for name, p in params.items():
        buf = optimizer.state.get(p, {}).get("momentum_buffer")
        if buf is not None:
            state[MOMENTUM + name] = buf
    return state


def save_stages(folder: Path, step: int, modules: Sequence[Any], optimizer: Any) -> dict[str, Any]:
    """Write this rank's stages (a collective: every rank calls it); the entries for the ``.pt``."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    folder = Path(folder)
    name = shard_dir_name(step)
    target = folder / name
    main = not dist.is_initialized() or dist.get_rank() == 0
    if main:
        folder.mkdir(parents=True, exist_ok=True)
        if target.exists():  # left by a run killed between the shards and the .pt file
            shutil.rmtree(target)
    if dist.is_initialized():
        dist.barrier(group=side_group())
    tensors, params = _named(modules)
    dcp.save(flat_state(tensors, params, optimizer), checkpoint_id=str(target))
    return _entries(step)


def start_stages(folder: Path, step: int, modules: Sequence[Any], optimizer: Any) -> tuple[dict[str, Any], Any]:
    """Start writing this rank's stages in the background (a collective: every rank calls it, at the same
    step); returns the ``.pt`` entries (as :func:`save_stages`) and the write's future.

    As :func:`cyclone_kit.runtime.checkpoint.fsdp.start_sharded`: ``async_save`` copies the tensors and the
    momentum to host memory here (later optimizer steps cannot reach the files), then plans and writes them in
    its own thread over :func:`~cyclone_kit.runtime.dist.background_group`. Until every rank's future is done
    the directory has no ``.pt`` and is no checkpoint. Call only with no other write in flight.
    """
    import torch.distributed.checkpoint as dcp

    from cyclone_kit.runtime.dist import background_group

    target = fresh_target(folder, step)
    group = background_group()  # a collective the first time: every rank is here, at this step
    tensors, params = _named(modules)
    future = dcp.async_save(flat_state(tensors, params, optimizer), checkpoint_id=str(target), process_group=group)
    return _entries(step), future


def _entries(step: int) -> dict[str, Any]:
    return {"model": {"dcp": shard_dir_name(step)}, "optimizer": None, "optimizer_format": FORMAT}


def _load(target: Path, tensors: Mapping[str, torch.Tensor], params: Mapping[str, nn.Parameter],
          optimizer: Any) -> None:
    """Read ``tensors`` (in place) and the momentum of ``params`` present in the DCP at ``target``."""
    import torch.distributed.checkpoint as dcp

    if not target.is_dir():
        raise FileNotFoundError(f"the tensors of the pipeline checkpoint are missing: {target}")
    keys = set(dcp.FileSystemReader(str(target)).read_metadata().state_dict_metadata)
    state: dict[str, Any] = {MODEL + k: v for k, v in tensors.items()}
    missing = [k for k in state if k not in keys]
    if missing:
        raise KeyError(f"checkpoint {target.name} lacks {len(missing)} tensor(s) of this model, e.g. {missing[0]}")
    buffers = {n: torch.zeros_like(p) for n, p in params.items() if MOMENTUM + n in keys}
    state.update({MOMENTUM + n: b for n, b in buffers.items()})
    dcp.load(state, checkpoint_id=str(target))
    for n, buf in buffers.items():
        optimizer.state[params[n]]["momentum_buffer"] = buf


def load_stages(target: Path, modules: Sequence[Any], optimizer: Any) -> None:
    """Load this rank's stages and their momentum from a pipeline checkpoint (a collective)."""
    tensors, params = _named(modules)
    with torch.no_grad():
        _load(Path(target), tensors, params, optimizer)


def load_full(target: Path, model: nn.Module, optimizer: Any) -> None:
    """Load a pipeline checkpoint into an unsplit model and its SGD (a DDP run; a collective)."""
    with torch.no_grad():
        _load(Path(target), model.state_dict(), dict(model.named_parameters()), optimizer)


def load_from_full(state: Mapping[str, Any], modules: Sequence[Any], optimizer: Any,
                   param_order: Sequence[str]) -> bool:
    """Load this rank's share of a DDP/FSDP/Horovod checkpoint (the full model's state dict);
    returns whether the momentum came too (the engine's ``torch`` or ``fqn`` optimizer formats).
    ``param_order``: the unsplit model's parameter names in order (a torch optimizer state's keys)."""
    tensors, params = _named(modules)
    full = state["model"]
    with torch.no_grad():
        for name, t in tensors.items():
            t.copy_(full[name])
    opt, fmt = state.get("optimizer") or {}, state.get("optimizer_format")
    if fmt == "fqn":
        by_name = {n: s.get("momentum_buffer") for n, s in (opt.get("state") or {}).items()}
    elif fmt in (None, "torch") and "state" in opt:
        # a torch optimizer state is keyed by parameter index, in the unsplit model's order
        by_name = {param_order[i]: s.get("momentum_buffer") for i, s in opt["state"].items() if i < len(param_order)}
    else:
        return False
    for name, p in params.items():
        buf = by_name.get(name)
        if buf is not None:
            optimizer.state[p]["momentum_buffer"] = buf.to(p.device, p.dtype).clone()
    return True


def sync_lr(optimizer: Any, scheduler: Any) -> None:
    """Set the optimizer's learning rates to a just-restored scheduler's (a pipeline checkpoint
    holds no torch optimizer state dict, which would otherwise carry them)."""
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr(), strict=True):
        group["lr"] = lr
