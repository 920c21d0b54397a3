"""MNIST's four raw IDX files, written where a published script expects them (nothing can be downloaded).

``torchvision.datasets.MNIST(root)`` finds ``root/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte``
and downloads nothing. The images are noise with a bright bar whose row is the label (learnable, so
a loss falls), 60,000 + 10,000 of them as in MNIST: Lightning's example splits exactly 55,000 + 5,000.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

TRAIN, TEST = 60_000, 10_000


def write_mnist(root: Path, train: int = TRAIN, test: int = TEST) -> Path:
    """Write ``root/MNIST/raw/*-ubyte``; returns the raw folder."""
    raw = Path(root) / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", train), ("t10k", test)):
        labels = rng.integers(0, 10, n, dtype=np.uint8)
        images = (rng.random((n, 28, 28)) * 64).astype(np.uint8)
        images[np.arange(n), labels.astype(np.int64) * 2 + 4, 4:24] = 255
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 0x803, n, 28, 28) + images.tobytes())
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 0x801, n) + labels.tobytes())
    return raw


def link_mnist(root: Path, raw_parent: Path) -> None:
    """Make ``root/MNIST`` a symbolic link to ``raw_parent`` (the ``MNIST`` folder of :func:`write_mnist`)."""
    Path(root).mkdir(parents=True, exist_ok=True)
    os.symlink(raw_parent, Path(root) / "MNIST")
