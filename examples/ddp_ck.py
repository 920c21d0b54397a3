"""A plain PyTorch DDP training script plus the cyclone_kit API: metrics, requeue, exact resume.

The same script as examples/plain_ddp.py with the few ``ck.*`` lines added (README: the
before/after diff). Run it any way a DDP script runs::

    python examples/ddp_ck.py                                  # one process, no launcher
    torchrun --nproc_per_node 2 examples/ddp_ck.py -- --steps 200
    cyclone-kit run examples/ddp_ck.py --nproc 2 -- --steps 200

What ck adds: ``ck.init()`` joins the process group from whatever launched the script (nccl on
GPU, gloo on CPU); ``ck.log_step`` writes the metrics contract that ``cyclone-kit report`` reads;
``ck.stop_requested()`` turns the wall-time signal into a checkpoint at the same step on every
rank, and ``ck.finish()`` requeues the job, which resumes from ``ck.load_checkpoint()``.

The data is synthetic (no download): a fixed pool of random images and labels, and the batch of
step ``s`` on rank ``r`` is drawn from a generator seeded with ``(seed, s, r)``, so a resumed run
sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import cyclone_kit as ck


class Net(nn.Module):
    """A small CNN for 3x32x32 images."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(1))
        self.classifier = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def batch(pool: tuple[torch.Tensor, torch.Tensor], seed: int, step: int, rank: int, size: int,
          device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``step`` on ``rank``: ``size`` samples of the pool, chosen by (seed, step, rank)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + rank)
    idx = torch.randint(0, pool[0].shape[0], (size,), generator=g)
    return pool[0][idx].to(device, non_blocking=True), pool[1][idx].to(device, non_blocking=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100, help="optimizer steps in all")
    p.add_argument("--batch-size", type=int, default=64, help="samples per rank and step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--pool", type=int, default=1024, help="distinct synthetic images")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    ctx = ck.init()  # plain DDP: dist.init_process_group(...); rank = int(os.environ["RANK"]); ...
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    pool = (torch.randn(args.pool, 3, 32, 32), torch.randint(0, 10, (args.pool,)))
    model = Net().to(ctx.device)
    ddp = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)

    start = 0
    state = ck.load_checkpoint()  # None on the first run; the stop checkpoint after a requeue
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]

    for step in range(start, args.steps):
        x, y = batch(pool, args.seed, step, ctx.rank, args.batch_size, ctx.device)
        loss = F.cross_entropy(ddp(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        ck.log_step(step + 1, samples=args.batch_size * ctx.world_size, loss=loss)
        if ck.stop_requested():  # the wall-time signal: checkpoint at the same step everywhere, then stop
            ck.save_checkpoint({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1})
            break
    ck.finish()  # end record; requeues the job when it was stopped by the requeue signal
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
