"""What the installed torch offers beyond the declared floor (``torch>=2.6``): feature tests, each
with the one line that says what is off without it.

The code uses three APIs newer than 2.6 (checked against the released wheels' sources):

* pipelining schedules' ``scale_grads`` argument (torch 2.7; 2.6 never rescales the gradients, which
  is what the engine asks for with ``scale_grads=False``): passed only where it is accepted;
* ``schedule.eval()`` (torch 2.9): the pipeline's validation forward; without it the pipeline's
  validation is skipped with one line (training, checkpoints and the report's bubble are unaffected);
* FSDP2's ``set_custom_all_gather`` / ``set_custom_reduce_scatter`` (torch 2.9): the FSDP engine's
  communication timing; without them its ``comm_time_s`` / ``comm_exposed_s`` are null, with one line.

Asynchronous sharded checkpoints (``checkpoint.sharded`` with ``checkpoint.async_write``) start
``torch.distributed.checkpoint.async_save`` with a ``process_group`` (:func:`has_dcp_async_save`); a torch
without it writes the shards with the blocking ``save``, with one line (:func:`dcp_async_line`).

One is not optional: FSDP2 on the CPU (gloo) needs ``torch.cpu.Stream.record_event`` (torch 2.7); under
torch 2.6 its first all-gather raises AttributeError, so ``train.strategy=fsdp`` on the CPU is refused
before training (:func:`fsdp_cpu_refusal`). FSDP on GPUs has CUDA streams and is not affected.

The 1F1B schedules are refused where they were seen to hang: ``train.pipeline_schedule=1f1b`` on gloo (the
CPU) under torch 2.6.0 hangs in its first step, every stage waiting in the schedule's batched send/receive
(2 stages, 1 and 2 replicas; ``interleaved_1f1b`` too; ``gpipe`` completes on the same torch), while torch
2.13 and 2.14 complete both. The releases between were not run, so the refusal covers torch < 2.13 on gloo
(:func:`pipeline_schedule_refusal`); NCCL (GPUs) is not refused.
"""

from __future__ import annotations

import inspect
from typing import Any

from cyclone_kit.core.version import torch_release

#: The release that brought each optional feature (for the lines below).
SCHEDULE_EVAL_SINCE = "2.9"
FSDP_CUSTOM_COMMS_SINCE = "2.9"


def schedule_kwargs(schedule_cls: Any) -> dict[str, Any]:
    """The keyword arguments that make ``schedule_cls`` leave the gradients unscaled (the engine's
    ``loss_fn`` carries 1/M): ``scale_grads=False`` where the constructor takes it (torch 2.7+), none
    before (torch 2.6 never rescales)."""
    try:
        params = inspect.signature(schedule_cls.__init__).parameters
    except (TypeError, ValueError):  # no signature to read: ask for it, a TypeError then names the mismatch
        return {"scale_grads": False}
    return {"scale_grads": False} if "scale_grads" in params else {}


def has_schedule_eval(schedule: Any) -> bool:
    """Whether the pipelining schedule runs a forward-only pass (``schedule.eval``, torch 2.9+)."""
    return callable(getattr(schedule, "eval", None))


def schedule_eval_line(version: str) -> str:
    """The one line of a pipeline run whose torch has no ``schedule.eval``."""
    return (f"pipeline validation skipped: torch {version} has no schedule.eval() (torch >= {SCHEDULE_EVAL_SINCE}); "
            "no val_accuracy is recorded, training is unaffected")


def has_fsdp_custom_comms(modules: Any) -> bool:
    """Whether every FSDP2 unit of ``modules`` takes custom collectives (``set_custom_all_gather`` and
    ``set_custom_reduce_scatter``, torch 2.9+)."""
    return all(callable(getattr(m, "set_custom_all_gather", None)) and
               callable(getattr(m, "set_custom_reduce_scatter", None)) for m in modules)


def fsdp_comms_line(version: str) -> str:
    """The one line of an FSDP run whose torch cannot time its collectives."""
    return (f"FSDP communication timing off: torch {version} has no FSDPModule.set_custom_all_gather "
            f"(torch >= {FSDP_CUSTOM_COMMS_SINCE}); comm_time_s and comm_exposed_s are null, training is unaffected")


def has_dcp_async_save(dcp: Any) -> bool:
    """Whether ``dcp`` (``torch.distributed.checkpoint``) has ``async_save`` taking a ``process_group``
    (the engine passes its own gloo group, so the background planning has a group of its own)."""
    fn = getattr(dcp, "async_save", None)
    if not callable(fn):
        return False
    try:
        return "process_group" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read: call it, a TypeError would name the mismatch
        return True


def dcp_async_line(version: str) -> str:
    """The one line of a sharded run with asynchronous writes whose torch has no usable ``async_save``."""
    return (f"sharded checkpoints are written blocking: torch {version} has no "
            "torch.distributed.checkpoint.async_save(process_group=...); every rank waits for its shards at "
            "each checkpoint (checkpoint.async_write still applies to full-state checkpoints)")


def fsdp_runs_on_cpu(cpu_stream_cls: Any) -> bool:
    """Whether FSDP2 can run on CPU streams: ``torch.cpu.Stream`` has ``record_event`` (torch 2.7+)."""
    return callable(getattr(cpu_stream_cls, "record_event", None))


def fsdp_cpu_refusal(version: str) -> tuple[str, str]:
    """(error, hint) for ``train.strategy=fsdp`` on the CPU under a torch whose FSDP2 cannot run there."""
    return (f"train.strategy=fsdp on the CPU needs torch >= 2.7: torch {version}'s FSDP2 records events on CPU "
            "streams, which have no record_event there (AttributeError at the first all-gather)",
            "install torch>=2.7, or use train.strategy=ddp on the CPU (FSDP on GPUs works with this torch)")


#: The oldest torch whose 1F1B schedules were seen to complete on gloo (2.6.0 hangs; 2.7-2.12 not run).
GLOO_1F1B_SINCE = (2, 13)
#: The schedules that hang on gloo under an older torch (``gpipe`` does not).
GLOO_HANGING_SCHEDULES = ("1f1b", "interleaved_1f1b")


def pipeline_schedule_refusal(schedule: str, device_kind: str, version: str) -> tuple[str, str] | None:
    """(error, hint) when ``schedule`` would hang on this device's backend under torch ``version``, else None."""
    release = torch_release(version) or GLOO_1F1B_SINCE  # an unreadable version: not refused
    if device_kind != "cpu" or schedule not in GLOO_HANGING_SCHEDULES or release >= GLOO_1F1B_SINCE:
        return None
    since = ".".join(map(str, GLOO_1F1B_SINCE))
    return (f"train.pipeline_schedule={schedule} on the CPU (gloo) hangs in its first step under torch {version} "
            f"(seen with 2.6.0; it completes from torch {since})",
            f"use --set train.pipeline_schedule=gpipe, or install torch>={since} (GPUs with NCCL are not affected)")
