"""A plain Horovod training script: no cyclone_kit import.

The route of Horovod's own examples: ``hvd.init()``, the learning rate scaled by ``hvd.size()``,
``hvd.DistributedOptimizer``, parameters and optimizer state broadcast from rank 0. Horovod gets its
ranks from MPI/PMI with an MPI build, or, with a Gloo-only build, from the Gloo rendezvous that
cyclone_kit's launch shim runs inside the job (``--launcher horovod``, or ``run --horovod``).
Synthetic data, nothing is downloaded.

    cyclone-kit run examples/horovod_example.py --nproc 2 --horovod -- --steps 20
    cyclone-kit submit examples/horovod_example.py --launcher horovod --nodes 2 --ntasks-per-node 2 -- --steps 20
"""

from __future__ import annotations

import argparse
import socket

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="samples per device per step")
    parser.add_argument("--lr", type=float, default=0.01, help="per-rank learning rate (scaled by hvd.size())")
    args = parser.parse_args()

    hvd.init()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(hvd.local_rank())
    print(f"horovod_example: rank {hvd.rank()} of {hvd.size()} on {socket.gethostname()} "
          f"(local rank {hvd.local_rank()} of {hvd.local_size()})", flush=True)
    device = torch.device("cuda", hvd.local_rank()) if cuda else torch.device("cpu")
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 128), nn.ReLU(), nn.Linear(128, 10)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    generator = torch.Generator().manual_seed(1000 + hvd.rank())
    images = torch.randn(args.batch_size, 3, 32, 32, generator=generator).to(device)
    labels = torch.randint(0, 10, (args.batch_size,), generator=generator).to(device)
    for _ in range(args.steps):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
    loss = hvd.allreduce(loss.detach(), name="final_loss")
    if hvd.rank() == 0:
        print(f"horovod_example: {args.steps} steps, world size {hvd.size()}, loss {loss.item():.4f}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
