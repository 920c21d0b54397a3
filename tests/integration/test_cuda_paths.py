"""CUDA-path fixes of issue 16 that a CPU can show, in real processes: FSDP with channels_last
(gloo, 2 ranks), the torchrun agent forwarding the requeue signal, DataLoader workers that
survive SIGTERM and the requeue signal."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_ddp import TIMEOUT_S, clean_env, free_port

FSDP_CHILD = r"""
import sys, datetime
import torch, torch.distributed as dist
from cyclone_kit.config import TrainConfig
from cyclone_kit.runtime.dist import DeviceChoice
from cyclone_kit.runtime.models import build_model
from cyclone_kit.runtime.train import place_model, wrap_model

rank, port, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=120))
torch.manual_seed(0)
model = build_model("tiny_cnn", 10, 32, 3)
cpu = DeviceChoice("cpu", None, "cpu", "gloo")
if mode == "old":  # what train() did before: every parameter channels_last, then fully_shard
    model = model.to(memory_format=torch.channels_last)
    try:
        wrap_model("fsdp", model, cpu, TrainConfig(), True)
    except Exception as e:
        print("OLD-ERROR", e)
else:
    model = place_model(model, torch.device("cpu"), "fsdp", True)
    wrapped = wrap_model("fsdp", model, cpu, TrainConfig(), True)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    x = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(rank)).to(memory_format=torch.channels_last)
    y = torch.arange(8) % 10
    for _ in range(2):
        loss = torch.nn.functional.cross_entropy(wrapped(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    print("OK", float(loss))
dist.barrier()
dist.destroy_process_group()
"""


def _two_ranks(script: str, *args: str) -> list[str]:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r), str(port), *args], env=clean_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = []
    for r, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=TIMEOUT_S)
        finally:
            if p.poll() is None:
                p.kill()
        assert p.returncode == 0, f"rank {r}: {err}"
        outs.append(out)
    return outs


def test_fsdp_with_channels_last_forced_trains_on_gloo() -> None:
    """Item 2: channels_last on (the CUDA default) with FSDP; the old order crashed in fully_shard."""
    old = _two_ranks(FSDP_CHILD, "old")
    assert all("OLD-ERROR" in out and "non-contiguous" in out for out in old), old
    new = _two_ranks(FSDP_CHILD, "new")
    assert all(out.startswith("OK ") for out in new), new
