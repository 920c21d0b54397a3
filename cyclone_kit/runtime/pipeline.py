"""Strategy ``pipeline``: the model split into one stage per rank, trained with micro-batches (GPipe).

Every rank builds the same model (same seed), cuts it into ``world_size`` consecutive stages
(:func:`split_model`, balanced by parameter count) and keeps only its own stage. There is no
data parallelism: every rank reads the same batches (the data is built for a world of one), the
first stage feeds the images in, the last one computes the loss. Each optimizer step is
``grad_accum`` batches of ``train.batch_size``, each cut into ``train.microbatches``
micro-batches. The schedule (:func:`pipeline_step`) is GPipe's: a stage sends each micro-batch's
activations on as soon as it has them (``isend``), so stage k works on micro-batch m while
stage k+1 works on m-1; then the gradients flow back, last micro-batch first on the last stage.

The metrics contract is the engine's (start, step, epoch and end records on rank 0, a summary
per rank). Checkpoints use the engine's format: ``model`` is the full, unsplit state dict
(gathered from all stages, so a DDP run can load it), ``optimizer`` holds one state per stage.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cyclone_kit.config import JobSpec
from cyclone_kit.errors import ValidationError
from cyclone_kit.rundir import RunDir
from cyclone_kit.runtime import checkpoint as ckpt
from cyclone_kit.runtime import metrics as mx
from cyclone_kit.runtime.data import auto_workers, build_data
from cyclone_kit.runtime.dist import init_process_group, probe_device, setup_threads, warn, worker_cpus
from cyclone_kit.runtime.env import DistEnv
from cyclone_kit.runtime.models import TinyCNN, build_model
from cyclone_kit.runtime.signals import NONE, StopAgreement, StopFlag, requeue, should_requeue


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


def pipeline_step(stage: Stage, x: torch.Tensor, y: torch.Tensor, microbatches: int, shape: Sequence[int],
                  criterion: nn.Module, scale: float, autocast: Any) -> torch.Tensor:
    """Forward and backward of one batch (GPipe); gradients accumulate in the stage's parameters.

    The loss of each micro-batch is weighted by its share of the batch and by ``scale``
    (1/grad_accum), so the gradients equal those of the whole batch. Returns the batch's loss
    (times ``scale``) on the last stage, 0 on the others.
    """
    import torch.distributed as dist

    module, rank = stage.module, stage.index
    sends: list[Any] = []
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    loss_sum = torch.zeros((), device=x.device)
    n = x.shape[0]
    for xm, ym in zip(_chunks(x, microbatches), _chunks(y, microbatches), strict=True):
        inp = xm if stage.is_first else _recv((xm.shape[0], *shape), x.device, rank - 1).requires_grad_()
        with autocast():
            out = module(inp if stage.is_first else inp.clone())  # a clone: the stage may start in-place (ReLU)
            if stage.is_last:
                loss = criterion(out, ym) * (xm.shape[0] / n) * scale
        if stage.is_last:
            loss.backward()
            loss_sum = loss_sum + loss.detach().float()
            if not stage.is_first:
                sends.append(dist.isend(inp.grad.contiguous(), rank - 1))
        else:
            sends.append(dist.isend(out.detach().float().contiguous(), rank + 1))
            kept.append((inp, out))
    for inp, out in kept:  # backward phase of the non-last stages, micro-batches in order
        grad = _recv(out.shape, x.device, rank + 1)
        out.backward(grad.to(out.dtype))
        if not stage.is_first:
            sends.append(dist.isend(inp.grad.contiguous(), rank - 1))
    for work in sends:
        work.wait()
    return loss_sum


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
    from cyclone_kit.runtime.train import begin_segment, gather_hosts, lr_factor, make_plan, seed_everything

    t_start = time.perf_counter()
    run_dir = Path(run_dir)
    tc, cc = spec.train, spec.checkpoint
    stop_flag = stop_flag or StopFlag(cc.signal).install()
    if tc.batch_size < tc.microbatches:
        raise ValidationError(
            f"train.batch_size {tc.batch_size} is smaller than train.microbatches {tc.microbatches}",
            hint="with strategy=pipeline, train.batch_size is the batch every stage sees; make it >= microbatches",
        )
    if tc.compile:
        warn("train.compile is ignored with strategy=pipeline")
    threads = setup_threads(environ)
    device = probe_device(env, environ)
    if device.warning and env.local_rank == 0:
        warn(device.warning)
    dev = torch.device(device.torch_device)
    seed_everything(tc.seed)
    distributed = init_process_group(env, device, tc.pg_timeout_s)
    host = env.host or socket.gethostname()
    hostnames = gather_hosts(host, distributed)

    # No data parallelism: every stage reads the batches a world of one would read.
    solo = dataclasses.replace(env, rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0,
                               num_nodes=1)
    workers = auto_workers(tc.num_workers, worker_cpus(environ, env.local_world_size), tc.dataset != "imagefolder")
    data = build_data(tc, solo, dev, workers=workers)
    plan = make_plan(tc, 1, data.train.sampler.full_length())
    precision = "bf16" if tc.precision == "bf16" or (tc.precision == "auto" and device.kind == "cuda"
                                                       and torch.cuda.is_bf16_supported()) else "fp32"
    dtype = torch.bfloat16 if precision == "bf16" else None

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

    state = _State(spec, run_dir, env, stage, optimizer, scheduler, plan, distributed)
    step = state.resume() if cc.resume else 0
    launcher = environ.get("CYCLONE_LAUNCHER") or env.launcher
    writer = begin_segment(run_dir, env, environ, plan, tc, stop_flag, precision=precision, strategy="pipeline",
                           launcher=launcher, device=device, hostnames=hostnames, threads=threads, step=step,
                           stages=env.world_size, microbatches=tc.microbatches)
    if writer is None:
        return "completed"
    if env.is_main:
        print(f"cyclone_kit: {tc.model} on {tc.dataset}, pipeline of {env.world_size} stage(s) x "
              f"{tc.microbatches} micro-batches ({launcher}), {device.kind} {precision}, batch {plan.global_batch}, "
              f"lr {plan.lr:g}, steps {step}->{plan.total_steps}", flush=True)

    criterion = nn.CrossEntropyLoss()
    agreement = StopAgreement(stop_flag, distributed, interval_s=spec.checkpoint.poll_s)
    rates: list[float] = []
    epoch = step // plan.steps_per_epoch
    status = "failed"
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
                                                    1.0 / plan.grad_accum, autocast)
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
                elapsed = max(time.perf_counter() - window_t0, 1e-9)
                rate = plan.global_batch * window_steps / elapsed
                rates.append(rate)
                value = float(loss.item())
                writer.write(mx.step_record(step, epoch, value, elapsed / window_steps, data_s / window_steps,
                                            rate, mx.utc_now()))
                if env.is_main:
                    print(f"step {step}/{plan.total_steps} epoch {epoch} loss {value:.4f} "
                          f"step {elapsed / window_steps * 1000:.1f} ms {rate:.1f} samples/s", flush=True)
                loss_sum = torch.zeros((), device=dev)
                window_t0, window_steps, data_s = time.perf_counter(), 0, 0.0
            agreed = agreement.poll(step)
            if agreed != NONE:
                break
            if cc.every_steps and step % cc.every_steps == 0 and step < plan.total_steps:
                state.save(step, epoch)
            if step % plan.steps_per_epoch == 0:
                _end_epoch(writer, env, stage, data, shape, tc.microbatches, epoch, time.perf_counter() - epoch_t0,
                           tc.val_every_epochs > 0 and (epoch + 1) % tc.val_every_epochs == 0, distributed, dev)
                epoch += 1
                if step < plan.total_steps:
                    data.train.set_epoch(epoch, 0)
                    batches = iter(data.train)
                    epoch_t0 = time.perf_counter()
        agreement.finish()
        if agreed == NONE and step % plan.steps_per_epoch:
            _end_epoch(writer, env, stage, data, shape, tc.microbatches, epoch, time.perf_counter() - epoch_t0,
                       tc.val_every_epochs > 0, distributed, dev)
        state.save(step, epoch)
        status = "completed" if agreed == NONE else "preempted"
    finally:
        wall = time.perf_counter() - t_start
        writer.write(mx.end_record(status, step, mx.steady_state(rates), wall, mx.utc_now()))
        writer.close()
        stop_flag.uninstall()
    peak = _peak_memory(device.kind, dev)
    mx.write_rank_summary(run_dir, env.rank, host, device.torch_device, mx.steady_state(rates), peak)
    if env.is_main:
        rate = mx.steady_state(rates)
        print(f"cyclone_kit: {status} at step {step}/{plan.total_steps} in {wall:.1f} s"
              + (f", {rate:.1f} samples/s" if rate else ""), flush=True)
        if agreed != NONE:
            yes, why = should_requeue(agreed, cc.requeue, env.restart_count, cc.max_requeues, environ)
            print(f"cyclone_kit: stopped on a signal after a checkpoint; {why}", flush=True)
            if yes:
                try:
                    requeue(environ)
                except Exception as e:
                    warn(f"requeue failed: {e}")
    return status


def _peak_memory(kind: str, dev: torch.device) -> int:
    if kind == "cuda":
        return int(torch.cuda.max_memory_allocated(dev))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


@torch.no_grad()
def _end_epoch(writer: mx.MetricsWriter, env: DistEnv, stage: Stage, data: Any, shape: Sequence[int],
               microbatches: int, epoch: int, seconds: float, validate: bool, distributed: bool,
               dev: torch.device) -> None:
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
    writer.write(mx.epoch_record(epoch, accuracy, seconds, mx.utc_now()))
    if env.is_main and accuracy is not None:
        print(f"epoch {epoch} val_accuracy {accuracy:.4f}", flush=True)


class _State:
    """Checkpoint save/resume of a pipeline run (engine format; ``model`` is the full state dict)."""

    def __init__(self, spec: JobSpec, run_dir: Path, env: DistEnv, stage: Stage, optimizer: Any, scheduler: Any,
                 plan: Any, distributed: bool) -> None:
        self.spec, self.run_dir, self.env, self.stage = spec, run_dir, env, stage
        self.optimizer, self.scheduler, self.plan, self.distributed = optimizer, scheduler, plan, distributed

    def _gather(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(out, obj)
        return out

    def save(self, step: int, epoch: int) -> None:
        mine = {"model": self.stage.state_dict(), "optimizer": self.optimizer.state_dict(), "rng": ckpt.capture_rng()}
        every = self._gather(mine)
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
            ckpt.save_checkpoint(RunDir(self.run_dir).checkpoints, state, step, self.spec.checkpoint.keep)
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()

    def resume(self) -> int:
        """Load the newest checkpoint (chosen by rank 0) into this stage; returns its step (0 if none)."""
        folder = RunDir(self.run_dir).checkpoints
        found = ckpt.load_latest(folder) if self.env.is_main else None
        choice: list[Any] = [str(found[1]) if found else None]
        if self.distributed:
            import torch.distributed as dist

            dist.broadcast_object_list(choice, src=0)
        if choice[0] is None:
            return 0
        path = Path(choice[0])
        state = found[0] if found is not None else ckpt.load_checkpoint(path)
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
        if self.env.is_main:
            print(f"cyclone_kit: resumed from {path} at step {state['step']}", flush=True)
            sys.stdout.flush()
        return int(state["step"])
