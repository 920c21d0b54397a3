"""Strategy ``pipeline``: the model cut into balanced stages, run by ``torch.distributed.pipelining``,
with data parallelism across pipelines.

**Layout** (:func:`layout`): ``train.pipeline_stages = P`` (0: all ranks) ranks form one pipeline,
and ``world / P`` pipelines (replicas) train on different shards of the data, as DDP ranks do. A
DeviceMesh of shape (replicas, stages) names the groups: rank ``r`` holds stage ``r % P`` of
replica ``r // P``; the gradients of a stage are all-reduced (averaged) across its replicas after
the backward, and BatchNorm statistics follow replica 0's (DDP's ``broadcast_buffers``). So 16 GPUs
can be 4 stages x 4 replicas; a replica's global batch is ``train.batch_size`` and the run's is
``batch_size x replicas x grad_accum``, as DDP over ``replicas`` ranks.

**Stages** (:mod:`~cyclone_kit.runtime.engine.pipeline_split`): cut at block granularity and balanced by
each block's forward+backward time measured on the device at the start (rank 0 measures, every
rank uses its split; a resumed run reuses the split its checkpoint recorded).

**Schedule** (``train.pipeline_schedule``): ``gpipe`` (fill-drain), ``1f1b`` (one forward one
backward: fewer activations alive, needs ``microbatches >= P``) or ``interleaved_1f1b`` (every rank
holds 2 stages, a shorter bubble; needs ``2 P`` blocks) -- torch's own ScheduleGPipe, Schedule1F1B
and ScheduleInterleaved1F1B with :class:`torch.distributed.pipelining.PipelineStage`.

**Precision**: ``auto`` is bf16 on GPUs with native bf16, fp16 with a loss scale agreed by all
stages (:class:`LossScale`) on older ones; activations travel between stages in that dtype; fp32
on the CPU. cudnn.benchmark, ``train.channels_last`` and ``train.deterministic`` as in the DDP engine.

**Bubble**: every stage times its forward and backward computations inside each schedule step;
the rest of the step is idle (the pipeline bubble, and waiting for neighbours). Each step record
carries the per-stage compute and idle seconds (:data:`~cyclone_kit.rundir.contract.PIPELINE_STEP_FIELDS`),
for the report to set against the ideal bubble (P-1)/(M+P-1).

**Checkpoints**: torch.distributed.checkpoint (:mod:`~cyclone_kit.runtime.checkpoint.pipeline`): every
stage writes its own tensors under the full model's names, so a DDP run (any world size) loads
the weights and momentum, and a pipeline run can resume from a DDP checkpoint. With
``checkpoint.async_write`` (the default) every rank writes them in the background, as FSDP's shards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cyclone_kit.config.job import PIPELINE_SCHEDULES, JobSpec
from cyclone_kit.core.errors import ValidationError
from cyclone_kit.rundir.contract import pipeline_step_fields
from cyclone_kit.runtime import torchcompat
from cyclone_kit.runtime.checkpoint import pipeline as pck
from cyclone_kit.runtime.dist import side_group, warn, worker_cpus
from cyclone_kit.runtime.engine import pipeline_split as split
from cyclone_kit.runtime.engine.data import auto_workers, build_data
from cyclone_kit.runtime.engine.loop import SegmentLoop, Window, nonfinite_params
from cyclone_kit.runtime.engine.models import build_model
from cyclone_kit.runtime.engine.plan import (
    begin_segment,
    configure_backends,
    lr_factor,
    make_plan,
    resolve_precision,
    seed_everything,
    shards_in_background,
)
from cyclone_kit.runtime.env import DistEnv
from cyclone_kit.runtime.session import Session, open_session
from cyclone_kit.runtime.signals import StopFlag

#: Stages each rank holds under the interleaved schedule.
INTERLEAVED_VIRTUAL = 2


# --------------------------------------------------------------------------- layout (pure)
@dataclass(frozen=True)
class Layout:
    """Where this rank sits in the 2-D layout (pure function of the spec and the world size).

    Attributes:
        stages: ranks per pipeline (P).
        replicas: pipelines (world / P).
        virtual: stages per rank (2 for interleaved_1f1b, else 1).
        schedule: the schedule's name.
        microbatches: micro-batches per schedule step (M).
    """

    stages: int
    replicas: int
    virtual: int
    schedule: str
    microbatches: int

    @property
    def num_stages(self) -> int:
        """Model stages in all (P x virtual)."""
        return self.stages * self.virtual

    def pp_rank(self, rank: int) -> int:
        """The pipeline position of global ``rank``."""
        return rank % self.stages

    def dp_rank(self, rank: int) -> int:
        """The replica of global ``rank``."""
        return rank // self.stages

    def stage_indices(self, rank: int) -> list[int]:
        """The model stages global ``rank`` holds (loop order: p, p + P, ...)."""
        return [self.pp_rank(rank) + v * self.stages for v in range(self.virtual)]


def layout(world_size: int, pipeline_stages: int, schedule: str, microbatches: int, batch_size: int) -> Layout:
    """The layout of a run (pure).

    Raises:
        ValidationError: P does not divide the world, the batch does not split into equal
            micro-batches, or the schedule needs more micro-batches.
    """
    p = pipeline_stages or world_size
    if world_size % p:
        raise ValidationError(
            f"train.pipeline_stages={p} does not divide the {world_size} ranks",
            hint=f"use a divisor of {world_size} (each group of {p} ranks is one pipeline; world / P replicas)",
        )
    if schedule not in PIPELINE_SCHEDULES:
        raise ValidationError(f"unknown train.pipeline_schedule {schedule!r}",
                              hint=f"use one of: {', '.join(PIPELINE_SCHEDULES)}")
    if batch_size % microbatches:
        raise ValidationError(
            f"train.batch_size {batch_size} does not split into {microbatches} equal micro-batches",
            hint="with strategy=pipeline make train.batch_size a multiple of train.microbatches",
        )
    if schedule != "gpipe" and microbatches < p:
        raise ValidationError(
            f"train.pipeline_schedule={schedule} needs train.microbatches >= {p} stages, got {microbatches}",
            hint=f"--set train.microbatches={p} (or more), or train.pipeline_schedule=gpipe",
        )
    virtual = INTERLEAVED_VIRTUAL if schedule == "interleaved_1f1b" else 1
    if virtual > 1 and microbatches % max(1, microbatches // p):
        raise ValidationError(
            f"interleaved_1f1b needs train.microbatches ({microbatches}) to be a multiple of its rounds",
            hint=f"use a multiple of {p} micro-batches",
        )
    return Layout(p, world_size // p, virtual, schedule, microbatches)


# --------------------------------------------------------------------------- the stage
class StageModule(nn.Module):
    """A stage: consecutive blocks of the model, run under autocast; the activation it hands on
    is ``act_dtype`` and contiguous (the next stage's receive buffer is).

    ``names`` are the parts' prefixes in the full model, so :meth:`full_state_items` speaks the
    unsplit model's state-dict names (checkpoints a DDP run can load).
    """

    def __init__(self, blocks: Sequence[split.Block], *, device_type: str, dtype: torch.dtype | None,
                 channels_last: bool, is_last: bool) -> None:
        super().__init__()
        parts = [part for b in blocks for part in b.parts]
        self.names = [name for name, _ in parts]
        self.parts = nn.ModuleList(m for _, m in parts)
        self.device_type, self.dtype = device_type, dtype
        self.channels_last, self.is_last = channels_last, is_last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The stage's output for input ``x`` (logits on the last stage)."""
        if self.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        ctx = torch.autocast(self.device_type, dtype=self.dtype) if self.dtype else contextlib.nullcontext()
        with ctx:
            for part in self.parts:
                x = part(x)
        if not self.is_last:
            x = x.to(self.dtype or torch.float32).contiguous()
        return x

    def full_names(self) -> dict[str, str]:
        """This module's state-dict key -> the full model's (``parts.3.conv1.weight`` -> ``layer1.0.conv1.weight``)."""
        out = {}
        for i, (name, part) in enumerate(zip(self.names, self.parts, strict=True)):
            if name:
                for key in part.state_dict():
                    out[f"parts.{i}.{key}"] = f"{name}.{key}"
        return out


class Clock:
    """Compute time of a stage inside schedule steps: host clock on the CPU, CUDA events on a GPU
    (read once per log window, when the loss is read anyway). Forwards outside training steps
    (the validation's ``schedule.eval``) run under :meth:`paused` and are not collected."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.compute_s, self.total_s = 0.0, 0.0
        self.events: list[tuple[Any, Any]] = []
        self.steps: list[tuple[Any, Any]] = []
        self.running = True

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """A context whose stage computations are no training compute (not timed, not collected)."""
        was, self.running = self.running, False
        try:
            yield
        finally:
            self.running = was

    def mark(self) -> Any:
        """A point in time: a recorded CUDA event, or the host clock."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def add(self, start: Any, end: Any, step: bool = False) -> None:
        """Count ``start`` .. ``end`` as compute, or (``step``) as a whole schedule step."""
        if self.cuda:
            (self.steps if step else self.events).append((start, end))
        elif step:
            self.total_s += end - start
        else:
            self.compute_s += end - start

    def read(self) -> tuple[float, float]:
        """(compute, step) seconds since the last read."""
        if self.cuda:
            torch.cuda.synchronize()
            self.compute_s += sum(a.elapsed_time(b) for a, b in self.events) / 1000
            self.total_s += sum(a.elapsed_time(b) for a, b in self.steps) / 1000
            self.events, self.steps = [], []
        out = (self.compute_s, self.total_s)
        self.compute_s, self.total_s = 0.0, 0.0
        return out


def _timed_stage_class() -> type:
    from torch.distributed.pipelining import PipelineStage

    class TimedStage(PipelineStage):
        """A PipelineStage whose forward and backward computations are timed (:class:`Clock`)."""

        clock: Clock

        def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            if not self.clock.running:  # a validation forward
                return super().forward_one_chunk(*args, **kwargs)
            t0 = self.clock.mark()
            out = super().forward_one_chunk(*args, **kwargs)
            self.clock.add(t0, self.clock.mark())
            return out

        def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            if not self.clock.running:
                return super().backward_one_chunk(*args, **kwargs)
            t0 = self.clock.mark()
            out = super().backward_one_chunk(*args, **kwargs)
            self.clock.add(t0, self.clock.mark())
            return out

    return TimedStage


def build_schedule(lay: Layout, stages: list[Any], loss_fn: Callable[..., torch.Tensor]) -> Any:
    """torch's schedule object for ``lay`` over this rank's ``stages`` (gradients not rescaled:
    ``loss_fn`` carries 1/M)."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    if lay.schedule == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(stages, lay.microbatches, loss_fn=loss_fn,
                                       **torchcompat.schedule_kwargs(ScheduleInterleaved1F1B))
    cls = Schedule1F1B if lay.schedule == "1f1b" else ScheduleGPipe
    return cls(stages[0], lay.microbatches, loss_fn=loss_fn, **torchcompat.schedule_kwargs(cls))


def input_format(channels_last: bool, sample_shape: Sequence[int]) -> torch.memory_format:
    """The memory layout the batches reach stage 0 in (pure): NHWC for images under
    ``channels_last`` (the data loader's), else contiguous. ``sample_shape``: one sample's (C, H, W)."""
    return torch.channels_last if channels_last and len(sample_shape) == 3 else torch.contiguous_format


def stage_shapes(blocks: Sequence[split.Block], cuts: Sequence[int], sample: torch.Tensor) -> list[tuple[int, ...]]:
    """The per-sample shape of every stage's input, and last the output's, from a forward of
    ``sample`` (batch 1, eval mode, no gradients: nothing changes)."""
    shapes = []
    modules = [split.block_module(b) for b in blocks]
    was = [m.training for m in modules]
    x = sample[:1]
    with torch.no_grad():
        for s in range(len(cuts) - 1):
            shapes.append(tuple(x.shape[1:]))
            for m in modules[cuts[s]:cuts[s + 1]]:
                m.eval()
                x = m(x)
        shapes.append(tuple(x.shape[1:]))
    for m, training in zip(modules, was, strict=True):
        m.train(training)
    return shapes


# --------------------------------------------------------------------------- gradient sync
def allreduce_replicas(params: Sequence[torch.Tensor], group: Any, replicas: int) -> None:
    """Average the gradients of ``params`` across the replicas of this stage (one flat all-reduce)."""
    import torch.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    if replicas <= 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat.div_(replicas)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def broadcast_buffers(modules: Sequence[nn.Module], group: Any, src: int) -> None:
    """Replica 0's buffers (BatchNorm statistics) on every replica (DDP's broadcast_buffers)."""
    import torch.distributed as dist

    bufs = [b for m in modules for b in m.buffers()]
    if not bufs:
        return
    flat = torch.cat([b.detach().reshape(-1).double() for b in bufs])
    dist.broadcast(flat, src=src, group=group)
    offset = 0
    for b in bufs:
        b.copy_(flat[offset:offset + b.numel()].view_as(b).to(b.dtype))
        offset += b.numel()


# --------------------------------------------------------------------------- the engine
def _measured_balance(session: Session, lay: Layout, blocks: Sequence[split.Block], found: Any,
                      sample: torch.Tensor, autocast: Any) -> split.Balance:
    """The split: the one the checkpoint recorded (same blocks and stage count), else measured
    on rank 0 (the blocks are on ``sample``'s device there) and shared with every rank."""
    names = [b.name for b in blocks]
    recorded = ((found[0].get("pipeline") or {}).get("balance") if found else None) or {}
    if recorded.get("blocks") == names and len(recorded.get("cuts", ())) == lay.num_stages + 1:
        return split.Balance(tuple(names), tuple(recorded["block_times_s"]), tuple(recorded["cuts"]))
    times: list[Any] = [None]
    if session.env.is_main:
        times = [split.measure_block_times(blocks, sample, autocast=autocast)]
    if session.distributed:
        import torch.distributed as dist

        dist.broadcast_object_list(times, src=0, group=side_group())
    return split.balance(names, times[0], lay.num_stages)


def _groups(session: Session, lay: Layout, dev: torch.device) -> tuple[Any, Any]:
    """(pipeline group, replica group) of this rank from a (replicas, stages) DeviceMesh."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(dev.type, (lay.replicas, lay.stages), mesh_dim_names=("dp", "pp"))
    return mesh.get_group("pp"), mesh.get_group("dp")


@dataclass
class _Pipe:
    """This rank's part of the pipeline (built by :func:`_build`)."""

    lay: Layout
    balance: split.Balance
    modules: list[StageModule]
    schedule: Any
    clock: Clock
    weight: list[float]  # the loss factor the schedule's loss_fn applies: loss scale / (M x grad_accum)
    pp_group: Any
    dp_group: Any
    has_first: bool
    has_last: bool
    param_order: list[str]
    input_format: torch.memory_format  # the layout of stage 0's declared input, that batches are sent in

    def first_input(self, x: torch.Tensor) -> torch.Tensor:
        """Batch ``x`` in stage 0's declared layout (a no-op for the loader's batches; a padded
        validation batch comes out of ``torch.cat`` contiguous)."""
        return x.contiguous(memory_format=self.input_format)

    @property
    def params(self) -> list[torch.Tensor]:
        """The parameters of this rank's stages."""
        return [p for m in self.modules for p in m.parameters()]


def _build(session: Session, lay: Layout, tc: Any, info: Any, found: Any, dev: torch.device,
           dtype: torch.dtype | None, channels_last: bool) -> _Pipe:
    """The model built (same seed everywhere), cut, balanced; this rank's stages wrapped in
    PipelineStages and the schedule over them."""
    torch.manual_seed(tc.seed)  # the same full model on every rank, then each keeps its stages
    model = build_model(tc.model, info.num_classes, info.image_size, info.channels)
    blocks = split.model_blocks(model)
    order = [n for n, _ in model.named_parameters()]
    sample = torch.zeros(1, info.channels, info.image_size, info.image_size)
    mb = tc.batch_size // lay.microbatches
    autocast = (lambda: torch.autocast(dev.type, dtype=dtype)) if dtype else None
    if session.env.is_main:
        model.to(dev)
        probe = torch.randn(mb, *sample.shape[1:], device=dev)
        probe = probe.contiguous(memory_format=torch.channels_last) if channels_last else probe
        if channels_last:
            model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    bal = _measured_balance(session, lay, blocks, found, probe if session.env.is_main else sample, autocast)
    model.cpu()
    shapes = stage_shapes(blocks, bal.cuts, sample)
    pp_group, dp_group = _groups(session, lay, dev)
    timed, clock = _timed_stage_class(), Clock(dev)
    modules, stages = [], []
    act = dtype or torch.float32
    # Stage 0 is fed the loader's batches: NHWC under channels_last. torch checks every input's
    # strides against the declared buffer (always under TORCH_DISTRIBUTED_DEBUG=DETAIL), so the
    # buffer is declared in that layout; later stages receive contiguous activations (StageModule).
    fmt = input_format(channels_last, shapes[0])
    for s in lay.stage_indices(session.env.rank):
        last = s == lay.num_stages - 1
        module = StageModule(blocks[bal.cuts[s]:bal.cuts[s + 1]], device_type=dev.type, dtype=dtype,
                             channels_last=channels_last, is_last=last).to(dev)
        if channels_last:
            module = module.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        inp = torch.empty((mb, *shapes[s]), device=dev, dtype=torch.float32 if s == 0 else act)
        inp = inp.contiguous(memory_format=fmt) if s == 0 else inp
        out = torch.empty((mb, *shapes[s + 1]), device=dev, dtype=act)
        stage = timed(module, s, lay.num_stages, dev, input_args=(inp.requires_grad_(s > 0),),
                      output_args=(out.requires_grad_(),), group=pp_group)
        stage.clock = clock
        modules.append(module)
        stages.append(stage)
    del model, blocks
    weight = [1.0]
    criterion = nn.CrossEntropyLoss()

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return criterion(out.float(), y) * weight[0]

    return _Pipe(lay, bal, modules, build_schedule(lay, stages, loss_fn), clock, weight, pp_group, dp_group,
                 has_first=any(st.is_first for st in stages), has_last=any(st.is_last for st in stages),
                 param_order=order, input_format=fmt)


def train_pipeline(spec: JobSpec, run_dir: Path, env: DistEnv, environ: Mapping[str, str],
                   stop_flag: StopFlag | None = None) -> str:
    """Train ``spec`` with the pipeline strategy on this rank.

    Same contract as :func:`cyclone_kit.runtime.engine.dataparallel.train`: returns ``completed`` or
    ``preempted``; writes metrics (rank 0), rank summaries and checkpoints.

    Raises:
        ValidationError: the layout, the batch or the model does not fit the pipeline.
    """
    t_start = time.perf_counter()
    tc, cc = spec.train, spec.checkpoint
    lay = layout(env.world_size, tc.pipeline_stages, tc.pipeline_schedule, tc.microbatches, tc.batch_size)
    if tc.compile:
        warn("train.compile is ignored with strategy=pipeline")
    seed_everything(tc.seed)
    # The engine's set-up path (threads, device, process group, hosts, stop agreement): the public API's.
    session = open_session(env, environ, Path(run_dir), cc, pg_timeout_s=tc.pg_timeout_s, stop_flag=stop_flag,
                           t_start=t_start, group_for_one=True)
    session.max_nonfinite_steps = tc.max_nonfinite_steps
    device = session.device
    refused = torchcompat.pipeline_schedule_refusal(lay.schedule, device.kind, torch.__version__)
    if refused is not None:  # before any collective: every rank stops here with the same line
        raise ValidationError(refused[0], hint=refused[1])
    dev = torch.device(device.torch_device)
    configure_backends(tc, device.kind)
    channels_last = tc.channels_last and device.kind == "cuda"
    # Data parallelism across pipelines: every stage of replica d reads shard d of R.
    replica = dataclasses.replace(env, rank=lay.dp_rank(env.rank), world_size=lay.replicas, local_rank=0,
                                  local_world_size=1, node_rank=0, num_nodes=1)
    workers = auto_workers(tc.num_workers, worker_cpus(environ, env.local_world_size), tc.dataset != "imagefolder")
    data = build_data(tc, replica, dev, workers=workers, channels_last=channels_last)
    plan = make_plan(tc, lay.replicas, data.train.sampler.full_length())
    precision = resolve_precision(tc.precision, device.kind, device.native_bf16)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    found = session.load_latest() if cc.resume else None
    pipe = _build(session, lay, tc, data.info, found, dev, dtype, channels_last)
    seed_everything(tc.seed + env.rank)
    optimizer = _optimizer(pipe.params, plan.lr, tc, device.kind)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, plan.warmup_steps,
                                                                                   plan.total_steps))
    scaler = LossScale(dev, distributed=session.distributed) if precision == "fp16" else None
    loop = _Loop(session, spec, pipe, data, plan, optimizer, scheduler, scaler, dev)
    if data.val is not None and tc.val_every_epochs > 0 and not torchcompat.has_schedule_eval(pipe.schedule):
        loop.validates = False
        if env.is_main:
            warn(torchcompat.schedule_eval_line(torch.__version__))
    step = loop.resume(found) if found is not None else 0
    if not begin_segment(session, plan, tc, precision=precision, strategy="pipeline", step=step,
                         stages=lay.stages, replicas=lay.replicas, microbatches=lay.microbatches,
                         pipeline_schedule=lay.schedule, virtual_stages=lay.virtual,
                         balance=pipe.balance.record()):
        return "completed"
    if env.is_main:
        b = pipe.balance
        print(f"cyclone_kit: {tc.model} on {tc.dataset}, pipeline {lay.stages} stage(s) x {lay.replicas} "
              f"replica(s), {lay.schedule}, {lay.microbatches} micro-batches ({session.launcher}), {device.kind} "
              f"{precision}, batch {plan.global_batch}, lr {plan.lr:g}, steps {step}->{plan.total_steps}; "
              f"stages cut at blocks {list(b.cuts)}, slowest/mean {b.max_over_mean:.2f}"
              + (" (block granularity limits the balance)" if b.granularity_limited else ""), flush=True)
    return loop.run(step)  # the skeleton (engine/loop.py); a failure writes the ``failed`` end record first


