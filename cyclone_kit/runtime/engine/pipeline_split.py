"""The pipeline's cut: a model as a chain of blocks, their measured cost, and the balanced stages.

A model is cut at block granularity (:func:`model_blocks`): the stem, every ResNet
Bottleneck/BasicBlock, every MobileNetV3 block, the head. A parameter-free op (ReLU, pooling,
flatten, dropout) never stands alone: it joins the block before it (the one after, at the start),
so every block, and so every stage, has parameters.

The blocks are balanced by their *measured* forward+backward time on the device
(:func:`measure_block_times`, torchgpipe's balance-by-time): :func:`balance` finds the
contiguous split into ``S`` stages whose slowest stage is as fast as any split allows (an
exact dynamic programme). When even that optimum is more than :data:`BALANCE_TOLERANCE` over
the mean stage, the block granularity is the limit (one block costs more than a fair share),
and :class:`Balance` says so (``granularity_limited``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cyclone_kit.core.errors import ValidationError

#: The slowest stage may be this much over the mean stage (where the block granularity allows).
BALANCE_TOLERANCE = 0.15


@dataclass(frozen=True)
class Block:
    """One block of the chain: consecutive (state-dict prefix, module) parts run in order; the
    prefix is the part's name in the full model ("" for an op made here, e.g. Flatten)."""

    parts: tuple[tuple[str, nn.Module], ...]

    @property
    def name(self) -> str:
        """The block's name: its first named part with parameters (``layer2.0``, ``features.3``, ``fc``)."""
        named = [(p, m) for p, m in self.parts if p]
        return next((p for p, m in named if any(True for _ in m.parameters())), named[0][0] if named else "")

    @property
    def num_params(self) -> int:
        """Parameters in the block."""
        return sum(p.numel() for _, m in self.parts for p in m.parameters())


def _chain(model: nn.Module) -> list[list[tuple[str, nn.Module]]]:
    """The model's forward as a chain of candidate blocks, each a list of (prefix, module) parts."""
    from cyclone_kit.runtime.engine.models import TinyCNN

    if isinstance(model, TinyCNN):  # conv, norm, ReLU (+ the pool): one block each
        f = model.features
        return [[(f"features.{i}", f[i]) for i in range(a, b)] for a, b in ((0, 3), (3, 6), (6, len(f)))] + [
            [("", nn.Flatten(1)), ("classifier", model.classifier)]]
    import torchvision  # only for its models: tiny_cnn needs torch alone

    if isinstance(model, torchvision.models.ResNet):  # the stem, every BasicBlock/Bottleneck, the head
        stem = [(n, getattr(model, n)) for n in ("conv1", "bn1", "relu", "maxpool")]
        blocks = [[(f"{layer}.{i}", b)] for layer in ("layer1", "layer2", "layer3", "layer4")
                  for i, b in enumerate(getattr(model, layer))]
        return [stem, *blocks, [("avgpool", model.avgpool), ("", nn.Flatten(1)), ("fc", model.fc)]]
    if isinstance(model, torchvision.models.MobileNetV3):  # every entry of features, the classifier's layers
        return [[(f"features.{i}", m)] for i, m in enumerate(model.features)] + [
            [("avgpool", model.avgpool)], [("", nn.Flatten(1))]] + [
            [(f"classifier.{i}", m)] for i, m in enumerate(model.classifier)]
    raise ValidationError(
        f"train.strategy 'pipeline' cannot cut a {type(model).__name__} into stages",
        hint="use tiny_cnn, a resnet or a mobilenet_v3 model with the pipeline strategy, or strategy=fsdp",
    )


def merge_parameter_free(chain: Sequence[Sequence[tuple[str, nn.Module]]]) -> list[Block]:
    """Blocks of ``chain``: each candidate with parameters is a block; a parameter-free one (ReLU,
    pooling, flatten, dropout) joins the block before it, or, before the first, the one after. Pure."""
    groups: list[list[tuple[str, nn.Module]]] = []
    pending: list[tuple[str, nn.Module]] = []
    for parts in chain:
        if any(True for _, m in parts for _ in m.parameters()):
            groups.append([*pending, *parts])
            pending = []
        elif groups:
            groups[-1].extend(parts)
        else:
            pending.extend(parts)
    if not groups:
        raise ValidationError("the model has no parameters to train", hint="choose another train.model")
    groups[-1].extend(pending)
    return [Block(tuple(g)) for g in groups]


def model_blocks(model: nn.Module) -> list[Block]:
    """``model`` (tiny_cnn, a ResNet, a MobileNetV3) as its chain of blocks, in forward order.

    Raises:
        ValidationError: the architecture has no chain form here (ViT).
    """
    return merge_parameter_free(_chain(model))


def block_module(block: Block) -> nn.Sequential:
    """The block as one module (sharing the model's layers)."""
    return nn.Sequential(*(m for _, m in block.parts))


