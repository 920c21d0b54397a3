"""Did a user's script train as one job of the launched world? (the launch shim's check)

A rank of a world of N that never joins a process group of N trains alone: the job holds N
ranks and reports world N, but N independent copies of the script ran, each on its own data.
A script that never calls ``init_process_group`` does this; so does a bare
``accelerate.Accelerator()`` on nodes without GPUs unless ACCELERATE_USE_CPU=1
(:func:`cpu_accelerate_default`): it even forms the group of N (``init_process_group(backend=None)``)
and then trains as ``DistributedType.NO``, never communicating over it.

Before the script runs, the shim calls :func:`watch`: an import hook
(:mod:`cyclone_kit.runtime.importhook`) that, once anybody imports ``torch.distributed`` (or
``horovod.torch``), wraps its ``init_process_group`` (``init``) so the
world size of every group the script forms is noted, and its ``destroy_process_group`` so the
collectives run on the groups (their sequence numbers, which every collective advances) are noted
before they are forgotten. Nothing is imported that the script does not import itself. At the
end, :func:`formed_world` and :func:`collectives` say what was seen (also from groups still
alive) and :func:`verdict` the one line the end record, ``status`` and the report use.

A world of one is launched as ``python SCRIPT`` (no RANK, WORLD_SIZE, MASTER_ADDR ...; see
``cyclone_kit.runtime.launch.exports_torchrun_variables``): the shim hands the variables it kept
back to :func:`hold_world_of_one`, and the wrapped ``init_process_group`` sets them just before a
call that reads them from the environment (``init_method`` unset or ``env://``, no ``store``), so a
script that forms its group unconditionally still gets a world of one, as under ``torchrun --nproc 1``.
Stdlib only.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import sys
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from typing import Any

#: The world sizes of the process groups formed on this rank (in call order).
_SEEN: list[int] = []
#: Collectives run on this rank's groups, noted when they were destroyed.
_COLLECTIVES: list[int] = []
#: The torchrun variables a world of one was not given, for an init_process_group that reads them (see the doc).
_HELD: dict[str, str] = {}
#: Marks a wrapper installed here (never wrapped twice).
_MARK = "_cyclone_kit_watched"


def verdict(launched: int, formed: int | None, collectives: int | None = None) -> str:
    """'' when the ranks trained as one job of ``launched`` (or a world of one ran), else the finding (pure).

    ``formed``: the largest process group seen (None: none); ``collectives``: how many ran on the
    groups (None: not known, taken as some).
    """
    if launched <= 1:
        return ""
    if formed is None or formed <= 1:
        return (f"{launched} ranks ran as {launched} independent copies: no process group of world {launched} "
                "was formed, each rank trained alone")
    if formed != launched:
        return f"{launched} ranks formed process groups of {formed}, not one of world {launched}"
    if collectives == 0:
        return (f"{launched} ranks ran as {launched} independent copies: they formed a process group of world "
                f"{launched} but never communicated over it, each rank trained alone")
    return ""


def gpus_present(devices: Iterable[str] | None = None) -> bool:
    """Whether this node has a GPU device file (``/dev/nvidia0`` ..., ``/dev/kfd`` for ROCm)."""
    found = list(devices) if devices is not None else glob.glob("/dev/nvidia[0-9]*") + glob.glob("/dev/kfd")
    return bool(found)


def cpu_accelerate_default(environ: MutableMapping[str, str], gpus: bool) -> bool:
    """ACCELERATE_USE_CPU=1 on a node without GPUs, unless the user set it; True when set here.

    Without it a bare ``accelerate.Accelerator()`` does not join the ranks on CPU (it stays
    ``DistributedType.NO``) and every rank trains alone.
    """
    if gpus or "ACCELERATE_USE_CPU" in environ:
        return False
    environ["ACCELERATE_USE_CPU"] = "1"
    return True


def hold_world_of_one(variables: Mapping[str, str]) -> None:
    """Keep a world of one's torchrun variables for an ``init_process_group`` that reads the environment."""
    _HELD.clear()
    _HELD.update(variables)