def _optimizer(params: Sequence[torch.Tensor], lr: float, tc: Any, device_kind: str) -> torch.optim.Optimizer:
    """The stages' SGD: fused where the DDP engine's is (CUDA, :func:`~cyclone_kit.runtime.engine.dataparallel.use_fused_sgd`),
    so that :class:`LossScale` skips an overflowed fp16 step on the device; fused momentum buffers seeded."""
    from cyclone_kit.runtime.engine import dataparallel as engine  # looked up at call time (tests force the CUDA choice)

    extra = {"fused": True} if engine.use_fused_sgd("pipeline", device_kind) else {}
    optimizer = torch.optim.SGD(params, lr=lr, momentum=tc.momentum, weight_decay=tc.weight_decay, **extra)
    engine.seed_momentum(optimizer)
    return optimizer


class _Loop(SegmentLoop):
    """One pipeline training segment: the skeleton's step, log, validation and checkpoint for this
    rank's stages (private; built by :func:`train_pipeline`)."""

    def __init__(self, session: Session, spec: JobSpec, pipe: _Pipe, data: Any, plan: Any, optimizer: Any,
                 scheduler: Any, scaler: LossScale | None, dev: torch.device) -> None:
        self.session, self.env, self.tc, self.cc = session, session.env, spec.train, spec.checkpoint
        self.pipe, self.lay, self.data, self.plan = pipe, pipe.lay, data, plan
        self.optimizer, self.scheduler, self.scaler, self.dev = optimizer, scheduler, scaler, dev
        self.start_state()  # validates: set False when this torch has no schedule.eval (torchcompat)
        self.async_shards = session.distributed and self.cc.async_write and shards_in_background(self.env.is_main)

    # -- one optimizer step: grad_accum schedule steps, then the replicas' gradients averaged
    def train_step(self, batches: Any, window: Window, loss_sum: torch.Tensor) -> torch.Tensor:
        pipe, accum = self.pipe, self.plan.grad_accum
        scale = self.scaler.scale if self.scaler is not None else 1.0
        pipe.weight[0] = scale / (self.lay.microbatches * accum)
        loss = torch.zeros((), device=self.dev)
        for _ in range(accum):
            t0 = time.perf_counter()
            x, y = next(batches)
            x = pipe.first_input(x) if pipe.has_first else x
            window.data_s += time.perf_counter() - t0
            losses: list[torch.Tensor] = []
            start = pipe.clock.mark()
            pipe.schedule.step(*((x,) if pipe.has_first else ()), target=y if pipe.has_last else None, losses=losses)
            pipe.clock.add(start, pipe.clock.mark(), step=True)
            if losses:
                loss = loss + torch.stack([v.detach().float() for v in losses]).sum() / scale
        if self.lay.replicas > 1:
            allreduce_replicas(pipe.params, pipe.dp_group, self.lay.replicas)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if self.lay.replicas > 1:
            broadcast_buffers(pipe.modules, pipe.dp_group, src=self.lay.pp_rank(self.env.rank))
        return loss_sum + loss

    def begin(self) -> None:
        self.pipe.clock.read()  # the stage clock starts empty

    def params(self) -> list[torch.Tensor]:
        return self.pipe.params

    def log(self, step: int, epoch: int, loss_sum: torch.Tensor, window: Window) -> None:
        n = window.steps
        # The window's loss and how many of the stages' parameter tensors are not finite: one all-reduce.
        packed = torch.stack([loss_sum / n, nonfinite_params(self.pipe.params).to(loss_sum.device)])
        if self.session.distributed:  # the loss lives on the last stage of each replica; the others add 0
            import torch.distributed as dist

            dist.all_reduce(packed)
        loss, bad = packed.tolist()  # waits for the device (the all-reduce follows the last stages' work)
        value = loss / self.lay.replicas if self.session.distributed else loss
        compute_s, total_s = self.pipe.clock.read()
        every = self.session.gather_to_main((compute_s, total_s))
        elapsed = max(time.perf_counter() - window.start, 1e-9)
        samples = self.plan.global_batch * n
        local = self.plan.per_device_batch * self.plan.grad_accum * n  # every stage of a replica sees its batch
        extra = pipeline_step_fields(*_per_stage(every, self.lay, n)) if self.env.is_main else {}
        rate = self.session.log_window(step, epoch, value, n, elapsed, window.data_s, samples, local, **extra)
        if self.env.is_main:
            idle = extra.get("stage_idle_s") or [0.0]
            print(f"step {step}/{self.plan.total_steps} epoch {epoch} loss {value:.4f} "
                  f"step {elapsed / n * 1000:.1f} ms {rate:.1f} samples/s, idle per stage "
                  + " ".join(f"{t * 1000:.0f}" for t in idle) + " ms", flush=True)
        self.judge_params(step, int(bad))

    @torch.no_grad()
    def validate(self) -> float | None:
        """Accuracy over the validation shards: every stage of a replica runs the same batches
        through the schedule's forward, padded to the training batch (the stages' buffers' size)."""
        pipe, batch = self.pipe, self.tc.batch_size
        for m in pipe.modules:
            m.eval()
        counts = torch.zeros(2, dtype=torch.float64, device=self.dev)
        self.data.val.set_epoch(0)
        for x, y in self.data.val:
            n = x.shape[0]
            if n < batch:
                x = torch.cat([x, x.new_zeros((batch - n, *x.shape[1:]))])
                y = torch.cat([y, y.new_zeros(batch - n)])
            x = pipe.first_input(x) if pipe.has_first else x
            with pipe.clock.paused():  # no training compute: the next window's bubble stays measured
                out = pipe.schedule.eval(*((x,) if pipe.has_first else ()), target=y if pipe.has_last else None)
            if pipe.has_last and out is not None:
                counts[0] += (out[:n].argmax(1) == y[:n]).sum()
                counts[1] += n
        for m in pipe.modules:
            m.train()
        if self.session.distributed:
            import torch.distributed as dist

            dist.all_reduce(counts)
        correct, total = counts.tolist()
        return correct / total if total else None

    # -- checkpoints
    def write_checkpoint(self, step: int, epoch: int) -> None:
        """Every rank writes its stages' tensors (DCP; in the background with ``checkpoint.async_write``); rank 0
        then the small ``.pt`` naming them (then: once every rank's write is done, ``Session.finish_shards``)."""
        from cyclone_kit.runtime import checkpoint as ckpt
        from cyclone_kit.runtime.checkpoint import fsdp as fsdp_ckpt

        folder, shards, staged_s = self.session.checkpoint_dir, None, 0.0
        if self.async_shards:
            # The previous stages' .pt first: at most one write in flight, and its prune never meets these.
            self.session.finish_shards(before=step)
            t0 = time.perf_counter()
            entries, shards = pck.start_stages(folder, step, self.pipe.modules, self.optimizer)
            staged_s = time.perf_counter() - t0
        else:
            entries = pck.save_stages(folder, step, self.pipe.modules, self.optimizer)
        rngs = self.session.gather_to_main(ckpt.capture_rng())
        state: dict[str, Any] | None = None
        if self.env.is_main:
            lay = self.lay
            state = {
                **entries,
                "strategy": "pipeline",
                **self.position_state(step, epoch, rngs),
                "pipeline": {"stages": lay.stages, "replicas": lay.replicas, "schedule": lay.schedule,
                             "microbatches": lay.microbatches, "balance": self.pipe.balance.record()},
            }
            if self.scaler is not None:
                state["loss_scale"] = self.scaler.state_dict()
        if shards is not None:  # the .pt once every rank's stages are written (session.finish_shards)
            self.session.save_after_shards(state, step, shards, after_write=fsdp_ckpt.prune, staged_s=staged_s)
            return
        self.session.save(state, step, after_write=fsdp_ckpt.prune)

    def resume(self, found: tuple[dict[str, Any], Path]) -> int:
        """Load ``found`` (the newest checkpoint, chosen by rank 0) into this rank's stages; its step."""
        from cyclone_kit.runtime import checkpoint as ckpt
        from cyclone_kit.runtime.engine.dataparallel import seed_momentum

        state, path = found
        fmt = state.get("optimizer_format")
        if fmt == "dcp":
            raise ValidationError(
                f"checkpoint {path.name} holds FSDP shards (checkpoint.sharded); the pipeline cannot resume it",
                hint="resume with train.strategy=fsdp, or start a new run directory",
            )
        if fmt == pck.FORMAT:
            pck.load_stages(path.parent / state["model"]["dcp"], self.pipe.modules, self.optimizer)
        else:  # a DDP/FSDP/Horovod checkpoint: the full model's state dict
            restored = pck.load_from_full(state, self.pipe.modules, self.optimizer, self.pipe.param_order)
            if self.env.is_main and not restored:
                warn(f"checkpoint {path.name} was written by a {state.get('strategy', 'ddp')} run: "
                     "weights restored, optimizer momentum restarts")
        seed_momentum(self.optimizer)  # a parameter the checkpoint held no momentum for: fused SGD's would be garbage
        self.scheduler.load_state_dict(state["scheduler"])
        pck.sync_lr(self.optimizer, self.scheduler)
        if len(state.get("rng") or []) == self.env.world_size:
            ckpt.restore_rng(state["rng"][self.env.rank])
        if self.scaler is not None and "loss_scale" in state:
            self.scaler.load_state_dict(state["loss_scale"])
        if self.env.is_main:
            print(f"cyclone_kit: resumed from {path} at step {state['step']}", flush=True)
        return int(state["step"])