# --------------------------------------------------------------------------- balance
@dataclass(frozen=True)
class Balance:
    """A split of ``len(times_s)`` blocks into stages: block ``i`` of stage ``s`` for
    ``cuts[s] <= i < cuts[s+1]``.

    Attributes:
        names: the blocks' names.
        times_s: each block's measured forward+backward time.
        cuts: ``num_stages + 1`` block indices, from 0 to ``len(times_s)``.
    """

    names: tuple[str, ...]
    times_s: tuple[float, ...]
    cuts: tuple[int, ...]

    @property
    def num_stages(self) -> int:
        return len(self.cuts) - 1

    @property
    def stage_times_s(self) -> tuple[float, ...]:
        """Each stage's measured time (the sum of its blocks')."""
        return tuple(sum(self.times_s[a:b]) for a, b in zip(self.cuts, self.cuts[1:], strict=False))

    @property
    def max_over_mean(self) -> float:
        """The slowest stage over the mean stage (1.0 = perfect balance)."""
        stages = self.stage_times_s
        mean = sum(stages) / len(stages)
        return max(stages) / mean if mean > 0 else 1.0

    @property
    def granularity_limited(self) -> bool:
        """The balance misses :data:`BALANCE_TOLERANCE` although the split is optimal: the
        blocks are too coarse for this many stages."""
        return self.max_over_mean > 1 + BALANCE_TOLERANCE

    def record(self) -> dict[str, Any]:
        """The balance for the ``start`` record (plain JSON)."""
        return {"blocks": list(self.names), "block_times_s": list(self.times_s), "cuts": list(self.cuts),
                "stage_times_s": list(self.stage_times_s), "max_over_mean": self.max_over_mean,
                "granularity_limited": self.granularity_limited}


def balance_cuts(times: Sequence[float], num_stages: int) -> tuple[int, ...]:
    """The contiguous split of ``times`` into ``num_stages`` non-empty stages whose largest sum is
    the smallest possible (exact dynamic programme, O(n^2 S); ties: the earliest cuts). Pure.

    Raises:
        ValidationError: fewer blocks than stages.
    """
    n = len(times)
    if not 1 <= num_stages <= n:
        raise ValidationError(
            f"the model has {n} blocks, too few for {num_stages} pipeline stages",
            hint=f"use at most {n} stages (train.pipeline_stages; with interleaved_1f1b each rank holds 2)",
        )
    prefix = [0.0]
    for t in times:
        prefix.append(prefix[-1] + t)
    inf = float("inf")
    # best[s][i]: the smallest bottleneck of blocks [0, i) in s stages; arg[s][i]: the last cut
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    arg = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, i):
                cost = max(best[s - 1][j], prefix[i] - prefix[j])
                if cost < best[s][i] - 1e-15:
                    best[s][i], arg[s][i] = cost, j
    cuts = [n]
    for s in range(num_stages, 0, -1):
        cuts.append(arg[s][cuts[-1]])
    return tuple(reversed(cuts))


def balance(names: Sequence[str], times: Sequence[float], num_stages: int) -> Balance:
    """The balanced split of the blocks ``names`` with measured ``times`` (pure)."""
    return Balance(tuple(names), tuple(float(t) for t in times), balance_cuts(times, num_stages))


# --------------------------------------------------------------------------- measurement
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_block_times(blocks: Sequence[Block], sample: torch.Tensor, *, repeats: int = 3,
                        autocast: Any = None) -> list[float]:
    """Each block's forward+backward time on ``sample``'s device (the median of ``repeats``
    after one warm-up), block by block on the previous block's output (torchgpipe's
    balance-by-time). Leaves no trace: gradients are dropped, BatchNorm statistics and the
    RNG restored.

    Args:
        blocks: the chain (:func:`model_blocks`), already on the device.
        sample: an input micro-batch for the first block.
        repeats: timed runs per block.
        autocast: ``() -> context`` for mixed precision (None: full precision).
    """
    import contextlib

    device = sample.device
    modules = [block_module(b) for b in blocks]
    buffers = [(buf, buf.detach().clone()) for m in modules for buf in m.buffers()]
    ctx = autocast or contextlib.nullcontext
    times: list[float] = []
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        x = sample.detach()
        for i, module in enumerate(modules):
            runs = []
            for r in range(repeats + 1):
                inp = x.detach().requires_grad_(i > 0)
                _sync(device)
                t0 = time.perf_counter()
                with ctx():
                    out = module(inp)
                out.float().sum().backward()
                _sync(device)
                if r:
                    runs.append(time.perf_counter() - t0)
            times.append(statistics.median(runs))
            x = out.detach()
            module.zero_grad(set_to_none=True)
    with torch.no_grad():
        for buf, saved in buffers:
            buf.copy_(saved)
    return times
