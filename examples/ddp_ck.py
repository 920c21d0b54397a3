"""examples/plain_ddp.py plus the cyclone_kit API: metrics for the report, requeue, exact resume.

The same plain PyTorch DDP script with a few ``ck.*`` lines added (the README shows them as a
diff): ``ck.init()`` joins the process group from whatever started the script (srun, torchrun,
the local launcher, or nothing: a world of one), ``ck.instrument`` times where each step's time
goes (compute, the all-reduce and the part of it not hidden behind backward, the rest),
``ck.log_step`` writes the metrics contract that ``cyclone-kit report`` reads,
``ck.stop_requested()`` turns Slurm's wall-time signal into a checkpoint after the same step on
every rank, and ``ck.finish()`` requeues the job, which resumes from ``ck.load_checkpoint()``
with every step done exactly once. Run it with

    python examples/ddp_ck.py --steps 50
    torchrun --nproc_per_node 2 examples/ddp_ck.py --steps 50
    cyclone-kit run examples/ddp_ck.py --nproc 2 -- --steps 50
    cyclone-kit submit examples/ddp_ck.py --nodes 2 --ntasks-per-node 2 -- --steps 50
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import cyclone_kit as ck


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per device per step")
    parser.add_argument("--width", type=int, default=256, help="hidden units")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the throughput")
    args = parser.parse_args()

    ctx = ck.init()  # the process group (nccl on GPU, gloo on CPU), from any launcher or none
    rank, world = ctx.rank, ctx.world_size
    local_rank = ctx.local_rank
    device = ctx.device
    cuda = device.type == "cuda"
    print(f"ddp_ck: rank {rank} of {world} on {socket.gethostname()} "
          f"(local rank {local_rank} of {os.environ.get('LOCAL_WORLD_SIZE', '?')}), device {device}", flush=True)

    torch.manual_seed(0)  # the same initial model on every rank (DDP also broadcasts rank 0's)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, args.width), nn.ReLU(), nn.Linear(args.width, 10))
    model = DistributedDataParallel(model.to(device), device_ids=[local_rank] if cuda else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    ck.instrument(model=model, optimizer=optimizer)  # each step record: compute, all-reduce (exposed), rest
    generator = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard of the data
    images = torch.randn(args.batch_size, 3, 32, 32, generator=generator).to(device)
    labels = torch.randint(0, 10, (args.batch_size,), generator=generator).to(device)
    start, loss = 0, None
    state = ck.load_checkpoint()  # None on the first run; after a requeue, the checkpoint of the stop
    if state is not None:
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]

    loop_start = time.time()
    timed_from, timed_steps = loop_start, 0
    for step in range(start + 1, args.steps + 1):
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        ck.log_step(step, samples=args.batch_size * world, loss=loss)
        if step == min(start + args.warmup, args.steps - 1) or args.steps == 1:
            if cuda:
                torch.cuda.synchronize()
            timed_from, timed_steps = time.time(), args.steps - step
        if ck.stop_requested():  # Slurm's wall-time signal, agreed by every rank after this same step
            ck.save_checkpoint({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step})
            timed_steps = max(0, timed_steps - (args.steps - step))  # not the steps left for the next segment
            break
    if cuda:
        torch.cuda.synchronize()
    timed_to = time.time()
    samples = timed_steps * args.batch_size * world
    rate = samples / (timed_to - timed_from) if timed_steps else float("nan")
    if rank == 0 and loss is not None:
        print(f"ddp_ck: {args.steps} steps, world size {world}, loss {loss.item():.4f}, {rate:.1f} samples/s "
              f"(loop started {loop_start:.6f}, timed {timed_from:.6f} to {timed_to:.6f} unix, {samples} samples)",
              flush=True)
    ck.finish()  # the end record; requeues the job when the requeue signal stopped it; tears the group down


if __name__ == "__main__":
    main()
