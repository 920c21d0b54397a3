"""A plain PyTorch DDP training script, written for torchrun: no cyclone_kit import.

It reads its ranks the way every torchrun script does (``init_process_group(init_method="env://")``
plus ``LOCAL_RANK``), trains a small classifier on synthetic images (nothing is downloaded) and
prints one line per rank and a throughput line on rank 0. Run it unchanged with

    torchrun --nproc_per_node 2 examples/plain_ddp.py --steps 50
    cyclone-kit run examples/plain_ddp.py --nproc 2 -- --steps 50
    cyclone-kit submit examples/plain_ddp.py --nodes 2 --ntasks-per-node 2 -- --steps 50

(the last two go through cyclone_kit's launch shim, which sets the torchrun variables on every rank).
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per device per step")
    parser.add_argument("--width", type=int, default=256, help="hidden units")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the throughput")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    print(f"plain_ddp: rank {rank} of {world} on {socket.gethostname()} "
          f"(local rank {local_rank} of {os.environ.get('LOCAL_WORLD_SIZE', '?')}), device {device}", flush=True)

    torch.manual_seed(0)  # the same initial model on every rank (DDP also broadcasts rank 0's)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, args.width), nn.ReLU(), nn.Linear(args.width, 10))
    model = DistributedDataParallel(model.to(device), device_ids=[local_rank] if cuda else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    generator = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard of the data
    images = torch.randn(args.batch_size, 3, 32, 32, generator=generator).to(device)
    labels = torch.randint(0, 10, (args.batch_size,), generator=generator).to(device)

    loop_start = time.time()
    timed_from, timed_steps = loop_start, 0
    for step in range(1, args.steps + 1):
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step == min(args.warmup, args.steps - 1) or args.steps == 1:
            if cuda:
                torch.cuda.synchronize()
            timed_from, timed_steps = time.time(), args.steps - step
    if cuda:
        torch.cuda.synchronize()
    timed_to = time.time()
    samples = timed_steps * args.batch_size * world
    rate = samples / (timed_to - timed_from) if timed_steps else float("nan")
    if rank == 0:
        print(f"plain_ddp: {args.steps} steps, world size {world}, loss {loss.item():.4f}, {rate:.1f} samples/s "
              f"(loop started {loop_start:.6f}, timed {timed_from:.6f} to {timed_to:.6f} unix, {samples} samples)",
              flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
