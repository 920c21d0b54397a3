"""The data-parallel engine (DDP, FSDP2, Horovod): training of a torchvision model, with metrics and checkpoints.

The schedule maths is in :mod:`cyclone_kit.runtime.engine.plan` and the loop skeleton in
:mod:`cyclone_kit.runtime.engine.loop` (both shared with the pipeline); :func:`train` sets up a segment
and its :class:`_Loop` supplies the step, the log line, validation and the checkpoint's state;
:mod:`cyclone_kit.runtime.engine` picks this engine or the pipeline's. Properties it keeps:

* **Correct DDP**: N ranks with batch B follow the same trajectory as 1 rank with batch N*B
  (gradients averaged; the learning rate scaled by the global batch, Goyal et al. 2017).
* **No per-step host syncs**: the loss stays on the device and is read (and averaged across
  ranks) only every ``train.log_every`` steps; the stop flag travels on a separate gloo group.
* **Exact resume**: a checkpoint after step s holds everything needed to continue with step
  s+1 seeing the same batches, LR and RNG as an uninterrupted run.
* **One loop, strategies as plug-ins** (:class:`Strategy`, :data:`STRATEGIES`): DDP, FSDP2
  (``fully_shard``; checkpoints hold full, unsharded state dicts) and Horovod differ only in how
  the model and optimizer are wrapped, how gradient sync is paused during accumulation, and the
  process group the engine keeps for itself; others raise a ValidationError.
* **The first user of the public API's path**: set-up (device, process group, hosts), the
  metrics records, the stop agreement, checkpoint files, the end record and requeue all go
  through the :class:`~cyclone_kit.runtime.session.Session` that ``ck.init()`` & co. use too.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cyclone_kit.config.job import JobSpec, TrainConfig
from cyclone_kit.core.errors import ValidationError
from cyclone_kit.rundir.layout import RunDir
from cyclone_kit.runtime import checkpoint as ckpt
from cyclone_kit.runtime import phases as ph
from cyclone_kit.runtime import power
from cyclone_kit.runtime.dist import DeviceChoice, warn, worker_cpus
from cyclone_kit.runtime.engine.data import Data, auto_workers, build_data
from cyclone_kit.runtime.engine.loop import (
    SegmentLoop,
    Window,
    count_nonfinite,
    judge_params,
    nonfinite_params,
    params_diverged,
)
from cyclone_kit.runtime.engine.models import build_model
from cyclone_kit.runtime.engine.plan import (
    Plan,
    begin_segment,
    configure_backends,
    lr_factor,
    make_plan,
    resolve_precision,
    seed_everything,
    shards_in_background,
)
from cyclone_kit.runtime.env import DistEnv
from cyclone_kit.runtime.session import Session, gather_hosts, gather_to_main, open_session
from cyclone_kit.runtime.signals import StopFlag

__all__ = ["CONTIGUOUS_PARAMS", "STRATEGIES", "Strategy", "count_nonfinite", "fsdp_mixed_precision", "fsdp_norm_policy",
           "gather_hosts", "gather_to_main", "judge_params", "keep_kernel_choice", "make_optimizer", "nonfinite_params",
           "optimizer_step", "params_diverged", "place_model", "seed_momentum", "strategy_for", "train", "unwrap",
           "use_fused_sgd", "use_static_graph", "wrap_model"]





# --------------------------------------------------------------------------- strategies
#: Strategies whose collectives need contiguous parameters and gradients, so the conv weights stay
#: contiguous under channels_last: FSDP2's ``fully_shard`` ("FSDP does not support non-contiguous
#: parameters", torch 2.14), and Horovod 0.28, whose ``_check_function`` raises "Tensor is required
#: to be contiguous." at the first broadcast of a channels_last weight (horovod/torch/mpi_ops.py) and
#: would at the all-reduce of its gradient (autograd gives a parameter's gradient its strides).
CONTIGUOUS_PARAMS = ("fsdp", "horovod")


def place_model(model: nn.Module, dev: torch.device, strategy: str, channels_last: bool) -> nn.Module:
    """Move ``model`` to ``dev``; with ``channels_last``, its conv weights too, except under the
    strategies of :data:`CONTIGUOUS_PARAMS`. There channels_last inputs alone still give
    channels_last convolutions (cuDNN picks NHWC when the input or the weight is; the weight is
    converted per call, and its gradient comes back in the parameter's own, contiguous layout)."""
    model = model.to(dev)
    if channels_last and strategy not in CONTIGUOUS_PARAMS:
        model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    return model


def use_fused_sgd(strategy: str, device_kind: str) -> bool:
    """Whether the engine's SGD is ``fused=True`` (pure): on CUDA under DDP (and on one GPU) and in the
    pipeline (whose :class:`~cyclone_kit.runtime.engine.pipeline.LossScale` hands the kernel the same tensors).

    Fused SGD sets ``_step_supports_amp_scaling``, so ``GradScaler.step`` hands it ``grad_scale``
    and ``found_inf`` as tensors and the kernel skips an overflowed step on the device; plain SGD
    goes through ``GradScaler._maybe_opt_step``, whose ``found_inf.item()`` syncs the host every
    fp16 step (torch 2.14 torch/amp/grad_scaler.py). Not under FSDP2 (DTensor has no sharding rule
    for ``aten._fused_sgd_``: NotImplementedError), not under Horovod (its DistributedOptimizer
    re-runs ``SGD.__init__`` without ``fused``, and its ``synchronize()`` waits on the host anyway),
    not on the CPU (unchanged numerics there; nothing to sync)."""
    return device_kind == "cuda" and strategy in ("ddp", "pipeline")


def make_optimizer(model: nn.Module, lr: float, train: TrainConfig, fused: bool) -> torch.optim.Optimizer:
    """The engine's SGD over ``model``'s parameters (``fused`` per :func:`use_fused_sgd`), a fused
    one with zero momentum buffers already (:func:`seed_momentum`)."""
    extra = {"fused": True} if fused else {}
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=train.momentum,
                                weight_decay=train.weight_decay, **extra)
    seed_momentum(optimizer)
    return optimizer


