"""A plain Lightning training script: no cyclone_kit import.

``Trainer(devices=..., num_nodes=..., strategy="ddp")`` as in Lightning's own Slurm guide: the
devices per node and the node count default to what Slurm says (``SLURM_NTASKS_PER_NODE``,
``SLURM_NNODES``); Lightning finds its ranks in the torchrun variables cyclone_kit's launch shim
sets (its TorchElasticEnvironment), or in Slurm's when started by srun directly. Synthetic data,
nothing is downloaded.

    cyclone-kit run examples/lightning_example.py --nproc 2 -- --max-steps 20
    cyclone-kit submit examples/lightning_example.py --nodes 2 --ntasks-per-node 2 -- --max-steps 20
"""

from __future__ import annotations

import argparse
import os
import socket

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Classifier(L.LightningModule):
    """A small MLP on 3x32x32 images."""

    def __init__(self, width: int = 128, lr: float = 0.05) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, width), nn.ReLU(), nn.Linear(width, 10))
        self.lr = lr

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = F.cross_entropy(self.net(images), labels)
        self.log("loss", loss, sync_dist=False)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=int(os.environ.get("SLURM_NTASKS_PER_NODE", "1")))
    parser.add_argument("--num-nodes", type=int, default=int(os.environ.get("SLURM_NNODES", "1")))
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="samples per device per step")
    args = parser.parse_args()

    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(2048, 3, 32, 32, generator=generator), torch.randint(0, 10, (2048,), generator=generator))
    trainer = L.Trainer(
        accelerator="gpu" if torch.cuda.is_available() else "cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy="ddp",
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Classifier(), DataLoader(data, batch_size=args.batch_size, shuffle=True))
    print(f"lightning_example: rank {trainer.global_rank} of {trainer.world_size} on {socket.gethostname()} "
          f"(local rank {trainer.local_rank}, node {trainer.node_rank}), {trainer.global_step} steps, "
          f"loss {float(trainer.callback_metrics['loss']):.4f}", flush=True)


if __name__ == "__main__":
    main()
