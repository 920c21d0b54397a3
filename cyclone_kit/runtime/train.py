"""The training engine: data-parallel training of a torchvision model, with metrics and checkpoints.

The schedule maths (:func:`scaled_lr`, :func:`lr_factor`, :func:`make_plan`,
:func:`resolve_precision`) is pure; :func:`train` is the loop. Properties it keeps:

* **Correct DDP**: N ranks with batch B follow the same trajectory as 1 rank with batch N*B
  (gradients averaged; the learning rate scaled by the global batch, Goyal et al. 2017).
* **No per-step host syncs**: the loss stays on the device and is read (and averaged across
  ranks) only every ``train.log_every`` steps; the stop flag travels on a separate gloo group.
* **Exact resume**: a checkpoint after step s holds everything needed to continue with step
  s+1 seeing the same batches, LR and RNG as an uninterrupted run.
* **Strategies** are a small dispatch table (:data:`STRATEGIES`): DDP and FSDP2
  (``fully_shard``; checkpoints hold full, unsharded state dicts); others raise a
  ValidationError until they are added.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import socket
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cyclone_kit import __version__
from cyclone_kit.config import JobSpec, TrainConfig
from cyclone_kit.errors import CommandError, ValidationError
from cyclone_kit.rundir import RunDir
from cyclone_kit.runtime import checkpoint as ckpt
from cyclone_kit.runtime import metrics as mx
from cyclone_kit.runtime import power
from cyclone_kit.runtime.data import Data, auto_workers, build_data
from cyclone_kit.runtime.dist import (
    DeviceChoice,
    init_process_group,
    probe_device,
    setup_threads,
    side_group,
    warn,
    worker_cpus,
)
from cyclone_kit.runtime.env import DistEnv
from cyclone_kit.runtime.models import build_model
from cyclone_kit.runtime.signals import NONE, StopAgreement, StopFlag, requeue, should_requeue, under_slurm


# --------------------------------------------------------------------------- pure schedule maths
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


# --------------------------------------------------------------------------- strategies
def place_model(model: nn.Module, dev: torch.device, strategy: str, channels_last: bool) -> nn.Module:
    """Move ``model`` to ``dev``; with ``channels_last``, its conv weights too, except under FSDP:
    ``fully_shard`` refuses non-contiguous parameters ("FSDP does not support non-contiguous
    parameters", torch 2.14), and channels_last inputs alone give channels_last convolutions."""
    model = model.to(dev)
    if channels_last and strategy != "fsdp":
        model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    return model


def optimizer_step(optimizer: torch.optim.Optimizer, scaler: Any, horovod: bool = False) -> None:
    """One optimizer update, through ``scaler`` (fp16) when given.

    With Horovod the gradients are still being all-reduced asynchronously when backward
    returns; ``scaler.step`` would unscale them while Horovod writes the reduced (still scaled)
    values over them, and each rank would judge inf/NaN on its own gradients. Horovod's AMP
    order: ``synchronize()`` (wait for the averaged gradients), ``unscale_``, then ``step``
    inside ``skip_synchronize()``.
    """
    if scaler is None:
        optimizer.step()
        return
    if horovod:
        optimizer.synchronize()  # type: ignore[attr-defined]
        scaler.unscale_(optimizer)
        with optimizer.skip_synchronize():  # type: ignore[attr-defined]
            scaler.step(optimizer)
    else:
        scaler.step(optimizer)
    scaler.update()


def use_static_graph(train: TrainConfig) -> bool:
    """Whether DDP gets ``static_graph=True`` (pure): when the spec allows it (the default) and
    it is valid. The built-in models run the same graph every step, but DDP's static graph
    breaks ``no_sync`` (gradient accumulation: an internal assert in the reducer, torch 2.14)
    and is not combined with torch.compile's DDP optimizer here."""
    return train.static_graph and train.grad_accum == 1 and not train.compile


def _wrap_ddp(model: nn.Module, device: DeviceChoice, train: TrainConfig, distributed: bool) -> nn.Module:
    if not distributed:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(
        model,
        device_ids=[device.index] if device.kind == "cuda" else None,
        gradient_as_bucket_view=True,
        bucket_cap_mb=train.bucket_cap_mb,
        static_graph=use_static_graph(train),
    )


def _wrap_fsdp(model: nn.Module, device: DeviceChoice, train: TrainConfig, distributed: bool) -> nn.Module:
    """FSDP2 (``fully_shard``): every parameterised block, then the root, sharded over all ranks."""
    if not distributed:
        return model
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.kind, (dist.get_world_size(),))
    for block in _shard_units(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


#: Blocks smaller than this stay in their parent's FSDP unit (one collective per tiny layer costs more than it saves).
FSDP_MIN_UNIT_PARAMS = 100_000


def _shard_units(model: nn.Module) -> list[nn.Module]:
    """The blocks FSDP shards separately: the outermost elements of Sequential/ModuleList
    containers (ResNet blocks, MobileNet stages, ViT encoder layers) with at least
    :data:`FSDP_MIN_UNIT_PARAMS` parameters; the rest is sharded with the root."""
    units: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        container = isinstance(module, nn.Sequential | nn.ModuleList)
        for child in module.children():
            if container and sum(p.numel() for p in child.parameters()) >= FSDP_MIN_UNIT_PARAMS:
                units.append(child)
            else:
                visit(child)

    visit(model)
    return units


#: strategy name -> wrap(model, device, train, distributed) -> model. Add Horovod/pipeline here.
STRATEGIES: dict[str, Callable[[nn.Module, DeviceChoice, TrainConfig, bool], nn.Module]] = {
    "ddp": _wrap_ddp,
    "fsdp": _wrap_fsdp,
    "horovod": lambda *args: _hvd().wrap_horovod(*args),
}


def _hvd() -> Any:
    """cyclone_kit.runtime.hvd (Horovod hooks), imported only for strategy 'horovod'."""
    from cyclone_kit.runtime import hvd

    return hvd


def _pipeline_engine() -> Callable[..., str]:
    from cyclone_kit.runtime.pipeline import train_pipeline

    return train_pipeline


#: strategy name -> () -> a train() of its own (same signature and metrics contract); imported lazily.
ENGINES: dict[str, Callable[[], Callable[..., str]]] = {"pipeline": _pipeline_engine}


def wrap_model(strategy: str, model: nn.Module, device: DeviceChoice, train: TrainConfig, distributed: bool) -> nn.Module:
    """Wrap ``model`` for ``strategy``.

    Raises:
        ValidationError: the strategy is not available in this runtime yet.
    """
    if strategy not in STRATEGIES:
        raise ValidationError(
            f"train.strategy {strategy!r} is not available yet in the cyclone_kit runtime",
            hint=f"use one of: {', '.join(STRATEGIES)}",
        )
    return STRATEGIES[strategy](model, device, train, distributed)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module inside torch.compile and DDP wrappers."""
    model = getattr(model, "_orig_mod", model)
    return getattr(model, "module", model)


# --------------------------------------------------------------------------- the engine
@dataclass
class _Window:
    """Timing of the steps since the last log line (host clock; synced at log steps)."""

    start: float
    steps: int = 0
    data_s: float = 0.0


def start_record(run_dir: Path, env: DistEnv, environ: Mapping[str, str], plan: Any, tc: Any, *, precision: str,
                 strategy: str, launcher: str, device: Any, hostnames: list[str], threads: int, step: int,
                 **extra: Any) -> dict[str, Any]:
    """The metrics contract's ``start`` record of one run segment (shared by every engine)."""
    return mx.record(
        "start", run_id=run_dir.name, world_size=env.world_size, num_nodes=env.num_nodes,
        local_world_size=env.local_world_size, per_device_batch_size=plan.per_device_batch,
        global_batch_size=plan.global_batch, model=tc.model, dataset=tc.dataset, precision=precision,
        strategy=strategy, launcher=launcher, device=device.kind, device_name=device.name,
        hostnames=hostnames, slurm_job_id=environ.get("SLURM_JOB_ID") if under_slurm(environ) else None,
        time=mx.utc_now(), versions=_versions(),
        git_commit=mx.git_commit(environ.get("SLURM_SUBMIT_DIR") or os.getcwd()) if env.is_main else None,
        restart_count=env.restart_count, grad_accum=plan.grad_accum, lr=plan.lr, total_steps=plan.total_steps,
        threads=threads, start_step=step, **extra,
    )


def begin_segment(run_dir: Path, env: DistEnv, environ: Mapping[str, str], plan: Any, tc: Any, stop_flag: Any, *,
                  step: int, **start: Any) -> mx.MetricsWriter | None:
    """Open a run segment: its metrics writer with the ``start`` record written (rank 0 writes).

    Returns None, after releasing the stop signal, when the newest checkpoint is already at the
    last step (a requeued or resumed run that has nothing left to do).
    """
    if step >= plan.total_steps:
        if env.is_main:
            print(f"cyclone_kit: the newest checkpoint is at step {step} of {plan.total_steps}: nothing to do",
                  flush=True)
        stop_flag.uninstall()
        return None
    writer = mx.MetricsWriter(run_dir / mx.METRICS_FILE if env.is_main else None)
    writer.write(start_record(run_dir, env, environ, plan, tc, step=step, **start))
    return writer


def train(spec: JobSpec, run_dir: Path, env: DistEnv, environ: Mapping[str, str],
          stop_flag: StopFlag | None = None) -> str:
    """Train ``spec`` on this rank; returns the end status (``completed`` or ``preempted``).

    Writes ``metrics.jsonl`` (rank 0), ``ranks/rank-NNNNN.json`` and checkpoints under
    ``run_dir``; resumes from the newest loadable checkpoint when ``checkpoint.resume``. On a
    requeue signal under Slurm it checkpoints and requeues the job (see signals). Pass an
    installed ``stop_flag`` to catch signals that arrive before training starts.

    Raises:
        ValidationError: bad data, model or strategy; anything else is a real failure (the
            caller writes the error record). A ``failed`` end record is written before raising.
    """
    if spec.train.strategy in ENGINES:  # strategies with their own loop (runtime/pipeline.py, runtime/hvd.py)
        return ENGINES[spec.train.strategy]()(spec, run_dir, env, environ, stop_flag)
    t_start = time.perf_counter()
    run_dir = Path(run_dir)
    tc, cc = spec.train, spec.checkpoint
    stop_flag = stop_flag or StopFlag(cc.signal).install()
    if tc.strategy == "horovod":  # hvd.init(); ranks, local rank (device) and side channel from Horovod
        env = _hvd().horovod_env(env, environ, tc.pg_timeout_s)
    threads = setup_threads(environ)
    device = probe_device(env, environ)
    if device.warning and env.local_rank == 0:
        warn(device.warning)
    dev = torch.device(device.torch_device)
    seed_everything(tc.seed)
    if tc.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
    elif device.kind == "cuda":
        torch.backends.cudnn.benchmark = True
    # Horovod moves the gradients; the engine's own group (stop flag, loss, checkpoints) is gloo.
    distributed = init_process_group(env, device, tc.pg_timeout_s,
                                     backend="gloo" if tc.strategy == "horovod" else None)
    host = env.host or socket.gethostname()
    hostnames = gather_hosts(host, distributed)

    channels_last = tc.channels_last and device.kind == "cuda"
    workers = auto_workers(tc.num_workers, worker_cpus(environ, env.local_world_size), tc.dataset != "imagefolder")
    data = build_data(tc, env, dev, workers=workers, channels_last=channels_last)
    plan = make_plan(tc, env.world_size, data.train.sampler.full_length())
    precision = resolve_precision(tc.precision, device.kind, device.native_bf16)

    torch.manual_seed(tc.seed)  # identical initial weights on every rank
    model = place_model(build_model(tc.model, data.info.num_classes, data.info.image_size, data.info.channels),
                        dev, tc.strategy, channels_last)
    seed_everything(tc.seed + env.rank)  # per-rank streams (dropout, augmentation)
    wrapped = wrap_model(tc.strategy, model, device, tc, distributed)
    runner = torch.compile(wrapped) if tc.compile else wrapped
    optimizer = torch.optim.SGD(model.parameters(), lr=plan.lr, momentum=tc.momentum, weight_decay=tc.weight_decay)
    if tc.strategy == "horovod":
        optimizer = _hvd().distributed_optimizer(optimizer, model, tc)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, plan.warmup_steps, plan.total_steps))
    scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None

    ckpt_dir = RunDir(run_dir).checkpoints
    step = 0
    if cc.resume:
        found = _agreed_checkpoint(ckpt_dir, env, distributed)
        if found is not None:
            state, path = found
            step = _restore(state, model, optimizer, scheduler, scaler, env,
                            sharded=tc.strategy == "fsdp" and distributed, folder=path.parent)
            if env.is_main:
                print(f"cyclone_kit: resumed from {path} at step {step}", flush=True)
    launcher = environ.get("CYCLONE_LAUNCHER") or env.launcher
    writer = begin_segment(run_dir, env, environ, plan, tc, stop_flag, precision=precision, strategy=tc.strategy,
                           launcher=launcher, device=device, hostnames=hostnames, threads=threads, step=step)
    if writer is None:
        return "completed"
    if env.is_main:
        print(f"cyclone_kit: {tc.model} on {tc.dataset}, world {env.world_size} ({env.num_nodes} node(s), "
              f"{launcher}), {device.kind} {precision}, global batch {plan.global_batch}, lr {plan.lr:g}, "
              f"steps {step}->{plan.total_steps}", flush=True)

    loop = _Loop(spec, run_dir, env, environ, device, dev, data, plan, precision, model, runner, wrapped,
                 optimizer, scheduler, scaler, writer, stop_flag, distributed, hostnames, host)
    try:
        status = loop.run(step, t_start)
    except BaseException:
        writer.write(mx.end_record("failed", loop.step, mx.steady_state(loop.global_rates), time.perf_counter()
                                   - t_start, mx.utc_now()))
        writer.close()
        stop_flag.uninstall()
        raise
    writer.close()
    stop_flag.uninstall()
    return status


