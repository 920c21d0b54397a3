"""A minimal hand-written DDP training loop: the reference the cyclone_kit runtime is measured against.

What a user would write by hand: synthetic data already in memory, ``DistributedDataParallel``
with its defaults, SGD, cross-entropy, nothing else (no checkpoints, no metrics file, no stop
agreement, no LR schedule). The model comes from ``cyclone_kit.runtime.engine.models.build_model`` only
so that both sides train the very same architecture; it imports neither torchvision (unless
the model needs it) nor any other part of the runtime.

Rank and world come from the environment torchrun sets (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT); without them it runs as one process. Throughput is measured exactly as the
runtime measures its end record's ``samples_per_s``: windows of ``--log-every`` steps on rank 0,
``global batch x steps / window wall time``, median over the windows after the first.

Rank 0 prints one JSON line (and writes it to ``--out`` when given)::

    {"samples_per_s": ..., "loop_start_unix": ..., "window_rates": [...], ...}

``loop_start_unix`` is the wall-clock time (``time.time()``) at which the first step starts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))


def main(argv: list[str] | None = None) -> int:
    """Train, time the windows, print the result line on rank 0."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny_cnn")
    p.add_argument("--batch", type=int, default=256, help="per-rank batch size")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--pool", type=int, default=2048, help="distinct in-memory images per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, help="also write the result JSON here (rank 0)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--bf16", action="store_true", help="bf16 autocast")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--compile", action="store_true", help="torch.compile the (DDP-wrapped) model")
    p.add_argument("--ddp", action="store_true", help="process group + DDP even for one process "
                   "(nccl on CUDA, gloo on CPU; MASTER_ADDR/PORT default to 127.0.0.1 and a free port)")
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from cyclone_kit.runtime.engine.models import build_model

    torch.set_num_threads(args.threads)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    cuda = args.device == "cuda"
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
        torch.backends.cudnn.benchmark = True
    use_ddp = world > 1 or args.ddp
    if use_ddp:
        if world == 1:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
        extra = {"device_id": dev} if cuda else {}
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world, **extra)

    torch.manual_seed(args.seed)
    model = build_model(args.model, args.num_classes, args.image_size).to(dev)
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format
    model = model.to(memory_format=fmt)
    if use_ddp:
        model = DDP(model, device_ids=[dev.index] if cuda else None)
    runner = torch.compile(model) if args.compile else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    criterion = nn.CrossEntropyLoss()

    g = torch.Generator().manual_seed(args.seed * 1000 + rank)
    pool = max(args.pool, args.batch)
    images = torch.randn(pool, 3, args.image_size, args.image_size, generator=g)
    labels = torch.randint(0, args.num_classes, (pool,), generator=g)
    images, labels = images.to(dev).contiguous(memory_format=fmt), labels.to(dev)
    starts = list(range(0, pool - args.batch + 1, args.batch))

    rates: list[float] = []
    ends: list[float] = []
    loss = torch.zeros(())
    autocast = torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=args.bf16)
    loop_start = time.time()
    window_start, n = time.perf_counter(), 0
    for step in range(1, args.steps + 1):
        j = starts[step % len(starts)]
        x, y = images[j:j + args.batch], labels[j:j + args.batch]
        with autocast:
            loss = criterion(runner(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        n += 1
        if step % args.log_every == 0 or step == args.steps:
            value = float(loss.item())  # the window's only host sync (also waits for the GPU)
            elapsed = max(time.perf_counter() - window_start, 1e-9)
            rates.append(args.batch * world * n / elapsed)
            ends.append(time.time())
            window_start, n = time.perf_counter(), 0
    steady = rates[1:] if len(rates) > 1 else rates
    result = {"samples_per_s": statistics.median(steady), "loop_start_unix": loop_start, "window_rates": rates,
              "window_end_unix": ends,
              "world_size": world, "steps": args.steps, "final_loss": value, "model": args.model,
              "batch": args.batch, "threads": torch.get_num_threads(), "device": str(dev), "bf16": args.bf16,
              "channels_last": args.channels_last, "compile": args.compile, "ddp": use_ddp,
              "backend": dist.get_backend() if use_ddp else None}
    if rank == 0:
        line = json.dumps(result)
        print(line, flush=True)
        if args.out:
            args.out.write_text(line + "\n", encoding="utf-8")
    if use_ddp:
        dist.barrier()  # nobody tears gloo down while a peer still talks to it (seen: "terminate called ...")
        dist.destroy_process_group()
    return 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    sys.exit(main())