def reads_environment(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    """Whether ``init_process_group(*args, **kwargs)`` takes its rendezvous from the environment (pure)."""
    init_method = kwargs.get("init_method", args[1] if len(args) > 1 else None)
    store = kwargs.get("store", args[5] if len(args) > 5 else None)
    return store is None and init_method in (None, "env://")


def _give_held(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    """Set the held variables (those not set since) before a process group that reads them forms."""
    if _HELD and reads_environment(args, kwargs):
        import os

        for name, value in _HELD.items():
            os.environ.setdefault(name, value)
        _HELD.clear()


def _noted(original: Callable[..., Any], world: Callable[[], int], *, torch: bool = False) -> Callable[..., Any]:
    """``original`` that notes ``world()`` after it returned (torch's: gives the held variables first)."""
    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        if torch:
            _give_held(args, kwargs)
        result = original(*args, **kwargs)
        with contextlib.suppress(Exception):
            _SEEN.append(int(world()))
        return result

    setattr(call, _MARK, True)
    return call


def _rebind(name: str, original: Any, wrapper: Any, prefix: str) -> None:
    """Point every loaded ``prefix*`` module's ``name`` that is ``original`` at ``wrapper`` (from-imports)."""
    for key, module in list(sys.modules.items()):
        if (key == prefix or key.startswith(prefix + ".")) and module is not None:
            with contextlib.suppress(Exception):
                if module.__dict__.get(name) is original:
                    module.__dict__[name] = wrapper


def group_collectives(dist: Any) -> int | None:
    """Collectives run so far on every live process group (sum of their sequence numbers); None: unknown."""
    try:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        groups = list(dist.distributed_c10d._world.pg_map)
        return sum(int(group._get_sequence_number_for_group()) for group in groups)
    except Exception:  # another torch: no sequence numbers to read
        return None


def _before_destroy(original: Callable[..., Any], dist: Any) -> Callable[..., Any]:
    """``destroy_process_group`` that notes the groups' collectives first."""
    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        seen = group_collectives(dist)
        if seen is not None:
            _COLLECTIVES.append(seen)
        return original(*args, **kwargs)

    setattr(call, _MARK, True)
    return call


def _patch_torch(module: Any) -> None:
    original = getattr(module, "init_process_group", None)
    if original is not None and not getattr(original, _MARK, False):
        _rebind("init_process_group", original, _noted(original, module.get_world_size, torch=True), "torch")
    destroy = getattr(module, "destroy_process_group", None)
    if destroy is not None and not getattr(destroy, _MARK, False):
        _rebind("destroy_process_group", destroy, _before_destroy(destroy, module), "torch")


def _patch_horovod(module: Any) -> None:
    original = getattr(module, "init", None)
    if original is None or getattr(original, _MARK, False):
        return
    _rebind("init", original, _noted(original, module.size), "horovod")


_PATCHES: Mapping[str, Callable[[Any], None]] = {"torch.distributed": _patch_torch, "horovod.torch": _patch_horovod}


def watch() -> None:
    """Note every process group formed from now on (modules loaded already are patched at once)."""
    from cyclone_kit.runtime.importhook import after_import

    for name, patch in _PATCHES.items():
        after_import(name, patch)


def formed_world() -> int | None:
    """The largest world of a process group this rank formed (noted, or alive now); None: none."""
    worlds = list(_SEEN)
    dist = sys.modules.get("torch.distributed")
    with contextlib.suppress(Exception):
        if dist is not None and dist.is_available() and dist.is_initialized():
            worlds.append(int(dist.get_world_size()))
    hvd = sys.modules.get("horovod.torch")
    with contextlib.suppress(Exception):
        if hvd is not None and hvd.is_initialized():
            worlds.append(int(hvd.size()))
    return max(worlds) if worlds else None


def collectives() -> int | None:
    """The most collectives seen on this rank's groups (at their destruction, or alive now); None: unknown."""
    seen = list(_COLLECTIVES)
    dist = sys.modules.get("torch.distributed")
    alive = group_collectives(dist) if dist is not None else None
    if alive is not None:
        seen.append(alive)
    return max(seen) if seen else None


def launched_world(environ: Mapping[str, str]) -> int:
    """The world the launcher started (WORLD_SIZE as the shim exported it; 1 when unknown; pure)."""
    raw = environ.get("WORLD_SIZE", "")
    return int(raw) if raw.isdigit() else 1


__all__ = ["collectives", "cpu_accelerate_default", "formed_world", "gpus_present", "group_collectives",
           "launched_world", "verdict", "watch"]