class _Loop:
    """The mutable state of one training segment (private; built by :func:`train`)."""

    def __init__(self, spec: JobSpec, run_dir: Path, env: DistEnv, environ: Mapping[str, str],
                 device: DeviceChoice, dev: torch.device, data: Data, plan: Plan, precision: str,
                 model: nn.Module, runner: nn.Module, wrapped: nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: Any, scaler: Any, writer: mx.MetricsWriter, stop_flag: StopFlag,
                 distributed: bool, hostnames: list[str], host: str) -> None:
        self.spec, self.tc, self.cc = spec, spec.train, spec.checkpoint
        self.run_dir, self.env, self.environ = run_dir, env, environ
        self.device, self.dev, self.data, self.plan = device, dev, data, plan
        self.model, self.runner, self.wrapped = model, runner, wrapped
        self.optimizer, self.scheduler, self.scaler = optimizer, scheduler, scaler
        self.writer, self.stop_flag, self.distributed = writer, stop_flag, distributed
        self.host = host
        self.step = 0
        self.global_rates: list[float] = []
        self.local_rates: list[float] = []
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        self.autocast = (lambda: torch.autocast(device_type=dev.type, dtype=dtype)) if dtype else contextlib.nullcontext
        self.criterion = nn.CrossEntropyLoss()
        self.sharded = spec.train.strategy == "fsdp" and distributed
        self.no_sync = _fsdp_no_sync(wrapped) if self.sharded else getattr(wrapped, "no_sync", None)
        self.bar: Any = None
        self.energy = power.start_meter(dev)  # NVML, GPU runs with nvidia-ml-py only; None otherwise

    # -- one optimizer step: grad_accum micro-batches, no_sync on all but the last
    def _step(self, batches: Any, window: _Window, loss_sum: torch.Tensor) -> torch.Tensor:
        accum = self.plan.grad_accum
        for micro in range(accum):
            t0 = time.perf_counter()
            x, y = next(batches)
            window.data_s += time.perf_counter() - t0
            sync = contextlib.nullcontext() if (micro == accum - 1 or self.no_sync is None) else self.no_sync()
            with sync:
                with self.autocast():
                    loss = self.criterion(self.runner(x), y) / accum
                if self.scaler is not None:
                    self.scaler.scale(loss).backward()
                else:
                    loss.backward()
            loss_sum = loss_sum + loss.detach().float()
        optimizer_step(self.optimizer, self.scaler, horovod=self.tc.strategy == "horovod")
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return loss_sum

    def run(self, start_step: int, t_start: float) -> str:
        """Train from ``start_step`` to the plan's end or an agreed stop; returns the status."""
        plan, tc, cc, env = self.plan, self.tc, self.cc, self.env
        self.step = step = start_step
        agreement = StopAgreement(self.stop_flag, self.distributed, interval_s=cc.poll_s)
        epoch = step // plan.steps_per_epoch
        self._start_epoch(epoch, step)
        batches = iter(self.data.train)
        epoch_t0 = time.perf_counter()
        window = _Window(time.perf_counter())
        loss_sum = torch.zeros((), device=self.dev)
        agreed = NONE
        self.bar = _progress(env, plan.total_steps, step)
        self.model.train()
        while step < plan.total_steps:
            loss_sum = self._step(batches, window, loss_sum)
            step += 1
            self.step = step
            window.steps += 1
            if self.bar is not None:
                self.bar.update(1)
            if step % tc.log_every == 0 or step == plan.total_steps:
                self._log(step, epoch, loss_sum, window)
                loss_sum = torch.zeros((), device=self.dev)
                window = _Window(time.perf_counter())
            agreed = agreement.poll(step)
            if agreed != NONE:
                break
            if cc.every_steps and step % cc.every_steps == 0 and step < plan.total_steps:
                self._checkpoint(step, epoch)
            if step % plan.steps_per_epoch == 0:
                self._end_epoch(epoch, time.perf_counter() - epoch_t0, validate=self._val_due(epoch))
                epoch += 1
                if step < plan.total_steps:
                    self._start_epoch(epoch, step)
                    batches = iter(self.data.train)
                    epoch_t0 = time.perf_counter()
        agreement.finish()
        if self.bar is not None:
            self.bar.close()
        if agreed == NONE and step % plan.steps_per_epoch:
            self._end_epoch(epoch, time.perf_counter() - epoch_t0, validate=tc.val_every_epochs > 0)
        self._checkpoint(step, epoch)
        status = "completed" if agreed == NONE else RunDir(self.run_dir).stop_status()  # a user's cancel: cancelled
        wall = time.perf_counter() - t_start
        self.writer.write(mx.end_record(status, step, mx.steady_state(self.global_rates), wall, mx.utc_now()))
        self._rank_summary()
        if env.is_main:
            rate = mx.steady_state(self.global_rates)
            print(f"cyclone_kit: {status} at step {step}/{plan.total_steps} in {wall:.1f} s"
                  + (f", {rate:.1f} samples/s" if rate else ""), flush=True)
        if agreed != NONE:
            self._after_stop(agreed)
        return status

    def _start_epoch(self, epoch: int, step: int) -> None:
        within = step - epoch * self.plan.steps_per_epoch
        self.data.train.set_epoch(epoch, within * self.plan.grad_accum)

    def _val_due(self, epoch: int) -> bool:
        every = self.tc.val_every_epochs
        return every > 0 and (epoch + 1) % every == 0

    def _log(self, step: int, epoch: int, loss_sum: torch.Tensor, window: _Window) -> None:
        loss = loss_sum / max(window.steps, 1)
        if self.distributed:
            import torch.distributed as dist

            dist.all_reduce(loss, op=dist.ReduceOp.SUM)
            loss = loss / self.env.world_size
        value = float(loss.item())  # the only host sync: once per log window
        elapsed = max(time.perf_counter() - window.start, 1e-9)
        n = window.steps
        global_rate = self.plan.global_batch * n / elapsed
        self.global_rates.append(global_rate)
        self.local_rates.append(self.plan.per_device_batch * self.plan.grad_accum * n / elapsed)
        self.writer.write(mx.step_record(step, epoch, value, elapsed / n, window.data_s / n, global_rate,
                                         mx.utc_now()))
        if self.env.is_main:
            if self.bar is not None:
                self.bar.set_postfix(loss=f"{value:.4f}", samples_s=f"{global_rate:.0f}")
            else:
                print(f"step {step}/{self.plan.total_steps} epoch {epoch} loss {value:.4f} "
                      f"step {elapsed / n * 1000:.1f} ms data {window.data_s / n * 1000:.1f} ms "
                      f"{global_rate:.1f} samples/s", flush=True)

    def _end_epoch(self, epoch: int, seconds: float, validate: bool) -> None:
        accuracy = self._validate() if validate and self.data.val is not None else None
        self.writer.write(mx.epoch_record(epoch, accuracy, seconds, mx.utc_now()))
        if self.env.is_main and accuracy is not None:
            print(f"epoch {epoch} val_accuracy {accuracy:.4f}", flush=True)

    @torch.no_grad()
    def _validate(self) -> float | None:
        module = unwrap(self.model)
        module.eval()
        counts = torch.zeros(2, dtype=torch.float64, device=self.dev)
        self.data.val.set_epoch(0)
        last = None
        for x, y in self.data.val:
            with self.autocast():
                pred = module(x).argmax(1)
            counts[0] += (pred == y).sum()
            counts[1] += y.numel()
            last = x
        if self.sharded:  # FSDP forwards are collectives: every rank runs as many as the busiest
            import torch.distributed as dist

            mine = len(self.data.val)
            most = torch.tensor([mine], device=self.dev)
            dist.all_reduce(most, op=dist.ReduceOp.MAX)
            for _ in range(int(most.item()) - mine):
                with self.autocast():
                    module(last if last is not None else self._any_batch())
        module.train()
        if self.distributed:
            import torch.distributed as dist

            dist.all_reduce(counts, op=dist.ReduceOp.SUM)
        correct, total = counts.tolist()
        return correct / total if total else None

    def _any_batch(self) -> torch.Tensor:
        """An input batch for padding forwards on a rank whose validation shard is empty."""
        info = self.data.info
        return torch.zeros(1, info.channels, info.image_size, info.image_size, device=self.dev)

    def _checkpoint(self, step: int, epoch: int) -> None:
        rngs = gather_to_main(ckpt.capture_rng(), self.env, self.distributed)
        model_state: Any = None
        optim_state: Any = None
        optim_format = "torch"
        if self.sharded and self.cc.sharded:  # every rank writes its own shards (runtime/fsdp_ckpt.py)
            from cyclone_kit.runtime import fsdp_ckpt

            entries = fsdp_ckpt.save_sharded(RunDir(self.run_dir).checkpoints, step, self.model, self.optimizer)
            model_state, optim_state, optim_format = entries["model"], None, fsdp_ckpt.FORMAT
        elif self.sharded:  # a collective: every rank takes part, rank 0 keeps the full tensors
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
                get_optimizer_state_dict,
            )

            full = StateDictOptions(full_state_dict=True, cpu_offload=True)
            model_state = get_model_state_dict(self.model, options=full)
            optim_state, optim_format = get_optimizer_state_dict(self.model, self.optimizer, options=full), "fqn"
        elif self.env.is_main:
            model_state, optim_state = unwrap(self.model).state_dict(), self.optimizer.state_dict()
        if self.env.is_main:
            state = {
                "model": model_state,
                "optimizer": optim_state,
                "optimizer_format": optim_format,
                "strategy": self.tc.strategy,
                "scheduler": self.scheduler.state_dict(),
                "step": step,
                "epoch": epoch,
                "sampler": {"epoch": step // self.plan.steps_per_epoch,
                            "batch": (step % self.plan.steps_per_epoch) * self.plan.grad_accum},
                "rng": rngs,
                "world_size": self.env.world_size,
                "global_batch": self.plan.global_batch,
            }
            if self.scaler is not None:
                state["scaler"] = self.scaler.state_dict()
            path = ckpt.save_checkpoint(RunDir(self.run_dir).checkpoints, state, step, self.cc.keep)
            print(f"cyclone_kit: checkpoint of step {step} written: {path}", flush=True)  # the log names the last one
            if optim_format == "dcp":
                from cyclone_kit.runtime import fsdp_ckpt

                fsdp_ckpt.prune(RunDir(self.run_dir).checkpoints)
        if self.distributed:  # the others wait while rank 0 writes and fsyncs: on gloo, off NCCL's watchdog
            import torch.distributed as dist

            dist.barrier(group=side_group())

    def _rank_summary(self) -> None:
        peak = None
        if self.device.kind == "cuda":
            peak = int(torch.cuda.max_memory_allocated(self.dev))
        else:
            import resource

            peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
        mx.write_rank_summary(self.run_dir, self.env.rank, self.host, self.device.torch_device,
                              mx.steady_state(self.local_rates), peak,
                              energy_j=self.energy.stop() if self.energy is not None else None)

    def _after_stop(self, agreed: int) -> None:
        if not self.env.is_main:
            return
        yes, why = should_requeue(agreed, self.cc.requeue, self.env.restart_count, self.cc.max_requeues,
                                  self.environ)
        print(f"cyclone_kit: stopped on a signal after a checkpoint; {why}", flush=True)
        if yes:
            try:
                requeue(self.environ)
            except (CommandError, ValidationError) as e:
                warn(f"requeue failed: {e}")


