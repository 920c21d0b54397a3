"""Data sets and loaders: synthetic, CIFAR-10, Fashion-MNIST, ImageFolder. Nothing is downloaded.

Two loader kinds behind one small interface (``set_epoch(epoch, start_batch)``, ``len()``,
iteration yielding ``(images, labels)`` already on the device):

* :class:`InMemoryLoader` for data sets that fit in memory (synthetic, CIFAR-10,
  Fashion-MNIST): one uint8/float tensor, batches gathered with one indexing op, normalised
  and augmented on the device; no worker processes.
* :class:`FolderLoader` for ImageFolder trees: a torch DataLoader with workers sized from
  ``--cpus-per-task``, pinned memory and persistent workers on CUDA. Its workers ignore SIGTERM
  and the requeue signals (:func:`ignore_stop_signals`): Slurm signals every process of the
  step, torch's worker handler dies of a SIGTERM that does not come from its parent, and the
  main process would then fail instead of checkpointing; the main process decides the stop.

Both shard with :class:`ResumableSampler` (a DistributedSampler that can start mid-epoch), so
a resumed run sees exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import gzip
import math
import pickle
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

from cyclone_kit.config.job import TrainConfig
from cyclone_kit.core.errors import ValidationError
from cyclone_kit.runtime.env import DistEnv

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
FASHION_MEAN = (0.2860,)
FASHION_STD = (0.3530,)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
#: Debian's dataset-fashion-mnist package installs the IDX files here.
DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
#: Bytes of distinct synthetic images kept in memory; sample i is image i % pool.
SYNTHETIC_POOL_BYTES = 64 * 2**20
_FASHION_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}


@dataclass(frozen=True)
class DataInfo:
    """What the model needs to know about the data: classes, image size, channels, sizes."""

    name: str
    num_classes: int
    image_size: int
    channels: int
    train_size: int
    val_size: int
    in_memory: bool


@dataclass
class Data:
    """The train loader, the validation loader (None when the data set has no split) and info."""

    train: Any
    val: Any
    info: DataInfo


# --------------------------------------------------------------------------- sampling
class ResumableSampler(DistributedSampler):
    """A DistributedSampler that can skip the first samples of an epoch (for exact resume)."""

    def __init__(self, size: int, env: DistEnv, seed: int, shuffle: bool = True) -> None:
        super().__init__(range(size), num_replicas=env.world_size, rank=env.rank, shuffle=shuffle, seed=seed,
                         drop_last=False)
        self.skip = 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        """Select the epoch's permutation and skip its first ``skip`` samples of this rank."""
        super().set_epoch(epoch)
        self.skip = skip

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        return iter(indices[self.skip:])

    def __len__(self) -> int:
        return max(super().__len__() - self.skip, 0)

    def full_length(self) -> int:
        """Samples of this rank in a whole epoch."""
        return super().__len__()


