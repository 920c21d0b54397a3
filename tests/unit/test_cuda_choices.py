"""Pure choices of the CUDA paths (issue 24), checked with torch on the CPU: which optimizer is fused,
what GradScaler.step then syncs, FSDP2's mixed-precision policy, which strategies keep contiguous weights."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cyclone_kit.runtime.models import build_model
from cyclone_kit.runtime.train import (
    CONTIGUOUS_PARAMS,
    fsdp_mixed_precision,
    make_optimizer,
    place_model,
    use_fused_sgd,
)
from cyclone_kit.spec.job import TrainConfig


class HostReads(TorchDispatchMode):
    """Counts ``aten._local_scalar_dense``: what ``.item()`` dispatches to (a host sync on CUDA)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("strategy", "kind", "fused"), [
    ("ddp", "cuda", True), ("fsdp", "cuda", False), ("horovod", "cuda", False), ("ddp", "cpu", False),
])
def test_fused_sgd_only_where_it_is_valid(strategy: str, kind: str, fused: bool) -> None:
    assert use_fused_sgd(strategy, kind) is fused


def _scaled_step(fused: bool, inf: bool) -> tuple[int, bool, float]:
    """One GradScaler step (the path torch takes on CUDA too); (host reads, weights changed, new scale)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = make_optimizer(model, 0.1, TrainConfig(), fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(model(torch.randn(3, 8)).sum()).backward()
    if inf:
        model.weight.grad[0, 0] = float("inf")  # type: ignore[index]
    before = model.weight.detach().clone()
    with HostReads() as reads:
        scaler.step(opt)
        scaler.update()
    return reads.count, not torch.equal(before, model.weight.detach()), scaler.get_scale()


def test_fused_sgd_takes_the_grad_scaler_step_without_reading_found_inf_on_the_host() -> None:
    """Item 2: plain SGD goes through GradScaler._maybe_opt_step's found_inf.item() (a host sync
    per fp16 step on CUDA); fused SGD gets grad_scale/found_inf as tensors: no host read at all."""
    assert _scaled_step(fused=False, inf=False)[0] >= 1
    assert _scaled_step(fused=True, inf=False) == (0, True, 1024.0)
    assert _scaled_step(fused=True, inf=True) == (0, False, 512.0)  # the overflow skipped on the device


def test_fsdp_policy_follows_the_resolved_precision() -> None:
    assert fsdp_mixed_precision("fp32") is None
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        policy = fsdp_mixed_precision(name)
        assert (policy.param_dtype, policy.reduce_dtype) == (dtype, dtype)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "horovod"])
def test_channels_last_converts_the_weights_only_where_the_collectives_take_them(strategy: str) -> None:
    """Item 1: Horovod (and FSDP) need contiguous parameters; DDP gets channels_last weights."""
    model = place_model(build_model("tiny_cnn", 10, 32, 3), torch.device("cpu"), strategy, True)
    weight = model.features[0].weight
    assert weight.is_contiguous() is (strategy in CONTIGUOUS_PARAMS)
    assert weight.is_contiguous(memory_format=torch.channels_last) is (strategy not in CONTIGUOUS_PARAMS)