# --------------------------------------------------------------------------- helpers
def _restore(state: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
             scaler: Any, env: DistEnv, sharded: bool = False, folder: Path | None = None) -> int:
    fqn = state.get("optimizer_format") == "fqn"
    if state.get("optimizer_format") == "dcp":  # FSDP shards (checkpoint.sharded) in folder/ckpt-N.dcp
        from cyclone_kit.runtime import fsdp_ckpt

        if not sharded or folder is None:
            raise ValidationError(
                f"checkpoint of step {state['step']} holds FSDP shards (checkpoint.sharded); "
                "only an FSDP run with several ranks can resume it",
                hint="resume with train.strategy=fsdp on 2 or more ranks, or start a new run directory",
            )
        fsdp_ckpt.load_sharded(folder, state, model, optimizer)
    elif sharded or fqn:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        if not fqn:
            raise ValidationError(
                f"checkpoint of step {state['step']} was written by a {state.get('strategy', 'ddp')} run; "
                "an FSDP run cannot resume its optimizer state",
                hint="resume with the strategy that wrote it, or start a new run directory",
            )
        full = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, state["model"], options=full)
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=full)
    else:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and "scaler" in state:
        scaler.load_state_dict(state["scaler"])
    rngs = state.get("rng") or []
    if len(rngs) == env.world_size:
        ckpt.restore_rng(rngs[env.rank])
    elif env.is_main and rngs:
        warn(f"checkpoint was written by {len(rngs)} rank(s), this run has {env.world_size}: "
             "RNG streams are reseeded, the rest resumes exactly")
    return int(state["step"])


