"""Strategy ``pipeline``: the model split into one stage per rank, trained with micro-batches (GPipe).

Every rank builds the same model (same seed), cuts it into ``world_size`` consecutive stages
(:func:`split_model`, balanced by parameter count) and keeps only its own stage. There is no
data parallelism: every rank reads the same batches (the data is built for a world of one), the
first stage feeds the images in, the last one computes the loss. Each optimizer step is
``grad_accum`` batches of ``train.batch_size``, each cut into ``train.microbatches``
micro-batches. The schedule (:func:`schedule`, pure; run by :func:`pipeline_step`) is GPipe's
fill-drain: every stage runs the forwards of all micro-batches (sending each activation on as
soon as it has it, so stage k works on micro-batch m while stage k+1 works on m-1), then the
backwards in the same order. Between two neighbours the sends of one side and the receives of
the other come in the same order (:func:`order_mismatches` checks it): NCCL runs the
point-to-point operations of a pair of ranks in order on one stream, so a send that the peer
receives only after a send of its own, larger than NCCL's buffer, waits forever.

Precision: ``auto`` is bf16 on GPUs with native bf16 (sm_80+) and fp16 with a loss scale
(:class:`LossScale`, agreed by all stages) on older ones (V100), fp32 on the CPU.

The metrics contract is the engine's (start, step, epoch and end records on rank 0, a summary
per rank). Checkpoints use the engine's format: ``model`` is the full, unsplit state dict
(gathered from all stages, so a DDP run can load it), ``optimizer`` holds one state per stage.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cyclone_kit.config.job import JobSpec
from cyclone_kit.core.errors import ValidationError
from cyclone_kit.runtime import checkpoint as ckpt
from cyclone_kit.runtime import metrics as mx
from cyclone_kit.runtime.data import auto_workers, build_data
from cyclone_kit.runtime.dist import side_group, warn, worker_cpus
from cyclone_kit.runtime.env import DistEnv
from cyclone_kit.runtime.models import TinyCNN, build_model
from cyclone_kit.runtime.plan import begin_segment, lr_factor, make_plan, resolve_precision, seed_everything
from cyclone_kit.runtime.session import Session, open_session
from cyclone_kit.runtime.signals import NONE, StopFlag


# --------------------------------------------------------------------------- the split
@dataclass
class Stage:
    """One pipeline stage: consecutive layers of the model, by their names in the full model.

    Attributes:
        index: 0 .. num_stages-1.
        num_stages: stages in the pipeline.
        layers: (name in the full model's state dict, or "" for a parameter-free op, module).
    """

    index: int
    num_stages: int
    layers: list[tuple[str, nn.Module]]

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def module(self) -> nn.Sequential:
        """The stage as one module (shares the layers)."""
        return nn.Sequential(*(m for _, m in self.layers))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's entries of the full model's state dict (CPU tensors)."""
        out: dict[str, torch.Tensor] = {}
        for name, layer in self.layers:
            if name:
                for key, value in layer.state_dict().items():
                    out[f"{name}.{key}"] = value.detach().cpu()
        return out

    def load_state_dict(self, full: Mapping[str, torch.Tensor]) -> None:
        """Load this stage's entries from a full (unsplit) model state dict."""
        for name, layer in self.layers:
            if name:
                prefix = f"{name}."
                layer.load_state_dict({k[len(prefix):]: v for k, v in full.items() if k.startswith(prefix)})


def sequential_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model as a flat list of (state-dict name, layer) run in order, for models whose
    forward is a plain chain (the tiny CNN, ResNets, MobileNetV3).

    Raises:
        ValidationError: the architecture has no known chain form (ViT).
    """
    import torchvision

    if isinstance(model, TinyCNN):
        return [(f"features.{i}", m) for i, m in enumerate(model.features)] + [
            ("", nn.Flatten(1)), ("classifier", model.classifier)]
    if isinstance(model, torchvision.models.ResNet):
        names = ["conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4", "avgpool"]
        return [(n, getattr(model, n)) for n in names] + [("", nn.Flatten(1)), ("fc", model.fc)]
    if isinstance(model, torchvision.models.MobileNetV3):
        return [(f"features.{i}", m) for i, m in enumerate(model.features)] + [
            ("avgpool", model.avgpool), ("", nn.Flatten(1))] + [
            (f"classifier.{i}", m) for i, m in enumerate(model.classifier)]
    raise ValidationError(
        f"train.strategy 'pipeline' cannot split a {type(model).__name__} into stages",
        hint="use tiny_cnn, a resnet or a mobilenet_v3 model with the pipeline strategy, or strategy=fsdp",
    )


def split_points(sizes: Sequence[int], num_stages: int) -> list[int]:
    """Start indices of ``num_stages`` consecutive, non-empty chunks of ``sizes`` with about
    equal sums (greedy on the running total; pure)."""
    if not 1 <= num_stages <= len(sizes):
        raise ValidationError(
            f"cannot split {len(sizes)} layers into {num_stages} pipeline stages",
            hint="run the pipeline strategy with at most as many ranks as the model has layers",
        )
    total = sum(sizes)
    starts, running = [0], 0
    for i, size in enumerate(sizes[:-1]):
        running += size
        stages_left = num_stages - len(starts)
        layers_left = len(sizes) - (i + 1)
        if stages_left and (running >= total * len(starts) / num_stages or layers_left == stages_left):
            starts.append(i + 1)
    return starts


def split_model(model: nn.Module, num_stages: int) -> list[Stage]:
    """Cut ``model`` into ``num_stages`` stages of about equal parameter count (sharing layers)."""
    layers = sequential_layers(model)
    sizes = [sum(p.numel() for p in m.parameters()) + 1 for _, m in layers]  # +1: no empty compute
    starts = [*split_points(sizes, num_stages), len(layers)]
    return [Stage(i, num_stages, layers[starts[i]:starts[i + 1]]) for i in range(num_stages)]


# --------------------------------------------------------------------------- the schedule
def _chunks(x: torch.Tensor, microbatches: int) -> list[torch.Tensor]:
    return list(torch.tensor_split(x, min(microbatches, x.shape[0])))


def pipeline_forward(stage: Stage, x: torch.Tensor, microbatches: int, shape: Sequence[int]) -> torch.Tensor | None:
    """Inference through the pipeline: the logits on the last stage, None on the others.

    ``x`` is the full batch (read by the first stage; the others use only its size);
    ``shape`` is the per-sample shape of this stage's input (:func:`stage_input_shapes`).
    """
    import torch.distributed as dist

    module, rank = stage.module, stage.index
    sends, outs = [], []
    for xm in _chunks(x, microbatches):
        inp = xm if stage.is_first else _recv((xm.shape[0], *shape), x.device, rank - 1)
        out = module(inp)
        if stage.is_last:
            outs.append(out)
        else:
            sends.append(dist.isend(out.detach().float().contiguous(), rank + 1))
    for work in sends:
        work.wait()
    return torch.cat(outs) if stage.is_last else None


@dataclass(frozen=True)
class Op:
    """One operation of a stage's schedule: ``recv_act``, ``forward``, ``send_act``, ``recv_grad``,
    ``backward`` or ``send_grad`` of micro-batch ``micro``; ``peer`` is the other stage of a
    send or receive (None for compute)."""

    kind: str
    micro: int
    peer: int | None = None


def schedule(index: int, num_stages: int, microbatches: int) -> list[Op]:
    """The operations of stage ``index`` for one batch, in order (pure): GPipe fill-drain, all
    forwards then all backwards, both in micro-batch order (see the module doc)."""
    first, last = index == 0, index == num_stages - 1
    ops: list[Op] = []
    for m in range(microbatches):
        if not first:
            ops.append(Op("recv_act", m, index - 1))
        ops.append(Op("forward", m))
        if not last:
            ops.append(Op("send_act", m, index + 1))
    for m in range(microbatches):
        if not last:
            ops.append(Op("recv_grad", m, index + 1))
        ops.append(Op("backward", m))
        if not first:
            ops.append(Op("send_grad", m, index - 1))
    return ops


def order_mismatches(schedules: Sequence[Sequence[Op]]) -> list[str]:
    """Where the communication of neighbouring stages does not match in order (pure; [] = none).

    For each pair (k, k+1), stage k's sends to and receives from k+1, in its order, must be
    stage k+1's receives from and sends to k, in the same order (each send met by the
    receive the peer posts at that point), as NCCL needs for blocking point-to-point calls.
    """
    def channel(ops: Sequence[Op], peer: int) -> list[tuple[str, str, int]]:
        out = []
        for op in ops:
            if op.peer == peer:
                direction, what = op.kind.split("_")
                out.append((direction, what, op.micro))
        return out

    flip = {"send": "recv", "recv": "send"}
    problems = []
    for k in range(len(schedules) - 1):
        mine, raw = channel(schedules[k], k + 1), channel(schedules[k + 1], k)
        theirs = [(flip[d], what, m) for d, what, m in raw]
        for i, (a, b) in enumerate(zip(mine, theirs, strict=False)):
            if a != b:
                problems.append(f"stages {k}-{k + 1}, operation {i}: stage {k} posts {a}, stage {k + 1} posts {raw[i]}")
                break
        else:
            if len(mine) != len(theirs):
                problems.append(f"stages {k}-{k + 1}: {len(mine)} vs {len(theirs)} operations")
    return problems


def pipeline_step(stage: Stage, x: torch.Tensor, y: torch.Tensor, microbatches: int, shape: Sequence[int],
                  criterion: nn.Module, scale: float, autocast: Any, loss_scale: float = 1.0) -> torch.Tensor:
    """Forward and backward of one batch (:func:`schedule`); gradients accumulate in the stage's
    parameters.

    The loss of each micro-batch is weighted by its share of the batch and by ``scale``
    (1/grad_accum), so the gradients equal those of the whole batch; ``loss_scale`` (fp16)
    multiplies the backward only. Returns the batch's loss (times ``scale``) on the last
    stage, 0 on the others.
    """
    import torch.distributed as dist

    module, rank = stage.module, stage.index
    xs, ys = _chunks(x, microbatches), _chunks(y, microbatches)
    sends: list[Any] = []
    inputs: dict[int, torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}
    grads: dict[int, torch.Tensor] = {}
    loss_sum = torch.zeros((), device=x.device)
    n = x.shape[0]
    for op in schedule(stage.index, stage.num_stages, len(xs)):
        m = op.micro
        if op.kind == "recv_act":
            inputs[m] = _recv((xs[m].shape[0], *shape), x.device, rank - 1).requires_grad_()
        elif op.kind == "forward":
            inp = xs[m] if stage.is_first else inputs[m]
            with autocast():
                out = module(inp if stage.is_first else inp.clone())  # a clone: the stage may start in-place (ReLU)
                if stage.is_last:
                    out = criterion(out, ys[m]) * (xs[m].shape[0] / n) * scale
            outputs[m] = out
            if stage.is_last:
                loss_sum = loss_sum + out.detach().float()
        elif op.kind == "send_act":
            sends.append(dist.isend(outputs[m].detach().float().contiguous(), rank + 1))
        elif op.kind == "recv_grad":
            grads[m] = _recv(outputs[m].shape, x.device, rank + 1)
        elif op.kind == "backward":
            out = outputs.pop(m)
            if stage.is_last:
                (out * loss_scale if loss_scale != 1.0 else out).backward()
            else:
                out.backward(grads.pop(m).to(out.dtype))
        elif op.kind == "send_grad":
            sends.append(dist.isend(inputs.pop(m).grad.contiguous(), rank - 1))
    for work in sends:
        work.wait()
    return loss_sum


class LossScale:
    """Dynamic loss scaling for fp16 across pipeline stages (GradScaler's rule, agreed by all).

    A stage alone cannot use ``torch.amp.GradScaler``: the loss lives on the last stage, and
    every stage must skip the same steps. After the backward, each stage checks its gradients
    for inf/NaN; the flags are all-reduced (MAX); all stages then unscale and step, or all
    skip and halve the scale. After ``growth_interval`` good steps the scale doubles.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_interval: int = 2000, distributed: bool = False,
                 group: Any = None) -> None:
        self.scale, self.growth_interval = init_scale, growth_interval
        self.distributed, self.group, self.good = distributed, group, 0

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale the gradients and step ``optimizer`` unless any stage saw inf/NaN; returns
        whether it stepped."""
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        bad = torch.zeros(1)
        if grads:  # one host sync for all of the stage's gradients
            bad = torch.stack([~torch.isfinite(g).all() for g in grads]).any().float().reshape(1).cpu()
        if self.distributed:
            import torch.distributed as dist

            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.group)
        if bad.item():
            self.scale, self.good = self.scale / 2, 0
            return False
        for grad in grads:
            grad.mul_(1.0 / self.scale)
        optimizer.step()
        self.good += 1
        if self.good % self.growth_interval == 0:
            self.scale *= 2
        return True

    def state_dict(self) -> dict[str, float]:
        """The scale and the count of good steps (for checkpoints)."""
        return {"scale": self.scale, "good": self.good}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        """Restore :meth:`state_dict`."""
        self.scale, self.good = float(state["scale"]), int(state["good"])


def _recv(shape: Sequence[int], device: torch.device, src: int) -> torch.Tensor:
    import torch.distributed as dist

    buf = torch.empty(tuple(shape), device=device)
    dist.recv(buf, src)
    return buf


def stage_input_shapes(stages: Sequence[Stage], sample: torch.Tensor) -> list[tuple[int, ...]]:
    """The per-sample input shape of every stage, found by running ``sample`` (batch 1) through
    copies of the stages on the CPU (before the ranks drop the stages they do not own)."""
    import copy

    shapes = []
    x = sample[:1].detach().cpu().float()
    with torch.no_grad():
        for stage in stages:
            shapes.append(tuple(x.shape[1:]))
            module = copy.deepcopy(stage.module).cpu().float().eval()
            x = module(x)
    return shapes


# --------------------------------------------------------------------------- the engine variant
def train_pipeline(spec: JobSpec, run_dir: Path, env: DistEnv, environ: Mapping[str, str],
                   stop_flag: StopFlag | None = None) -> str:
    """Train ``spec`` with the pipeline strategy on this rank (stage ``env.rank``).

    Same contract as :func:`cyclone_kit.runtime.train.train`: returns ``completed`` or
    ``preempted``; writes metrics (rank 0), rank summaries and checkpoints.

    Raises:
        ValidationError: the model cannot be split, or the batch is smaller than the micro-batches.
    """
    t_start = time.perf_counter()
    run_dir = Path(run_dir)
    tc, cc = spec.train, spec.checkpoint
    if tc.batch_size < tc.microbatches:
        raise ValidationError(
            f"train.batch_size {tc.batch_size} is smaller than train.microbatches {tc.microbatches}",
            hint="with strategy=pipeline, train.batch_size is the batch every stage sees; make it >= microbatches",
        )
    if tc.compile:
        warn("train.compile is ignored with strategy=pipeline")
    seed_everything(tc.seed)
    # The engine's set-up path (threads, device, process group, hosts, stop agreement): the public API's.
    session = open_session(env, environ, run_dir, cc, pg_timeout_s=tc.pg_timeout_s, stop_flag=stop_flag,
                           t_start=t_start)
    device, distributed = session.device, session.distributed
    dev = torch.device(device.torch_device)

    # No data parallelism: every stage reads the batches a world of one would read.
    solo = dataclasses.replace(env, rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0,
                               num_nodes=1)
    workers = auto_workers(tc.num_workers, worker_cpus(environ, env.local_world_size), tc.dataset != "imagefolder")
    data = build_data(tc, solo, dev, workers=workers)
    plan = make_plan(tc, 1, data.train.sampler.full_length())
    precision = resolve_precision(tc.precision, device.kind, device.native_bf16)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    scaler = LossScale(distributed=distributed, group=side_group()) if precision == "fp16" else None

    torch.manual_seed(tc.seed)  # the same full model on every rank, then each keeps its stage
    info = data.info
    model = build_model(tc.model, info.num_classes, info.image_size, info.channels)
    stages = split_model(model, env.world_size)
    shapes = stage_input_shapes(stages, torch.zeros(1, info.channels, info.image_size, info.image_size))
    stage, shape = stages[env.rank], shapes[env.rank]
    del model, stages
    module = stage.module.to(dev)
    seed_everything(tc.seed + env.rank)
    params = list(module.parameters())
    optimizer = torch.optim.SGD(params, lr=plan.lr, momentum=tc.momentum, weight_decay=tc.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, plan.warmup_steps,
                                                                                   plan.total_steps))
    autocast = (lambda: torch.autocast(device_type=dev.type, dtype=dtype)) if dtype else contextlib.nullcontext

    state = _State(session, stage, optimizer, scheduler, plan, scaler)
    step = state.resume() if cc.resume else 0
    launcher = session.launcher
    if not begin_segment(session, plan, tc, precision=precision, strategy="pipeline", step=step,
                         stages=env.world_size, microbatches=tc.microbatches):
        return "completed"
    if env.is_main:
        print(f"cyclone_kit: {tc.model} on {tc.dataset}, pipeline of {env.world_size} stage(s) x "
              f"{tc.microbatches} micro-batches ({launcher}), {device.kind} {precision}, batch {plan.global_batch}, "
              f"lr {plan.lr:g}, steps {step}->{plan.total_steps}", flush=True)

    criterion = nn.CrossEntropyLoss()
    epoch = step // plan.steps_per_epoch
    try:
        data.train.set_epoch(epoch, (step - epoch * plan.steps_per_epoch) * plan.grad_accum)
        batches = iter(data.train)
        epoch_t0 = window_t0 = time.perf_counter()
        window_steps, data_s = 0, 0.0
        loss_sum = torch.zeros((), device=dev)
        agreed = NONE
        module.train()
        while step < plan.total_steps:
            for _ in range(plan.grad_accum):
                t0 = time.perf_counter()
                x, y = next(batches)
                data_s += time.perf_counter() - t0
                loss_sum = loss_sum + pipeline_step(stage, x, y, tc.microbatches, shape, criterion,
                                                    1.0 / plan.grad_accum, autocast,
                                                    scaler.scale if scaler is not None else 1.0)
            if scaler is not None:
                scaler.step(optimizer)
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            step += 1
            window_steps += 1
            if step % tc.log_every == 0 or step == plan.total_steps:
                loss = loss_sum / window_steps
                if distributed:  # the loss lives on the last stage; the others add 0
                    import torch.distributed as dist

                    dist.all_reduce(loss, op=dist.ReduceOp.SUM)
                value = float(loss.item())  # waits for the GPU (the all-reduce follows the last stage's work)
                elapsed = max(time.perf_counter() - window_t0, 1e-9)
                samples = plan.global_batch * window_steps  # every stage works on every sample
                rate = session.log_window(step, epoch, value, window_steps, elapsed, data_s, samples, samples)
                if env.is_main:
                    print(f"step {step}/{plan.total_steps} epoch {epoch} loss {value:.4f} "
                          f"step {elapsed / window_steps * 1000:.1f} ms {rate:.1f} samples/s", flush=True)
                loss_sum = torch.zeros((), device=dev)
                window_t0, window_steps, data_s = time.perf_counter(), 0, 0.0
            agreed = session.poll(step)
            if agreed != NONE:
                break
            if cc.every_steps and step % cc.every_steps == 0 and step < plan.total_steps:
                state.save(step, epoch)
            if step % plan.steps_per_epoch == 0:
                _end_epoch(session, stage, data, shape, tc.microbatches, epoch, time.perf_counter() - epoch_t0,
                           tc.val_every_epochs > 0 and (epoch + 1) % tc.val_every_epochs == 0, dev)
                epoch += 1
                if step < plan.total_steps:
                    data.train.set_epoch(epoch, 0)
                    batches = iter(data.train)
                    epoch_t0 = time.perf_counter()
        session.settle()
        if agreed == NONE and step % plan.steps_per_epoch:
            _end_epoch(session, stage, data, shape, tc.microbatches, epoch, time.perf_counter() - epoch_t0,
                       tc.val_every_epochs > 0, dev)
        state.save(step, epoch)
    except BaseException:
        session.end("failed", step, plan.total_steps)
        raise
    status = "completed" if agreed == NONE else session.stop_status()  # a user's cancel: cancelled
    # The end record, this rank's summary, the closing line and, after the requeue signal, the requeue.
    session.end(status, step, plan.total_steps)
    return status


@torch.no_grad()
def _end_epoch(session: Session, stage: Stage, data: Any, shape: Sequence[int], microbatches: int, epoch: int,
               seconds: float, validate: bool, dev: torch.device) -> None:
    env, distributed = session.env, session.distributed
    accuracy = None
    if validate and data.val is not None:
        module = stage.module
        module.eval()
        counts = torch.zeros(2, dtype=torch.float64, device=dev)
        data.val.set_epoch(0)
        for x, y in data.val:  # every stage iterates the same (unsharded) validation batches
            logits = pipeline_forward(stage, x, microbatches, shape)
            if logits is not None:
                counts[0] += (logits.argmax(1) == y).sum()
                counts[1] += y.numel()
        module.train()
        if distributed:
            import torch.distributed as dist

            dist.all_reduce(counts, op=dist.ReduceOp.SUM)
        correct, total = counts.tolist()
        accuracy = correct / total if total else None
    session.write(mx.epoch_record(epoch, accuracy, seconds, mx.utc_now()))
    if env.is_main and accuracy is not None:
        print(f"epoch {epoch} val_accuracy {accuracy:.4f}", flush=True)


class _State:
    """Checkpoint save/resume of a pipeline run (engine format; ``model`` is the full state dict)."""

    def __init__(self, session: Session, stage: Stage, optimizer: Any, scheduler: Any, plan: Any,
                 scaler: LossScale | None = None) -> None:
        self.session, self.env, self.stage = session, session.env, stage
        self.optimizer, self.scheduler, self.plan = optimizer, scheduler, plan
        self.scaler = scaler

    def save(self, step: int, epoch: int) -> None:
        # CPU copies, gathered to rank 0 only: no rank unpickles another stage's state onto its GPU
        mine = {"model": self.stage.state_dict(), "optimizer": to_cpu(self.optimizer.state_dict()),
                "rng": ckpt.capture_rng()}
        every = self.session.gather_to_main(mine)
        del mine
        state: dict[str, Any] | None = None
        if self.env.is_main:
            model: dict[str, torch.Tensor] = {}
            for part in every:
                model.update(part["model"])
            plan = self.plan
            state = {
                "model": model,
                "optimizer": {"stages": [part["optimizer"] for part in every]},
                "optimizer_format": "pipeline",
                "strategy": "pipeline",
                "scheduler": self.scheduler.state_dict(),
                "step": step,
                "epoch": epoch,
                "sampler": {"epoch": step // plan.steps_per_epoch,
                            "batch": (step % plan.steps_per_epoch) * plan.grad_accum},
                "rng": [part["rng"] for part in every],
                "world_size": self.env.world_size,
                "global_batch": plan.global_batch,
            }
            if self.scaler is not None:
                state["loss_scale"] = self.scaler.state_dict()
        # Rank 0 writes it atomically (the newest checkpoint.keep kept); the others wait on the gloo side group.
        self.session.save(state, step)

    def resume(self) -> int:
        """Load the newest checkpoint (chosen by rank 0) into this stage; returns its step (0 if none)."""
        found = self.session.load_latest()
        if found is None:
            return 0
        state, path = found
        if state.get("optimizer_format") == "dcp":
            raise ValidationError(
                f"checkpoint {path.name} holds FSDP shards (checkpoint.sharded); the pipeline cannot resume it",
                hint="resume with train.strategy=fsdp, or start a new run directory",
            )
        self.stage.load_state_dict(state["model"])
        stages = state["optimizer"].get("stages") if state.get("optimizer_format") == "pipeline" else None
        if stages is not None and len(stages) == self.env.world_size:
            self.optimizer.load_state_dict(stages[self.env.rank])
            if len(state.get("rng") or []) == self.env.world_size:
                ckpt.restore_rng(state["rng"][self.env.rank])
        elif self.env.is_main:
            warn(f"checkpoint {path.name} was written by a {state.get('strategy', 'ddp')} run with "
                 f"{state.get('world_size')} rank(s): weights restored, optimizer momentum restarts")
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and "loss_scale" in state:
            self.scaler.load_state_dict(state["loss_scale"])
        if self.env.is_main:
            print(f"cyclone_kit: resumed from {path} at step {state['step']}", flush=True)
            sys.stdout.flush()
        return int(state["step"])


def to_cpu(obj: Any) -> Any:
    """``obj`` (nested dicts, lists, tuples) with every tensor copied to the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(to_cpu(v) for v in obj)
    return obj
