"""The training plan both engines share (the DDP loop and the pipeline): schedule maths and the segment start.

Pure (:func:`scaled_lr`, :func:`lr_factor`, :func:`make_plan`, :func:`resolve_precision`) except
:func:`seed_everything` (the RNGs), :func:`begin_segment` (the session's ``start`` record) and
:func:`shards_in_background` (what this torch can do, said once).
The learning rate is scaled by the global batch (Goyal et al. 2017), warmed up linearly, then
follows a cosine decay.
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass
from typing import Any

import torch

from cyclone_kit.config.job import TrainConfig
from cyclone_kit.core.errors import ValidationError
from cyclone_kit.runtime.session import Session


@dataclass(frozen=True)
class Plan:
    """The derived schedule of a run (pure function of the spec, world size and data size)."""

    per_device_batch: int
    grad_accum: int
    global_batch: int
    lr: float
    warmup_steps: int
    steps_per_epoch: int
    total_steps: int


def scaled_lr(base_lr: float, global_batch: int, base_batch: int, rule: str) -> float:
    """The learning rate for ``global_batch``: linear (Goyal et al.), square-root, or unscaled."""
    ratio = global_batch / base_batch
    if rule == "linear":
        return base_lr * ratio
    if rule == "sqrt":
        return base_lr * math.sqrt(ratio)
    return base_lr


def lr_factor(step: int, warmup_steps: int, total_steps: int) -> float:
    """LR multiplier of 0-based optimizer step ``step``: linear warm-up, then cosine decay to 0."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    decay = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def make_plan(train: TrainConfig, world_size: int, samples_per_rank: int) -> Plan:
    """Batch sizes, scaled LR and step counts; ``train.epochs`` (when > 0) overrides ``train.steps``.

    Raises:
        ValidationError: an epoch would hold no optimizer step (data set too small).
    """
    global_batch = train.batch_size * world_size * train.grad_accum
    steps_per_epoch = samples_per_rank // train.batch_size // train.grad_accum
    if steps_per_epoch < 1:
        raise ValidationError(
            f"the data set gives each of the {world_size} rank(s) {samples_per_rank} samples, fewer than one "
            f"optimizer step of batch_size {train.batch_size} x grad_accum {train.grad_accum}",
            hint="lower train.batch_size or train.grad_accum, or use more data",
        )
    total = train.epochs * steps_per_epoch if train.epochs > 0 else train.steps
    return Plan(
        per_device_batch=train.batch_size,
        grad_accum=train.grad_accum,
        global_batch=global_batch,
        lr=scaled_lr(train.lr, global_batch, train.base_batch_size, train.lr_scaling),
        warmup_steps=min(train.warmup_steps, total),
        steps_per_epoch=steps_per_epoch,
        total_steps=total,
    )


#: Set by the step watcher on a step restarted inside the job: the global batch of the run before it.
GLOBAL_BATCH_VAR = "CYCLONE_GLOBAL_BATCH"


def keep_global_batch(train: TrainConfig, world_size: int, global_batch: int) -> tuple[TrainConfig, str]:
    """``train`` with ``grad_accum`` set so that ``world_size`` ranks keep ``global_batch`` (pure), and what
    was done in words. A world that shrank after an in-job restart accumulates more micro-batches per
    optimizer step, so the global batch, the learning rate and the schedule stay those of the run;
    when ``global_batch`` is not a multiple of ``batch_size x world_size`` (or the strategy is the
    pipeline, whose micro-batches are its own) it is left as it is and said so."""
    import dataclasses

    per_step = train.batch_size * world_size
    now = per_step * train.grad_accum
    if now == global_batch:
        return train, ""
    if train.strategy == "pipeline" or global_batch % per_step:
        return train, (f"global batch {now} (was {global_batch}): {global_batch} is not a whole number of "
                       f"{world_size} rank(s) x batch {train.batch_size}" if train.strategy != "pipeline"
                       else f"global batch {now} (was {global_batch}): the pipeline keeps its micro-batches")
    accum = global_batch // per_step
    return (dataclasses.replace(train, grad_accum=accum),
            f"global batch {global_batch} kept on {world_size} rank(s): grad_accum {train.grad_accum} -> {accum}")


def resolve_precision(requested: str, device_kind: str, bf16_supported: bool) -> str:
    """``auto`` -> bf16 (or fp16) on CUDA, fp32 on CPU; fp16 on CPU falls back to fp32 (pure).

    ``bf16_supported`` must mean *native* bf16 (:attr:`DeviceChoice.native_bf16`, compute
    capability 8.0+): torch's ``is_bf16_supported()`` also says True for emulated bf16 on a V100,
    which is slow there; fp16 with a GradScaler is the V100's mixed precision.
    """
    if device_kind != "cuda":
        return "bf16" if requested == "bf16" else "fp32"
    if requested == "auto":
        return "bf16" if bf16_supported else "fp16"
    if requested == "bf16" and not bf16_supported:
        return "fp16"
    return requested


def engine_start_fields(plan: Any, tc: Any, *, precision: str, strategy: str, step: int,
                        **extra: Any) -> dict[str, Any]:
    """The ``start`` record's fields an engine adds to the session's (batch sizes, model, schedule)."""
    return dict(per_device_batch_size=plan.per_device_batch, global_batch_size=plan.global_batch, model=tc.model,
                dataset=tc.dataset, precision=precision, strategy=strategy, grad_accum=plan.grad_accum, lr=plan.lr,
                total_steps=plan.total_steps, start_step=step, **extra)


def begin_segment(session: Session, plan: Any, tc: Any, *, step: int, **start: Any) -> bool:
    """Open a run segment: the ``start`` record written (rank 0) through the session.

    Returns False, after releasing the stop signal, when the newest checkpoint is already at the
    last step (a requeued or resumed run that has nothing left to do).
    """
    if step >= plan.total_steps:
        if session.env.is_main:
            print(f"cyclone_kit: the newest checkpoint is at step {step} of {plan.total_steps}: nothing to do",
                  flush=True)
        session.stop_flag.uninstall()
        return False
    session.begin(**engine_start_fields(plan, tc, step=step, **start))
    return True


def configure_backends(train: TrainConfig, device_kind: str) -> None:
    """torch's global switches for ``train`` (both engines): deterministic algorithms (cuDNN
    autotuning off) when ``train.deterministic``, else cudnn.benchmark on CUDA."""
    if train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
    elif device_kind == "cuda":
        torch.backends.cudnn.benchmark = True


def shards_in_background(is_main: bool) -> bool:
    """Whether this torch writes DCP checkpoints (FSDP's shards, a pipeline's stages) in the background
    (``async_save`` with a ``process_group``); if not, one line (on the rank where ``is_main``) says they are
    written blocking."""
    import torch.distributed.checkpoint as dcp

    from cyclone_kit.runtime.dist import warn
    from cyclone_kit.runtime.torchcompat import dcp_async_line, has_dcp_async_save

    if has_dcp_async_save(dcp):
        return True
    if is_main:
        warn(dcp_async_line(torch.__version__))
    return False


def seed_everything(seed: int) -> None:
    """Seed Python's, torch's and numpy's generators (the same start on every engine)."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass
