"""The built-in engine's one training-loop skeleton: what a segment of training does between its steps.

Both engines, the data-parallel one (:mod:`~cyclone_kit.runtime.engine.dataparallel`: DDP, FSDP2,
Horovod) and the pipeline (:mod:`~cyclone_kit.runtime.engine.pipeline`), run their segment through
:meth:`SegmentLoop.run`; each supplies only what differs (:meth:`SegmentLoop.train_step`,
:meth:`~SegmentLoop.log`, :meth:`~SegmentLoop.validate`, :meth:`~SegmentLoop.write_checkpoint`,
:meth:`~SegmentLoop.params`). The skeleton owns, in this order after every optimizer step:

1. the step count and the log window (:class:`Window`); every ``train.log_every`` steps and at the
   last one, the strategy's :meth:`~SegmentLoop.log` (the step record, through the session);
2. the stall watcher's beat (``session.progress``) and the stop/requeue agreement (``session.poll``):
   an agreed stop leaves the loop at once;
3. the checkpoint cadence (``checkpoint.every_steps``; never at the last step: the end writes one);
4. the epoch's end (the epoch record, validation every ``train.val_every_epochs``) and the next epoch.

Then the end of the segment: the outstanding stop settled, the partial epoch's record, the final
checkpoint, and the end record (``completed``, or the agreed stop's status); a failure inside writes
a ``failed`` end record before it propagates. Checkpoints and validation are no steps for the stall
watcher (``session.not_a_step``), and a checkpoint never holds non-finite weights unless the spec
allows them (:func:`judge_params`).
"""

from __future__ import annotations

import abc
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from cyclone_kit.config.job import TrainConfig
from cyclone_kit.core.errors import TrainingDiverged
from cyclone_kit.runtime import metrics as mx
from cyclone_kit.runtime.signals import NONE


@dataclass
class Window:
    """Timing of the steps since the last log line (host clock; synced at log steps)."""

    start: float
    steps: int = 0
    data_s: float = 0.0


# --------------------------------------------------------------------------- parameter health
def nonfinite_params(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """How many of ``params`` hold a NaN or an infinity: a 0-d float32 tensor on their device, computed
    without a host sync (read it where the host syncs anyway, e.g. with the logged loss).

    One ``torch._foreach_norm(..., inf)`` over the tensors (the largest magnitude: NaN when an element
    is NaN, inf when one is infinite; unlike a 2-norm it cannot overflow on large finite values); a
    DTensor (FSDP2) counts its local shard, empty shards are skipped; all tensors on one device.
    """
    tensors = []
    for p in params:
        t = p.detach()
        t = t.to_local() if hasattr(t, "to_local") else t
        if t.numel():
            tensors.append(t)
    if not tensors:
        return torch.zeros((), dtype=torch.float32)
    norms = torch._foreach_norm(tensors, float("inf"))
    return torch.stack([n.float() for n in norms]).isfinite().logical_not().sum(dtype=torch.float32)


def judge_params(step: int, bad: int, train: TrainConfig, warn_now: bool) -> bool:
    """What ``bad`` non-finite parameter tensors after optimizer step ``step`` mean (the engine's and the
    pipeline's rule): :func:`params_diverged` is raised unless ``train.allow_nonfinite_params``; else the
    warning is printed when ``warn_now`` (rank 0, the first time). Returns whether it printed."""
    if not bad:
        return False
    if not train.allow_nonfinite_params:
        raise params_diverged(step, bad, train.log_every)
    if warn_now:
        print(f"cyclone_kit: warning: {bad} parameter tensor(s) of the model hold NaN or inf after step {step}: "
              "the parameters are not finite; training goes on (train.allow_nonfinite_params)", flush=True)
    return warn_now


def count_nonfinite(params: Iterable[torch.Tensor], device: torch.device, distributed: bool) -> int:
    """:func:`nonfinite_params` summed over every rank (one all-reduce when ``distributed``; a host sync)."""
    bad = nonfinite_params(params).to(device)
    if distributed:
        import torch.distributed as dist

        dist.all_reduce(bad, op=dist.ReduceOp.SUM)
    return int(bad.item())


def params_diverged(step: int, bad: int, log_every: int) -> TrainingDiverged:
    """The error for ``bad`` parameter tensors found NaN/inf after step ``step`` (pure)."""
    return TrainingDiverged(
        f"{bad} parameter tensor(s) of the model hold NaN or inf after step {step} (checked every "
        f"train.log_every = {log_every} steps and before each checkpoint): the weights cannot recover",
        hint="resume from the newest checkpoint (none holds non-finite weights) with a lower train.lr, "
             "warm-up (train.warmup_steps) or train.precision=bf16/fp32, or set train.allow_nonfinite_params=true "
             "to train on anyway")


# --------------------------------------------------------------------------- the skeleton
class SegmentLoop(abc.ABC):
    """The mutable state of one training segment and its loop; a strategy's subclass supplies its step.

    A subclass's ``__init__`` sets ``session``, ``env``, ``tc`` (the spec's train table), ``cc`` (its
    checkpoint table), ``plan``, ``data`` and ``dev``, then calls :meth:`start_state`.
    """

    session: Any
    env: Any
    tc: Any
    cc: Any
    plan: Any
    data: Any
    dev: torch.device
    scheduler: Any

    def start_state(self) -> None:
        """The skeleton's own state, before the first step."""
        self.step = 0
        self.bar: Any = None  # a tqdm bar on rank 0 at a terminal (:meth:`progress_bar`)
        self.params_checked_at = -1  # the step whose parameters were last found finite (or allowed)
        self.params_warned = False
        self.validates = True  # False: this strategy cannot validate here (the pipeline on an older torch)

    # -- what a strategy supplies (abstract: a strategy that lacks one fails when it is built, not mid-run)
    @abc.abstractmethod
    def train_step(self, batches: Any, window: Window, loss_sum: torch.Tensor) -> torch.Tensor:
        """One optimizer step from ``batches``; the data wait goes into ``window``; returns ``loss_sum``
        plus this step's loss (on the device: no host sync)."""
        raise NotImplementedError

    @abc.abstractmethod
    def log(self, step: int, epoch: int, loss_sum: torch.Tensor, window: Window) -> None:
        """The log step: the window's record through the session, the line, then :meth:`judge_params`."""
        raise NotImplementedError

    @abc.abstractmethod
    def validate(self) -> float | None:
        """The accuracy over the validation shards (every rank takes part), or None."""
        raise NotImplementedError

    @abc.abstractmethod
    def write_checkpoint(self, step: int, epoch: int) -> None:
        """This strategy's checkpoint after ``step`` (every rank takes part; the session writes the file)."""
        raise NotImplementedError

    @abc.abstractmethod
    def params(self) -> Iterable[torch.Tensor]:
        """This rank's parameters (their finiteness is judged)."""
        raise NotImplementedError

    def open_window(self) -> Window:
        """A new log window (a strategy with a phase timer opens it too)."""
        return Window(time.perf_counter())

    def progress_bar(self, total: int, initial: int) -> Any:
        """A progress bar (``update``, ``set_postfix``, ``close``) or None: no bar by default."""
        return None

    def begin(self) -> None:
        """Just before the first step of the segment (modules to train mode, clocks reset)."""
        return None  # optional: a strategy with nothing to do here keeps this

    def end_fields(self) -> dict[str, Any]:
        """Extra fields of the segment's end (:meth:`~cyclone_kit.runtime.session.Session.end`)."""
        return {}

    # -- the skeleton
    def run(self, start_step: int) -> str:
        """Train from ``start_step`` to the plan's end or an agreed stop; returns the status. On a
        failure, the ``failed`` end record is written before the error propagates."""
        try:
            return self._run(start_step)
        except BaseException:
            self.session.end("failed", self.step, self.plan.total_steps)
            raise

    def _run(self, start_step: int) -> str:
        plan, tc, cc, session = self.plan, self.tc, self.cc, self.session
        self.step = step = start_step
        epoch = step // plan.steps_per_epoch
        self.start_epoch(epoch, step)
        batches = iter(self.data.train)
        epoch_t0 = time.perf_counter()
        window = self.open_window()
        loss_sum = torch.zeros((), device=self.dev)
        agreed = NONE
        self.bar = self.progress_bar(plan.total_steps, step)
        self.begin()
        while step < plan.total_steps:
            loss_sum = self.train_step(batches, window, loss_sum)
            step += 1
            self.step = step
            window.steps += 1
            if self.bar is not None:
                self.bar.update(1)
            if step % tc.log_every == 0 or step == plan.total_steps:
                self.log(step, epoch, loss_sum, window)
                loss_sum = torch.zeros((), device=self.dev)
                window = self.open_window()
            session.progress(step)  # the stall watcher's beat
            agreed = session.poll(step)
            if agreed != NONE:
                break
            if cc.every_steps and step % cc.every_steps == 0 and step < plan.total_steps:
                self.checkpoint(step, epoch)
            if step % plan.steps_per_epoch == 0:
                self.end_epoch(epoch, time.perf_counter() - epoch_t0, validate=self.val_due(epoch))
                epoch += 1
                if step < plan.total_steps:
                    self.start_epoch(epoch, step)
                    batches = iter(self.data.train)
                    epoch_t0 = time.perf_counter()
        session.settle()
        if self.bar is not None:
            self.bar.close()
        if agreed == NONE and step % plan.steps_per_epoch:
            self.end_epoch(epoch, time.perf_counter() - epoch_t0, validate=tc.val_every_epochs > 0)
        self.checkpoint(step, epoch)
        status = "completed" if agreed == NONE else session.stop_status()  # a user's cancel: cancelled
        # The end record, this rank's summary, the closing line and, after the requeue signal, the requeue.
        session.end(status, step, plan.total_steps, **self.end_fields())
        return status

    def start_epoch(self, epoch: int, step: int) -> None:
        """The train sampler at ``epoch``, past the batches of the steps already taken in it."""
        within = step - epoch * self.plan.steps_per_epoch
        self.data.train.set_epoch(epoch, within * self.plan.grad_accum)

    def val_due(self, epoch: int) -> bool:
        """Whether validation runs at the end of ``epoch`` (every ``train.val_every_epochs``)."""
        every = self.tc.val_every_epochs
        return every > 0 and (epoch + 1) % every == 0

    def end_epoch(self, epoch: int, seconds: float, validate: bool) -> None:
        """The epoch record, with the validation accuracy when ``validate`` (no step for the stall watcher)."""
        with self.session.not_a_step(f"the validation pass of epoch {epoch}"):
            accuracy = self.validate() if validate and self.validates and self.data.val is not None else None
        self.session.write(mx.epoch_record(epoch, accuracy, seconds, mx.utc_now()))
        if self.env.is_main and accuracy is not None:
            print(f"epoch {epoch} val_accuracy {accuracy:.4f}", flush=True)

    def judge_params(self, step: int, bad: int) -> None:
        """Stop (every rank: ``bad`` was all-reduced) when parameters are not finite, unless the spec allows it."""
        self.params_checked_at = step
        self.params_warned |= judge_params(step, bad, self.tc, self.env.is_main and not self.params_warned)

    def check_params(self, step: int) -> None:
        """Before a checkpoint: the parameters' finiteness, unless the last log step checked it."""
        if self.params_checked_at != step:
            self.judge_params(step, count_nonfinite(self.params(), self.dev, self.session.distributed))

    def checkpoint(self, step: int, epoch: int) -> None:
        """The checkpoint after ``step``: parameters judged first; gathering, shard writes and the file
        are no step for the stall watcher (a write to a slow shared file system may outlast its bound)."""
        self.check_params(step)  # a checkpoint never holds non-finite weights unless the spec allows them
        with self.session.not_a_step(f"the checkpoint of step {step}"):
            self.write_checkpoint(step, epoch)

    def position_state(self, step: int, epoch: int, rngs: Any) -> dict[str, Any]:
        """The checkpoint's fields that place the run (both engines'): the LR schedule, step, epoch,
        sampler position, every rank's RNG states, the world and the global batch."""
        plan = self.plan
        return {
            "scheduler": self.scheduler.state_dict(),
            "step": step,
            "epoch": epoch,
            "sampler": {"epoch": step // plan.steps_per_epoch,
                        "batch": (step % plan.steps_per_epoch) * plan.grad_accum},
            "rng": rngs,
            "world_size": self.env.world_size,
            "global_batch": plan.global_batch,
        }