def _fsdp_no_sync(model: nn.Module) -> Callable[[], contextlib.AbstractContextManager[None]]:
    """A ``no_sync()`` equivalent for FSDP2: no gradient reduce-scatter inside the context."""

    @contextlib.contextmanager
    def no_sync() -> Any:
        model.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)  # type: ignore[operator]

    return no_sync


def _agreed_checkpoint(folder: Path, env: DistEnv, distributed: bool) -> tuple[dict[str, Any], Path] | None:
    """The checkpoint to resume from, chosen by rank 0 (newest loadable) and loaded by every rank,
    so all ranks resume from the same step even if one saw a file differently."""
    if not distributed:
        return ckpt.load_latest(folder)
    import torch.distributed as dist

    found = ckpt.load_latest(folder) if env.is_main else None
    choice: list[Any] = [str(found[1]) if found else None]
    dist.broadcast_object_list(choice, src=0, group=side_group())  # rank 0 may take minutes to load it
    if choice[0] is None:
        return None
    if env.is_main:
        return found
    path = Path(choice[0])
    return ckpt.load_checkpoint(path), path


def seed_everything(seed: int) -> None:
    """Seed Python's, torch's and numpy's generators (the same start on every engine)."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass


def gather_hosts(host: str, distributed: bool) -> list[str]:
    """Every rank's host, deduplicated in rank order (rank 0's node first)."""
    hosts = [host]
    if distributed:
        import torch.distributed as dist

        hosts = [None] * dist.get_world_size()  # type: ignore[list-item]
        dist.all_gather_object(hosts, host, group=side_group())
    return list(dict.fromkeys(str(h) for h in hosts))


def gather_to_main(obj: Any, env: DistEnv, distributed: bool) -> list[Any]:
    """Every rank's ``obj`` (picklable, on the CPU) in rank order on rank 0, [] on the others;
    over the gloo side group, so no rank unpickles another's state onto its own GPU."""
    if not distributed:
        return [obj]
    import torch.distributed as dist

    out: list[Any] | None = [None] * env.world_size if env.is_main else None
    dist.gather_object(obj, out, dst=0, group=side_group())
    return out if out is not None else []


def _versions() -> dict[str, str | None]:
    """Versions for the start record; torchvision's from its metadata (importing it costs ~0.3-1 s)."""
    from importlib.metadata import PackageNotFoundError, version

    tv_module = sys.modules.get("torchvision")
    try:
        tv: str | None = tv_module.__version__ if tv_module is not None else version("torchvision")
    except PackageNotFoundError:
        tv = None
    return {"torch": torch.__version__, "torchvision": tv, "cyclone_kit": __version__}


def _progress(env: DistEnv, total: int, initial: int) -> Any:
    """A tqdm bar on rank 0 when stdout is a terminal (and tqdm is installed), else None."""
    if not env.is_main or not sys.stdout.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)