# --------------------------------------------------------------------------- in-memory loader
class InMemoryLoader:
    """Batches from in-memory tensors: one gather, then normalise/augment on the device.

    Args:
        images: (N, C, H, W) uint8 (scaled by 1/255, then normalised) or float (used as is).
        labels: (N,) int64.
        sampler: the rank's sampler (None for validation: then ``indices`` is used).
        batch_size: per-rank batch size; incomplete last batches are dropped when training.
        device: where batches go; the tensors are moved there once when it is CUDA.
        mean, std: per-channel normalisation for uint8 data.
        augment: random crop (pad 4) + horizontal flip, seeded per (seed, epoch, batch, rank).
        virtual_size: number of samples (sample i is row i % N), for synthetic pools.
    """

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        *,
        batch_size: int,
        device: torch.device,
        sampler: ResumableSampler | None = None,
        indices: list[int] | None = None,
        mean: tuple[float, ...] = (),
        std: tuple[float, ...] = (),
        augment: bool = False,
        channels_last: bool = False,
        seed: int = 0,
        rank: int = 0,
        drop_last: bool = True,
    ) -> None:
        if device.type == "cuda":
            images, labels = images.to(device), labels.to(device)
        self.images, self.labels = images, labels
        self.sampler, self.indices = sampler, indices
        self.batch_size, self.device = batch_size, device
        self.mean = torch.tensor(mean, device=device).view(1, -1, 1, 1) if mean else None
        self.std = torch.tensor(std, device=device).view(1, -1, 1, 1) if std else None
        self.augment, self.channels_last = augment, channels_last
        self.seed, self.rank, self.drop_last = seed, rank, drop_last
        self.epoch, self.start_batch = 0, 0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Start epoch ``epoch`` at batch ``start_batch`` (batches of this rank)."""
        self.epoch, self.start_batch = epoch, start_batch
        if self.sampler is not None:
            self.sampler.set_epoch(epoch, start_batch * self.batch_size)

    def __len__(self) -> int:
        n = len(self.sampler) if self.sampler is not None else len(self.indices or [])
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = list(self.sampler) if self.sampler is not None else list(self.indices or [])
        index = torch.tensor(order, dtype=torch.long) % self.images.shape[0]
        if self.images.device.type == "cuda":
            index = index.to(self.images.device)
        for b in range(len(self)):
            idx = index[b * self.batch_size:(b + 1) * self.batch_size]
            x = self.images.index_select(0, idx)
            y = self.labels.index_select(0, idx)
            if x.device != self.device:
                x = x.to(self.device, non_blocking=True)
                y = y.to(self.device, non_blocking=True)
            yield self._prepare(x, self.start_batch + b), y

    def _prepare(self, x: torch.Tensor, batch: int) -> torch.Tensor:
        if x.dtype == torch.uint8:
            x = x.float().div_(255.0)
        if self.mean is not None and self.std is not None:
            x = (x - self.mean) / self.std
        if self.augment:
            g = torch.Generator().manual_seed(batch_seed(self.seed, self.epoch, batch, self.rank))
            x = random_crop_flip(x, g)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x


def batch_seed(seed: int, epoch: int, batch: int, rank: int) -> int:
    """The augmentation seed of one batch: a pure function, so a resumed run augments identically."""
    return (((seed * 1_000_003 + epoch) * 1_000_003 + batch) * 1_009 + rank) % (2**63 - 1)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a small CPU tensor to ``device``; on CUDA from pinned memory, asynchronously."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def random_crop_flip(x: torch.Tensor, generator: torch.Generator, pad: int = 4) -> torch.Tensor:
    """Per-sample random crop (zero padding ``pad``) and horizontal flip of a (B, C, H, W) batch."""
    b, c, h, w = x.shape
    # Drawn on the CPU (a CPU generator keeps resume exact), then copied without a host sync.
    offsets = _to_device(torch.randint(0, 2 * pad + 1, (2, b), generator=generator), x.device)
    flips = _to_device(torch.rand(b, generator=generator) < 0.5, x.device)
    padded = F.pad(x, (pad, pad, pad, pad))
    rows = (offsets[0][:, None] + torch.arange(h, device=x.device))[:, None, :, None]
    cols = (offsets[1][:, None] + torch.arange(w, device=x.device))
    cols = torch.where(flips[:, None], cols.flip(1), cols)[:, None, None, :]
    bi = torch.arange(b, device=x.device)[:, None, None, None]
    ci = torch.arange(c, device=x.device)[None, :, None, None]
    return padded[bi, ci, rows, cols]


# --------------------------------------------------------------------------- folder loader
#: Signals a DataLoader worker ignores: SIGTERM and every requeue signal a spec may choose
#: (config.SIGNALS but INT, which stays Ctrl-C's).
WORKER_IGNORED_SIGNALS = ("TERM", "USR1", "USR2", "HUP", "URG")


def ignore_stop_signals(worker_id: int) -> None:
    """``worker_init_fn`` of the folder loader: this worker ignores :data:`WORKER_IGNORED_SIGNALS`
    (it runs after torch's own worker handlers are set, so it replaces its SIGTERM handler). The
    worker still exits with its main process (torch's parent watchdog)."""
    import signal

    for name in WORKER_IGNORED_SIGNALS:
        signal.signal(getattr(signal, f"SIG{name}"), signal.SIG_IGN)


class FolderLoader:
    """A DataLoader over an ImageFolder with the same interface as :class:`InMemoryLoader`."""

    def __init__(self, dataset: Any, *, sampler: Any, batch_size: int, device: torch.device, workers: int,
                 channels_last: bool, drop_last: bool = True) -> None:
        from torch.utils.data import DataLoader

        cuda = device.type == "cuda"
        self.sampler, self.device, self.channels_last = sampler, device, channels_last
        self.loader = DataLoader(
            dataset, batch_size=batch_size, sampler=sampler, num_workers=workers, pin_memory=cuda,
            persistent_workers=workers > 0, drop_last=drop_last,
            prefetch_factor=4 if workers > 0 else None,
            worker_init_fn=ignore_stop_signals if workers > 0 else None,
        )

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Start epoch ``epoch`` at batch ``start_batch``."""
        if isinstance(self.sampler, ResumableSampler):
            self.sampler.set_epoch(epoch, start_batch * self.loader.batch_size)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        fmt = torch.channels_last if self.channels_last else torch.contiguous_format
        for x, y in self.loader:
            yield (x.to(self.device, non_blocking=True, memory_format=fmt), y.to(self.device, non_blocking=True))


# --------------------------------------------------------------------------- data sets
def build_data(train: TrainConfig, env: DistEnv, device: torch.device, *, workers: int,
               channels_last: bool = False) -> Data:
    """Build the train and validation loaders of ``train.dataset`` for this rank.

    Raises:
        ValidationError: files missing or unreadable (with a HINT; nothing is downloaded).
    """
    builder = {
        "synthetic": _synthetic,
        "cifar10": _cifar10,
        "fashion_mnist": _fashion_mnist,
        "imagefolder": _imagefolder,
    }[train.dataset]
    return builder(train, env, device, workers, channels_last)


def _in_memory(name: str, train: TrainConfig, env: DistEnv, device: torch.device, channels_last: bool,
               tr: tuple[torch.Tensor, torch.Tensor], va: tuple[torch.Tensor, torch.Tensor] | None,
               num_classes: int, *, virtual_size: int | None = None, mean: tuple[float, ...] = (),
               std: tuple[float, ...] = (), augment: bool = False) -> Data:
    size = virtual_size or tr[0].shape[0]
    sampler = ResumableSampler(size, env, seed=train.seed)
    common = dict(batch_size=train.batch_size, device=device, mean=mean, std=std, channels_last=channels_last,
                  seed=train.seed, rank=env.rank)
    loader = InMemoryLoader(*tr, sampler=sampler, augment=augment, **common)
    val = None
    val_size = 0
    if va is not None:
        n = va[0].shape[0] if not train.val_samples else min(train.val_samples, va[0].shape[0])
        val_size = n
        val = InMemoryLoader(*va, indices=list(range(env.rank, n, env.world_size)), drop_last=False, **common)
    image = tr[0].shape[-1]
    info = DataInfo(name, num_classes, image, tr[0].shape[1], size, val_size, True)
    return Data(loader, val, info)


def synthetic_pool(count: int, image_size: int, channels: int, num_classes: int, seed: int,
                   template_seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic, learnable synthetic images: a per-class low-frequency pattern plus noise."""
    g = torch.Generator().manual_seed(template_seed)
    templates = torch.randn(num_classes, channels, 4, 4, generator=g)
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, num_classes, (count,), generator=g)
    images = torch.empty(count, channels, image_size, image_size)
    for start in range(0, count, 256):
        lab = labels[start:start + 256]
        pattern = F.interpolate(templates[lab], size=(image_size, image_size), mode="bilinear", align_corners=False)
        images[start:start + 256] = pattern + torch.randn(pattern.shape, generator=g)
    return images, labels


def _synthetic(train: TrainConfig, env: DistEnv, device: torch.device, workers: int, channels_last: bool) -> Data:
    per_image = 3 * train.image_size**2 * 4
    pool = max(1, min(train.synthetic_samples, SYNTHETIC_POOL_BYTES // per_image))
    tr = synthetic_pool(pool, train.image_size, 3, train.num_classes, train.seed * 2 + 1, train.seed)
    nval = min(train.val_samples or 1024, pool)
    va = synthetic_pool(nval, train.image_size, 3, train.num_classes, train.seed * 2 + 2, train.seed)
    return _in_memory("synthetic", train, env, device, channels_last, tr, va, train.num_classes,
                      virtual_size=train.synthetic_samples)


def cifar10_dir(data_dir: str | Path) -> Path:
    """The directory holding CIFAR-10's python batches (``data_dir`` or its cifar-10-batches-py).

    Raises:
        ValidationError: the batch files are not there.
    """
    base = Path(data_dir)
    needed = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for cand in (base, base / "cifar-10-batches-py"):
        if all((cand / n).is_file() for n in needed):
            return cand
    missing = [n for n in needed if not (base / n).is_file() and not (base / "cifar-10-batches-py" / n).is_file()]
    raise ValidationError(
        f"CIFAR-10 not found in {str(base)!r}: missing {', '.join(missing)}",
        hint="extract cifar-10-python.tar.gz (from www.cs.toronto.edu/~kriz/cifar.html, on a machine with "
        "internet) and set train.data_dir to the cifar-10-batches-py directory; nothing is downloaded",
    )


def load_cifar10(data_dir: str | Path) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Read CIFAR-10's pickled batches into uint8 (N, 3, 32, 32) tensors and int64 labels."""
    folder = cifar10_dir(data_dir)

    def read(names: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        xs, ys = [], []
        for n in names:
            try:
                with open(folder / n, "rb") as f:
                    batch = pickle.load(f, encoding="bytes")
                data, labels = batch[b"data"], batch.get(b"labels", batch.get(b"fine_labels"))
            except Exception as e:
                raise ValidationError(f"CIFAR-10 file {str(folder / n)!r} is unreadable: {e}",
                                      hint="re-extract cifar-10-python.tar.gz") from None
            xs.append(torch.as_tensor(data, dtype=torch.uint8).reshape(-1, 3, 32, 32))
            ys.append(torch.as_tensor(labels, dtype=torch.long))
        return torch.cat(xs), torch.cat(ys)

    return read([f"data_batch_{i}" for i in range(1, 6)]), read(["test_batch"])


def _cifar10(train: TrainConfig, env: DistEnv, device: torch.device, workers: int, channels_last: bool) -> Data:
    tr, va = load_cifar10(train.data_dir)
    return _in_memory("cifar10", train, env, device, channels_last, tr, va, 10, mean=CIFAR10_MEAN,
                      std=CIFAR10_STD, augment=True)


def fashion_mnist_dir(data_dir: str | Path) -> Path:
    """The directory holding Fashion-MNIST's IDX files (plain or .gz).

    Accepts the directory itself, torchvision's ``<root>/FashionMNIST/raw`` layout, or Debian's
    ``/usr/share/datasets/fashion-mnist``.

    Raises:
        ValidationError: the files are not found.
    """
    base = Path(data_dir)
    for cand in (base, base / "FashionMNIST" / "raw", base / "raw", base / "fashion-mnist"):
        if all(_idx_path(cand, n) is not None for n in _FASHION_FILES.values()):
            return cand
    raise ValidationError(
        f"Fashion-MNIST not found in {str(base)!r} (need {', '.join(_FASHION_FILES.values())}, plain or .gz)",
        hint=f"install Debian's dataset-fashion-mnist (files in {DEBIAN_FASHION_MNIST}) and set "
        f"train.data_dir={DEBIAN_FASHION_MNIST}, or copy the IDX files there; nothing is downloaded",
    )


def _idx_path(folder: Path, name: str) -> Path | None:
    for cand in (folder / name, folder / f"{name}.gz"):
        if cand.is_file():
            return cand
    return None


def read_idx(path: Path) -> torch.Tensor:
    """Read an IDX file (optionally gzipped) into a uint8 tensor of its declared shape."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
        zero, dtype, ndim = struct.unpack(">HBB", raw[:4])
        dims = struct.unpack(f">{ndim}I", raw[4:4 + 4 * ndim])
        if zero != 0 or dtype != 0x08:
            raise ValueError(f"not an unsigned-byte IDX file (magic {raw[:4].hex()})")
        data = torch.frombuffer(bytearray(raw[4 + 4 * ndim:]), dtype=torch.uint8)
        return data.reshape(dims)
    except (OSError, ValueError, RuntimeError, struct.error, EOFError) as e:
        raise ValidationError(f"Fashion-MNIST file {str(path)!r} is unreadable: {e}",
                              hint="reinstall dataset-fashion-mnist or copy the IDX files again") from None


def load_fashion_mnist(data_dir: str | Path) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Read Fashion-MNIST into uint8 (N, 1, 28, 28) images and int64 labels (train, test)."""
    folder = fashion_mnist_dir(data_dir)

    def pair(images: str, labels: str) -> tuple[torch.Tensor, torch.Tensor]:
        x = read_idx(_idx_path(folder, _FASHION_FILES[images]))  # type: ignore[arg-type]
        y = read_idx(_idx_path(folder, _FASHION_FILES[labels])).long()  # type: ignore[arg-type]
        return x.unsqueeze(1), y

    return pair("train_images", "train_labels"), pair("test_images", "test_labels")


def _fashion_mnist(train: TrainConfig, env: DistEnv, device: torch.device, workers: int, channels_last: bool) -> Data:
    tr, va = load_fashion_mnist(train.data_dir)
    return _in_memory("fashion_mnist", train, env, device, channels_last, tr, va, 10, mean=FASHION_MEAN,
                      std=FASHION_STD)


def _imagefolder(train: TrainConfig, env: DistEnv, device: torch.device, workers: int, channels_last: bool) -> Data:
    from torch.utils.data import Subset
    from torchvision import datasets, transforms

    base = Path(train.data_dir)
    train_dir = base / "train" if (base / "train").is_dir() else base
    val_dir = base / "val" if (base / "val").is_dir() else None
    if not train_dir.is_dir():
        raise ValidationError(f"ImageFolder directory {str(base)!r} does not exist",
                              hint="set train.data_dir to a folder with train/<class>/*.jpg (and val/<class>/...)")
    s = train.image_size
    norm = [transforms.ToTensor(), transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    if s > 64:
        t_train = transforms.Compose([transforms.RandomResizedCrop(s), transforms.RandomHorizontalFlip(), *norm])
        t_val = transforms.Compose([transforms.Resize(round(s / 0.875)), transforms.CenterCrop(s), *norm])
    else:
        t_train = transforms.Compose([transforms.Resize((s, s)), transforms.RandomHorizontalFlip(), *norm])
        t_val = transforms.Compose([transforms.Resize((s, s)), *norm])
    try:
        ds = datasets.ImageFolder(str(train_dir), transform=t_train)
        vds = datasets.ImageFolder(str(val_dir), transform=t_val) if val_dir else None
    except (FileNotFoundError, OSError) as e:
        raise ValidationError(f"ImageFolder {str(base)!r}: {e}",
                              hint="use one sub-folder per class holding .jpg/.png files (train/ and val/ optional)"
                              ) from None
    sampler = ResumableSampler(len(ds), env, seed=train.seed)
    loader = FolderLoader(ds, sampler=sampler, batch_size=train.batch_size, device=device, workers=workers,
                          channels_last=channels_last)
    val = None
    val_size = 0
    if vds is not None:
        n = len(vds) if not train.val_samples else min(train.val_samples, len(vds))
        val_size = n
        val = FolderLoader(Subset(vds, list(range(env.rank, n, env.world_size))), sampler=None,
                           batch_size=train.batch_size, device=device, workers=0, channels_last=channels_last,
                           drop_last=False)
    info = DataInfo("imagefolder", len(ds.classes), s, 3, len(ds), val_size, False)
    return Data(loader, val, info)


def auto_workers(requested: int, cpus: int, in_memory: bool) -> int:
    """DataLoader workers: the spec's count when >= 0; else 0 for in-memory data, else the rank's
    cores minus the one the training loop runs on (at most 8; ``cpus`` from dist.worker_cpus)."""
    if requested >= 0:
        return requested
    if in_memory:
        return 0
    return max(0, min(8, cpus - 1))
