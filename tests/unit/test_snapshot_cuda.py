"""ck.snapshot of CUDA tensors (runtime/checkpoint.snapshot): pinned host copies, waited for once.

Runs where CUDA is (bench/gpu_check.sh's machine, or any GPU node); the CPU path is tested in test_checkpoint.
"""

from __future__ import annotations

import pytest
import torch

from cyclone_kit.runtime import checkpoint as ck

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _state() -> dict:
    conv = torch.randn(64, 32, 3, 3, device="cuda").to(memory_format=torch.channels_last)
    return {"model": {"conv.weight": conv, "fc.weight": torch.randn(1000, 512, device="cuda"),
                      "bn.num_batches_tracked": torch.tensor(7, device="cuda"),
                      "t": torch.randn(128, 256, device="cuda").t()},  # not dense in row-major order: strides kept
            "optimizer": {"state": {0: {"momentum_buffer": torch.randn(4096, 4096, device="cuda")}}},
            "step": 3, "rng": [torch.randn(5, device="cuda"), "x"]}


def _tensors(state: object, path: str = "") -> dict[str, torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return {path: state}
    out: dict[str, torch.Tensor] = {}
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, list | tuple) else []
    for key, value in items:
        out.update(_tensors(value, f"{path}/{key}"))
    return out


def test_a_cuda_state_is_copied_to_pinned_host_memory_and_kept_apart_from_the_device() -> None:
    state = _state()
    copy = ck.snapshot(state)
    before = {k: v.clone() for k, v in _tensors(copy).items()}
    for name, (src, dst) in {k: (v, _tensors(copy)[k]) for k, v in _tensors(state).items()}.items():
        assert dst.device.type == "cpu" and dst.is_pinned(), name
        assert dst.stride() == src.stride(), name  # channels_last and the transposed view keep their layout
        assert torch.equal(dst, src.cpu()), name
    assert (copy["step"], copy["rng"][1]) == (3, "x")
    for t in _tensors(state).values():  # the next optimizer step changes the device's tensors in place
        t.add_(1)
    torch.cuda.synchronize()
    assert all(torch.equal(before[k], v) for k, v in _tensors(copy).items()), "the snapshot followed the device"


def test_a_finished_snapshot_is_reused_as_the_next_ones_pinned_buffers() -> None:
    state = _state()
    first = ck.snapshot(state)
    ptrs = {k: v.data_ptr() for k, v in _tensors(first).items()}
    for t in _tensors(state).values():
        t.mul_(2)
    second = ck.snapshot(state, into=first)
    for name, t in _tensors(second).items():
        assert t.data_ptr() == ptrs[name] and t.is_pinned(), name
        assert torch.equal(t, _tensors(state)[name].cpu()), name
