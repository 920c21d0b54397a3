"""The copy of a CUDA training state to host memory at a checkpoint step (``ck.snapshot``), on a GPU.

What a background checkpoint costs the training thread on a GPU is this copy: the write, hash and rename
run behind. ResNet-50 (channels_last) with SGD momentum after one step, on the GPU; the reference, in the
same run, is one synchronous ``tensor.to("cpu", copy=True)`` per tensor into pageable memory (what
``ck.snapshot`` did before); then ``ck.snapshot`` the first time (pinned buffers allocated) and again into
those buffers (every checkpoint after the first). Each the median of ROUNDS; the ratio is reused / reference.

Usage: python bench/snapshot_cuda.py [--rounds N] [--model resnet50]   (exits 2 without CUDA)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any


def _pageable(state: Any) -> Any:
    import torch

    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: _pageable(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(_pageable(v) for v in state)
    return state


def main(argv: list[str] | None = None) -> int:
    """Time the three copies; print each median, the state's size and the ratio."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch", type=int, default=64)
    args = p.parse_args(argv)
    import torch
    import torchvision

    from cyclone_kit.runtime import checkpoint as ck

    if not torch.cuda.is_available():
        print("error: snapshot_cuda needs a CUDA device. HINT: run it on a GPU node (bench/gpu_check.sh's machine)")
        return 2
    model = getattr(torchvision.models, args.model)().cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(args.batch, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
    model(x).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    tensors = _flat(state)
    size = sum(t.numel() * t.element_size() for t in tensors)

    def timed(fn: Any) -> tuple[Any, float]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t0

    ref = [timed(lambda: _pageable(state))[1] for _ in range(args.rounds)]
    first = [timed(lambda: ck.snapshot(state))[1] for _ in range(args.rounds)]
    spare = ck.snapshot(state)
    reused = [timed(lambda: ck.snapshot(state, into=spare))[1] for _ in range(args.rounds)]
    r, f, u = (statistics.median(v) * 1e3 for v in (ref, first, reused))
    print(f"snapshot_cuda: {args.model} + SGD momentum on {torch.cuda.get_device_name()}, {size / 2**20:.0f} MiB "
          f"in {len(tensors)} tensors; median of {args.rounds}")
    print(f"  reference, pageable copy per tensor: {r:8.1f} ms  ({size / 2**30 / (r / 1e3):.1f} GiB/s)")
    print(f"  ck.snapshot, first (pinned alloc):   {f:8.1f} ms")
    print(f"  ck.snapshot, into the last one:      {u:8.1f} ms  ({size / 2**30 / (u / 1e3):.1f} GiB/s)")
    print(f"  ratio reused / reference: {u / r:.3f}")
    return 0


def _flat(state: Any) -> list[Any]:
    import torch

    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _flat(v)]
    if isinstance(state, list | tuple):
        return [t for v in state for t in _flat(v)]
    return []


if __name__ == "__main__":
    sys.exit(main())