def seed_momentum(optimizer: torch.optim.Optimizer) -> int:
    """Give every parameter of a fused SGD group with momentum that has no momentum buffer a zero one;
    returns how many were made. A no-op for plain SGD (and groups without momentum).

    Fused SGD's first step (every buffer None) allocates the buffers with ``torch.empty_like`` and
    stores them in the state even when the kernel returned at once because GradScaler's
    ``found_inf`` was set (torch 2.14 torch/optim/sgd.py ``_fused_sgd``, ``is_first_step``): an fp16
    run whose first step overflows (at the initial scale 2^16, or the first step after a resume
    without momentum state) then computed ``momentum * garbage + grad``. With zero buffers the
    kernel never takes the first-step branch, and its ``momentum * 0 + (1 - dampening) * grad`` is
    plain SGD's first step ``buf = grad`` for the engine's dampening 0. Call it after building the
    optimizer and after loading a state dict into it.
    """
    made = 0
    for group in optimizer.param_groups:
        if not group.get("fused") or not group.get("momentum"):
            continue
        for p in group["params"]:
            state = optimizer.state[p]
            if state.get("momentum_buffer") is None:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format).detach()
                made += 1
    return made


def fsdp_mixed_precision(precision: str) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` for the run's resolved precision, or None for fp32.

    bf16 (compute capability 8.0+, :func:`~cyclone_kit.runtime.engine.plan.resolve_precision`): bf16
    unsharded parameters, all-gathers and gradient reduce-scatters; fp16 (below 8.0, with the
    GradScaler) likewise in fp16. Without a policy FSDP2 moves fp32, twice the bytes, while
    autocast computes in 16 bits anyway. The sharded parameters and the optimizer stay fp32.
    """
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    if dtype is None:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)


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
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    if device.kind != "cuda" and dist.get_debug_level() == dist.DebugLevel.DETAIL:  # seen with torch 2.14.1
        raise ValidationError(
            "TORCH_DISTRIBUTED_DEBUG=DETAIL with train.strategy=ddp on gloo: torch's DistributedDataParallel "
            "crashes (segmentation fault) in its constructor under DETAIL on the CPU",
            hint="use TORCH_DISTRIBUTED_DEBUG=INFO on the CPU (DETAIL works with fsdp, horovod, pipeline), "
                 "or DETAIL on GPUs",
        )
    return DDP(
        model,
        device_ids=[device.index] if device.kind == "cuda" else None,
        gradient_as_bucket_view=True,
        bucket_cap_mb=train.bucket_cap_mb,
        static_graph=use_static_graph(train),
    )


def fsdp_norm_policy(policy: Any) -> Any:
    """The ``MixedPrecisionPolicy`` of the FSDP unit holding the BatchNorm layers under ``policy``
    (:func:`fsdp_mixed_precision`'s, or None for fp32: then no such unit): fp32 parameters and
    gradient reductions, inputs not cast, outputs in the compute dtype.

    FSDP2 casts parameters, never buffers: under a bf16/fp16 ``param_dtype`` a BatchNorm's weight
    became bf16 while its running_mean/var stayed fp32, and ``batch_norm`` raised "expected scalar
    type BFloat16 but found Float" (CPU; CUDA refuses the mix too) at step 1 on every ResNet and
    MobileNet (torch's test_fully_shard_mixed_precision.py ``_test_norm_modules`` expects that error).
    In fp32, BatchNorm takes the 16-bit activations as autocast gives them to it without FSDP.
    """
    if policy is None:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32, output_dtype=policy.param_dtype,
                                cast_forward_inputs=False)


def _batch_norms(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.weight is not None]


def _wrap_fsdp(model: nn.Module, device: DeviceChoice, train: TrainConfig, distributed: bool) -> nn.Module:
    """FSDP2 (``fully_shard``): under mixed precision the BatchNorm layers first, together as one fp32
    unit (:func:`fsdp_norm_policy`; one all-gather and one reduce-scatter per step for all of them,
    kept unsharded from the forward to the backward: ResNet-50's 53 layers hold 53k parameters), then
    every parameterised block, then the root, sharded over all ranks.

    Raises:
        ValidationError: on the CPU under a torch whose FSDP2 cannot run there (2.6).
    """
    if not distributed:
        return model
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from cyclone_kit.runtime import torchcompat

    if device.kind == "cpu" and not torchcompat.fsdp_runs_on_cpu(torch.cpu.Stream):
        error, hint = torchcompat.fsdp_cpu_refusal(torch.__version__)
        raise ValidationError(error, hint=hint)

    mesh = init_device_mesh(device.kind, (dist.get_world_size(),))
    policy = fsdp_mixed_precision(resolve_precision(train.precision, device.kind, device.native_bf16))
    extra = {"mp_policy": policy} if policy is not None else {}  # every unit: a child without it would see fp32
    norms = _batch_norms(model) if policy is not None else []
    if norms:  # before the blocks: fully_shard takes the parameters no earlier call took
        fully_shard(norms, mesh=mesh, mp_policy=fsdp_norm_policy(policy), reshard_after_forward=False)
    for block in _shard_units(model):
        fully_shard(block, mesh=mesh, **extra)
    fully_shard(model, mesh=mesh, **extra)
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


def _no_sync(wrapped: nn.Module) -> Callable[[], contextlib.AbstractContextManager[None]] | None:
    return getattr(wrapped, "no_sync", None)


@dataclass(frozen=True)
class Strategy:
    """A plug-in of the one training loop: what differs between DDP, FSDP and Horovod.

    Attributes:
        wrap: ``(model, device, train, distributed) -> model`` for the forward/backward.
        no_sync: ``wrapped -> (() -> context)`` pausing gradient sync during accumulation, or None.
        sharded: parameters are sharded (state dicts are collectives; validation forwards padded).
        pg_backend: the engine's own process group backend instead of the device's (Horovod moves
            the gradients itself; the engine's group carries only the loss, stop flag and checkpoints).
        prepare_env: ``(env, environ, timeout_s) -> env`` before set-up (Horovod: ``hvd.init()``).
        optimizer: ``(optimizer, model, train) -> optimizer`` (Horovod's DistributedOptimizer).
        time_comm: ``(timer, wrapped, model, optimizer) -> None`` attaching the gradient
            communication's timing to a :class:`~cyclone_kit.runtime.phases.PhaseTimer`
            (:mod:`cyclone_kit.runtime.phases` says how each strategy's is measured), or None.
    """

    wrap: Callable[[nn.Module, DeviceChoice, TrainConfig, bool], nn.Module]
    no_sync: Callable[[nn.Module], Any] = _no_sync
    sharded: bool = False
    pg_backend: str | None = None
    prepare_env: Callable[[DistEnv, Mapping[str, str], int], DistEnv] | None = None
    optimizer: Callable[[Any, nn.Module, TrainConfig], Any] | None = None
    time_comm: Callable[[ph.PhaseTimer, nn.Module, nn.Module, Any], None] | None = None

    def __call__(self, model: nn.Module, device: DeviceChoice, train: TrainConfig, distributed: bool) -> nn.Module:
        """``wrap`` (a Strategy is called like the wrap function it carries)."""
        return self.wrap(model, device, train, distributed)


#: strategy name -> its plug-in of this engine (the pipeline has an engine of its own on the same loop: engine/pipeline.py).
STRATEGIES: dict[str, Strategy] = {
    "ddp": Strategy(_wrap_ddp, time_comm=lambda timer, wrapped, model, opt: timer.attach_ddp(wrapped)),
    "fsdp": Strategy(_wrap_fsdp, no_sync=lambda wrapped: _fsdp_no_sync(wrapped), sharded=True,
                     time_comm=lambda timer, wrapped, model, opt: timer.attach_fsdp(ph.fsdp_modules(model))),
    "horovod": Strategy(lambda *args: _hvd().wrap_horovod(*args), no_sync=lambda wrapped: None, pg_backend="gloo",
                        prepare_env=lambda env, environ, timeout: _hvd().horovod_env(env, environ, timeout),
                        optimizer=lambda opt, model, tc: _hvd().distributed_optimizer(opt, model, tc),
                        time_comm=lambda timer, wrapped, model, opt: timer.attach_horovod(opt, model.parameters())),
}


def _hvd() -> Any:
    """cyclone_kit.runtime.hvd (Horovod hooks), imported only for strategy 'horovod'."""
    from cyclone_kit.runtime import hvd

    return hvd


def strategy_for(name: str) -> Strategy:
    """The plug-in of ``name``.

    Raises:
        ValidationError: the strategy is not available in this runtime yet.
    """
    if name not in STRATEGIES:
        raise ValidationError(
            f"train.strategy {name!r} is not available yet in the cyclone_kit runtime",
            hint=f"use one of: {', '.join(STRATEGIES)}",
        )
    return STRATEGIES[name]


def wrap_model(strategy: str, model: nn.Module, device: DeviceChoice, train: TrainConfig, distributed: bool) -> nn.Module:
    """Wrap ``model`` for ``strategy``.

    Raises:
        ValidationError: the strategy is not available in this runtime yet.
    """
    return strategy_for(strategy).wrap(model, device, train, distributed)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module inside torch.compile and DDP wrappers."""
    model = getattr(model, "_orig_mod", model)
    return getattr(model, "module", model)


# --------------------------------------------------------------------------- the engine
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
    t_start = time.perf_counter()
    run_dir = Path(run_dir)
    tc, cc = spec.train, spec.checkpoint
    strategy = strategy_for(tc.strategy)
    if strategy.prepare_env is not None:  # Horovod: hvd.init(); ranks, local rank (device) and side channel
        env = strategy.prepare_env(env, environ, tc.pg_timeout_s)
    seed_everything(tc.seed)
    # Threads, device, process group (Horovod: a gloo one of the engine's own), hosts, stop agreement.
    session = open_session(env, environ, run_dir, cc, pg_timeout_s=tc.pg_timeout_s, stop_flag=stop_flag,
                           t_start=t_start, backend=strategy.pg_backend)
    session.max_nonfinite_steps = tc.max_nonfinite_steps
    device, distributed = session.device, session.distributed
    dev = torch.device(device.torch_device)
    configure_backends(tc, device.kind)  # deterministic, or cudnn.benchmark on CUDA (shared with the pipeline)

    channels_last = tc.channels_last and device.kind == "cuda"
    workers = auto_workers(tc.num_workers, worker_cpus(environ, env.local_world_size), tc.dataset != "imagefolder")
    data = build_data(tc, env, dev, workers=workers, channels_last=channels_last)
    plan = make_plan(tc, env.world_size, data.train.sampler.full_length())
    precision = resolve_precision(tc.precision, device.kind, device.native_bf16)

    torch.manual_seed(tc.seed)  # identical initial weights on every rank
    model = place_model(build_model(tc.model, data.info.num_classes, data.info.image_size, data.info.channels),
                        dev, tc.strategy, channels_last)
    seed_everything(tc.seed + env.rank)  # per-rank streams (dropout, augmentation)
    wrapped = strategy.wrap(model, device, tc, distributed)
    runner = torch.compile(wrapped) if tc.compile else wrapped
    optimizer = make_optimizer(model, plan.lr, tc, use_fused_sgd(tc.strategy, device.kind))
    if strategy.optimizer is not None:
        optimizer = strategy.optimizer(optimizer, model, tc)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, plan.warmup_steps, plan.total_steps))
    scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None
    timer = _phase_timer(strategy, dev, environ, distributed, tc.compile, wrapped, model, optimizer)
    if timer is not None and timer.comm_note and env.is_main:
        warn(timer.comm_note)  # an older torch: the communication is not timed

    step = 0
    if cc.resume:
        found = session.load_latest()  # chosen by rank 0, loaded by every rank: all resume from one step
        if found is not None:
            state, path = found
            step = _restore(state, model, optimizer, scheduler, scaler, env,
                            sharded=strategy.sharded and distributed, folder=path.parent)
            if env.is_main:
                print(f"cyclone_kit: resumed from {path} at step {step}", flush=True)
    launcher = session.launcher
    if not begin_segment(session, plan, tc, precision=precision, strategy=tc.strategy, step=step,
                         phase_timing=timer.phase_timing if timer else None,
                         comm_timing=timer.comm_timing if timer else None):
        return "completed"
    if env.is_main:
        print(f"cyclone_kit: {tc.model} on {tc.dataset}, world {env.world_size} ({env.num_nodes} node(s), "
              f"{launcher}), {device.kind} {precision}, global batch {plan.global_batch}, lr {plan.lr:g}, "
              f"steps {step}->{plan.total_steps}", flush=True)

    loop = _Loop(spec, session, strategy, dev, data, plan, precision, model, runner, wrapped, optimizer, scheduler,
                 scaler, timer)
    return loop.run(step)  # the skeleton (engine/loop.py); a failure writes the ``failed`` end record first


class _Loop(SegmentLoop):
    """One training segment of the data-parallel engine: the skeleton's step, log, validation and
    checkpoint for DDP, FSDP2 and Horovod (private; built by :func:`train`)."""

    def __init__(self, spec: JobSpec, session: Session, strategy: Strategy, dev: torch.device, data: Data, plan: Plan,
                 precision: str, model: nn.Module, runner: nn.Module, wrapped: nn.Module,
                 optimizer: torch.optim.Optimizer, scheduler: Any, scaler: Any, timer: ph.PhaseTimer | None) -> None:
        self.spec, self.tc, self.cc = spec, spec.train, spec.checkpoint
        self.timer = timer
        self.session, self.strategy = session, strategy
        self.run_dir, self.env, self.environ = session.run_dir, session.env, session.environ
        self.device, self.dev, self.data, self.plan = session.device, dev, data, plan
        self.model, self.runner, self.wrapped = model, runner, wrapped
        self.optimizer, self.scheduler, self.scaler = optimizer, scheduler, scaler
        self.distributed = session.distributed
        self.start_state()
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        self.autocast = (lambda: torch.autocast(device_type=dev.type, dtype=dtype)) if dtype else contextlib.nullcontext
        self.criterion = nn.CrossEntropyLoss()
        self.sharded = strategy.sharded and session.distributed
        self.no_sync = strategy.no_sync(wrapped) if session.distributed else None
        self.async_shards = (self.sharded and self.cc.sharded and self.cc.async_write
                             and shards_in_background(self.env.is_main))
        self.energy = power.start_meter(dev)  # NVML, GPU runs with nvidia-ml-py only; None otherwise

    # -- one optimizer step: grad_accum micro-batches, no_sync on all but the last
    def train_step(self, batches: Any, window: Window, loss_sum: torch.Tensor) -> torch.Tensor:
        accum, timer = self.plan.grad_accum, self.timer
        for micro in range(accum):
            t0 = time.perf_counter()
            if timer is not None:
                timer.mark(ph.DATA)
            x, y = next(batches)
            if timer is not None:
                timer.mark(ph.COMPUTE)
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
        if timer is not None:
            timer.backward_done()
        optimizer_step(self.optimizer, self.scaler, horovod=self.strategy.optimizer is not None)
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if timer is not None:
            timer.step_done()
        return loss_sum

    def open_window(self) -> Window:
        if self.timer is not None:
            self.timer.open()
        return Window(time.perf_counter())

    def progress_bar(self, total: int, initial: int) -> Any:
        return _progress(self.env, total, initial)

    def begin(self) -> None:
        self.model.train()

    def end_fields(self) -> dict[str, Any]:
        return {"energy_j": self.energy.stop() if self.energy is not None else None}

    def params(self) -> Iterable[torch.Tensor]:
        return self.model.parameters()

    def log(self, step: int, epoch: int, loss_sum: torch.Tensor, window: Window) -> None:
        # The window's mean loss and how many parameter tensors are not finite: one all-reduce, one host read.
        packed = torch.stack([loss_sum / max(window.steps, 1), nonfinite_params(self.model.parameters()).to(self.dev)])
        if self.distributed:
            import torch.distributed as dist

            dist.all_reduce(packed, op=dist.ReduceOp.SUM)
            packed = packed / torch.tensor([self.env.world_size, 1.0], device=packed.device)
        value, bad = packed.tolist()  # the only host sync: once per log window
        elapsed = max(time.perf_counter() - window.start, 1e-9)
        phases = self.timer.close().fields() if self.timer is not None else None  # CUDA events read after the sync
        n = window.steps
        global_rate = self.session.log_window(step, epoch, value, n, elapsed, window.data_s, self.plan.global_batch * n,
                                              self.plan.per_device_batch * self.plan.grad_accum * n, phases=phases)
        if self.env.is_main:
            if self.bar is not None:
                self.bar.set_postfix(loss=f"{value:.4f}", samples_s=f"{global_rate:.0f}")
            else:
                print(f"step {step}/{self.plan.total_steps} epoch {epoch} loss {value:.4f} "
                      f"step {elapsed / n * 1000:.1f} ms data {window.data_s / n * 1000:.1f} ms "
                      f"{global_rate:.1f} samples/s", flush=True)
        self.judge_params(step, int(bad))

    @torch.no_grad()
    def validate(self) -> float | None:
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

    def write_checkpoint(self, step: int, epoch: int) -> None:
        rngs = self.session.gather_to_main(ckpt.capture_rng())
        model_state: Any = None
        optim_state: Any = None
        optim_format = "torch"
        shards: Any = None  # this rank's background shard write (asynchronous sharded checkpoints)
        staged_s = 0.0
        if self.sharded and self.cc.sharded:  # every rank writes its own shards (runtime/checkpoint/fsdp.py)
            from cyclone_kit.runtime.checkpoint import fsdp as fsdp_ckpt

            folder = RunDir(self.run_dir).checkpoints
            if self.async_shards:
                # The previous shards' .pt first: at most one write in flight, and its prune never meets these.
                self.session.finish_shards(before=step)
                t0 = time.perf_counter()
                entries, shards = fsdp_ckpt.start_sharded(folder, step, self.model, self.optimizer)
                staged_s = time.perf_counter() - t0
            else:
                entries = fsdp_ckpt.save_sharded(folder, step, self.model, self.optimizer)
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
        state: dict[str, Any] | None = None
        if self.env.is_main:
            state = {
                "model": model_state,
                "optimizer": optim_state,
                "optimizer_format": optim_format,
                "strategy": self.tc.strategy,
                **self.position_state(step, epoch, rngs),
            }
            if self.scaler is not None:
                state["scaler"] = self.scaler.state_dict()
        prune = None
        if optim_format == "dcp":
            from cyclone_kit.runtime.checkpoint import fsdp as fsdp_ckpt

            prune = fsdp_ckpt.prune
        if shards is not None:  # the .pt once every rank's shards are written (session.finish_shards)
            self.session.save_after_shards(state, step, shards, after_write=prune, staged_s=staged_s)
            return
        # Rank 0 writes it atomically (the newest checkpoint.keep kept); the others wait on the gloo side group.
        self.session.save(state, step, after_write=prune)


# --------------------------------------------------------------------------- helpers
def _phase_timer(strategy: Strategy, dev: torch.device, environ: Mapping[str, str], distributed: bool,
                 compiled: bool, wrapped: nn.Module, model: nn.Module, optimizer: Any) -> ph.PhaseTimer | None:
    """The step phases' timer (None when ``$CYCLONE_PHASES=0``), its communication recorder attached.

    A world of one has no gradient communication (``comm_timing`` ``none``: 0 s); under
    torch.compile the communication is not timed (``comm_timing`` null: compiled DDP splits the
    graph at buckets and the Python hook would be traced).
    """
    if not ph.enabled(environ):
        return None
    timer = ph.PhaseTimer(ph.clock_for(dev))
    if not distributed:
        timer.no_communication()
    elif strategy.time_comm is not None and not compiled:
        strategy.time_comm(timer, wrapped, model, optimizer)
    return timer


@contextlib.contextmanager
def keep_kernel_choice(optimizer: torch.optim.Optimizer) -> Any:
    """Keep each param group's ``fused``/``foreach`` through a ``load_state_dict`` inside the block.

    A state dict carries its writer's hyperparameters, these included: loading one written by a
    plain SGD (an older run, the CPU) into a fused one would set ``fused=False`` while the optimizer
    still says ``_step_supports_amp_scaling``, and GradScaler.step would then hand grad_scale and
    found_inf to the plain kernel ("Expected grad_scale and found_inf to be None", torch 2.14).
    """
    choice = [{k: g[k] for k in ("fused", "foreach") if k in g} for g in optimizer.param_groups]
    yield
    for group, kept in zip(optimizer.param_groups, choice, strict=True):
        group.update(kept)


def _restore(state: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
             scaler: Any, env: DistEnv, sharded: bool = False, folder: Path | None = None) -> int:
    with keep_kernel_choice(optimizer):
        ckpt.load_states(state, model, optimizer, sharded, folder)
    seed_momentum(optimizer)  # a state written before any step has no momentum buffers: fused SGD's would be garbage
    scheduler.load_state_dict(state["scheduler"])
    if state.get("optimizer_format") == "pipeline-dcp":
        from cyclone_kit.runtime.checkpoint import pipeline as pipeline_ckpt

        pipeline_ckpt.sync_lr(optimizer, scheduler)
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




def _progress(env: DistEnv, total: int, initial: int) -> Any:
    """A tqdm bar on rank 0 when stdout is a terminal (and tqdm is installed), else None."""
    if not env.is_main or not sys.stdout.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)

