"""A plain Hugging Face Accelerate training script: no cyclone_kit import.

``Accelerator()`` finds its ranks in the torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT) that ``accelerate launch``, torchrun or cyclone_kit's launch shim set;
on CPU it runs MULTI_CPU over gloo. Synthetic data, nothing is downloaded.

    cyclone-kit run examples/accelerate_example.py --nproc 2 -- --steps 20
    cyclone-kit submit examples/accelerate_example.py --nodes 2 --ntasks-per-node 2 -- --steps 20
"""

from __future__ import annotations

import argparse
import socket

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="samples per device per step")
    args = parser.parse_args()

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    print(f"accelerate_example: rank {accelerator.process_index} of {accelerator.num_processes} on "
          f"{socket.gethostname()} (local rank {accelerator.local_process_index}), "
          f"{accelerator.distributed_type}", flush=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(4096, 3, 32, 32, generator=generator), torch.randint(0, 10, (4096,), generator=generator))
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    step = 0
    while step < args.steps:
        for images, labels in loader:
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            accelerator.backward(loss)
            optimizer.step()
            step += 1
            if step >= args.steps:
                break
    loss = accelerator.reduce(loss.detach(), reduction="mean")
    if accelerator.is_main_process:
        print(f"accelerate_example: {step} steps, world size {accelerator.num_processes}, loss {loss.item():.4f}",
              flush=True)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