def _per_stage(every: Sequence[tuple[float, float]], lay: Layout, steps: int) -> tuple[list[float], list[float]]:
    """Per pipeline position: mean compute and idle seconds per optimizer step over the replicas (pure)."""
    compute, idle = [0.0] * lay.stages, [0.0] * lay.stages
    for rank, (c, total) in enumerate(every):
        p = lay.pp_rank(rank)
        compute[p] += c / lay.replicas / steps
        idle[p] += max(total - c, 0.0) / lay.replicas / steps
    return compute, idle


class LossScale:
    """Dynamic loss scaling for fp16 across pipeline stages (GradScaler's rule, agreed by all).

    A stage alone cannot use ``torch.amp.GradScaler``: the loss lives on the last stage, and
    every stage must skip the same steps. After the backward, each stage checks its gradients
    for inf/NaN into a flag on its device (``torch._amp_foreach_non_finite_check_and_unscale_``,
    GradScaler's kernel); the flags are all-reduced (MAX) on the device, over every rank of the
    world; all stages then unscale and step, or all skip and halve the scale. After
    ``growth_interval`` good steps the scale doubles (``torch._amp_update_scale_``, on the device).

    No host sync in a step with a fused SGD (the engine's on CUDA): the kernel takes the scale and
    the agreed flag as tensors, unscales the gradients and skips an overflowed step itself, as under
    GradScaler. A plain SGD cannot skip on the device: its step reads the flag on the host (the
    CPU's case, where that costs nothing).

    Args:
        device: where the scale, the flag and the gradients live.
        init_scale: the first scale (2^16, GradScaler's).
        growth_interval: good steps before the scale doubles.
        distributed: all-reduce the flag over ``group``.
        group: the ranks that agree (None: the default group, i.e. every stage of every replica).
    """

    def __init__(self, device: torch.device | str = "cpu", init_scale: float = 2.0**16, growth_interval: int = 2000,
                 distributed: bool = False, group: Any = None) -> None:
        self.device = torch.device(device)
        self.scale = torch.full((), init_scale, dtype=torch.float32, device=self.device)
        self.growth = torch.zeros((), dtype=torch.int32, device=self.device)  # good steps since the last change
        self.growth_interval, self.distributed, self.group = growth_interval, distributed, group

    def step(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """Unscale the gradients and step ``optimizer`` unless any stage saw inf/NaN, then update the
        scale. Returns the agreed flag (1 element on the device, 1.0: the step was skipped): read it
        where the host syncs anyway."""
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        fused = bool(optimizer.param_groups) and all(g.get("fused") for g in optimizer.param_groups)
        found = torch.zeros(1, dtype=torch.float32, device=self.device)
        # fused: only check (the kernel unscales); plain: check and unscale in the same pass
        inv = torch.ones((), dtype=torch.float32, device=self.device) if fused else self.scale.double().reciprocal().float()
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for grad in grads:
            by_dtype.setdefault(grad.dtype, []).append(grad)
        for same in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(same, found, inv)
        if self.distributed:
            import torch.distributed as dist

            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.group)  # queued on the device, no host wait
        if fused:
            optimizer.grad_scale, optimizer.found_inf = self.scale, found  # type: ignore[attr-defined]
            try:
                optimizer.step()
            finally:
                del optimizer.grad_scale, optimizer.found_inf  # type: ignore[attr-defined]
        elif not found.item():  # plain SGD: the host decides (the CPU's path)
            optimizer.step()
        torch._amp_update_scale_(self.scale, self.growth, found, 2.0, 0.5, self.growth_interval)
        return found

    def state_dict(self) -> dict[str, float]:
        """The scale and the count of good steps since it last changed (for checkpoints: read on the host)."""
        return {"scale": float(self.scale), "good": int(self.growth)}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        """Restore :meth:`state_dict`."""
        self.scale.fill_(float(state["scale"]))
        self.growth.fill_(int(state["good"]) % self.growth_interval)


def to_cpu(obj: Any) -> Any:
    """``obj`` (nested dicts, lists, tuples) with every tensor copied to the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(to_cpu(v) for v in obj)
    return obj
