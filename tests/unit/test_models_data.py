"""Models by name and the data loaders (synthetic, CIFAR-10, ImageFolder, Fashion-MNIST), on real
files the tests write in each data set's own format."""

from __future__ import annotations

import gzip
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from cyclone_kit.config.job import MODELS, TrainConfig
from cyclone_kit.core.errors import ValidationError
from cyclone_kit.runtime.engine.data import (
    DEBIAN_FASHION_MNIST,
    ResumableSampler,
    auto_workers,
    build_data,
    load_fashion_mnist,
    random_crop_flip,
)
from cyclone_kit.runtime.engine.models import build_model
from cyclone_kit.runtime.env import DistEnv

torch.set_num_threads(1)
CPU = torch.device("cpu")


# ------------------------------------------------------------------------ models
@pytest.mark.parametrize("name", MODELS)
def test_every_model_builds_and_forwards(name: str) -> None:
    torch.manual_seed(0)
    model = build_model(name, num_classes=7, image_size=32).eval()
    with torch.no_grad():
        out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 7)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", ["tiny_cnn", "resnet18", "mobilenet_v3_small"])
def test_one_channel_inputs(name: str) -> None:
    model = build_model(name, num_classes=10, image_size=28, in_channels=1).eval()
    with torch.no_grad():
        assert model(torch.randn(2, 1, 28, 28)).shape == (2, 10)


def test_small_image_stem_only_for_small_images() -> None:
    small, large = build_model("resnet18", 10, 32), build_model("resnet18", 10, 224)
    assert small.conv1.kernel_size == (3, 3) and small.conv1.stride == (1, 1)
    assert isinstance(small.maxpool, torch.nn.Identity)
    assert large.conv1.kernel_size == (7, 7) and isinstance(large.maxpool, torch.nn.MaxPool2d)


def test_vit_needs_multiple_of_16() -> None:
    with pytest.raises(ValidationError, match="divisible by 16"):
        build_model("vit_b_16", 10, 28)


def test_unknown_model() -> None:
    with pytest.raises(ValidationError, match="unknown model"):
        build_model("alexnet", 10, 32)


# ------------------------------------------------------------------------ sampling
def test_resumable_sampler_skips_the_head_of_the_same_order() -> None:
    env = DistEnv(rank=1, world_size=2, local_rank=1, local_world_size=2)
    s = ResumableSampler(100, env, seed=3)
    s.set_epoch(4)
    full = list(s)
    s.set_epoch(4, skip=10)
    assert list(s) == full[10:] and len(s) == 40 and s.full_length() == 50
    s.set_epoch(5)
    assert list(s) != full


def test_two_ranks_cover_the_data_once() -> None:
    parts = []
    for rank in range(2):
        s = ResumableSampler(10, DistEnv(rank=rank, world_size=2, local_rank=rank, local_world_size=2), seed=0)
        s.set_epoch(0)
        parts.append(list(s))
    assert sorted(parts[0] + parts[1]) == list(range(10))


def test_auto_workers() -> None:
    assert auto_workers(-1, 10, in_memory=True) == 0
    assert auto_workers(-1, 10, in_memory=False) == 8
    assert auto_workers(-1, 4, in_memory=False) == 3
    assert auto_workers(2, 10, in_memory=False) == 2
    assert auto_workers(-1, 1, in_memory=False) == 0  # one core: the loop reads inline


def test_random_crop_flip_is_seeded_and_keeps_shape() -> None:
    x = torch.arange(2 * 3 * 8 * 8, dtype=torch.float32).reshape(2, 3, 8, 8)
    a = random_crop_flip(x, torch.Generator().manual_seed(1))
    b = random_crop_flip(x, torch.Generator().manual_seed(1))
    assert a.shape == x.shape and torch.equal(a, b)


# ------------------------------------------------------------------------ synthetic
def test_synthetic_is_deterministic_and_learnable_shaped() -> None:
    tc = TrainConfig(model="tiny_cnn", dataset="synthetic", synthetic_samples=300, batch_size=16, image_size=16,
                     num_classes=5, val_samples=40)
    a = build_data(tc, DistEnv(), CPU, workers=0)
    b = build_data(tc, DistEnv(), CPU, workers=0)
    a.train.set_epoch(0)
    b.train.set_epoch(0)
    xa, ya = next(iter(a.train))
    xb, yb = next(iter(b.train))
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert xa.shape == (16, 3, 16, 16) and int(ya.max()) < 5
    assert len(a.train) == 300 // 16 and a.info.val_size == 40


# ------------------------------------------------------------------------ CIFAR-10 on files in its own format
def _write_cifar(root: Path, per_batch: int = 12) -> Path:
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"batch_label": name.encode(), b"labels": [int(v) for v in rng.integers(0, 10, per_batch)],
                 b"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
                 b"filenames": [f"{i}.png".encode() for i in range(per_batch)]}
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f)
    return folder


def test_cifar10_loader_on_files_in_cifar_format(tmp_path: Path) -> None:
    folder = _write_cifar(tmp_path)
    for data_dir in (tmp_path, folder):  # the parent or the batches directory itself
        tc = TrainConfig(model="tiny_cnn", dataset="cifar10", data_dir=str(data_dir), batch_size=8)
        data = build_data(tc, DistEnv(), CPU, workers=0)
        assert (data.info.train_size, data.info.val_size, data.info.num_classes) == (60, 12, 10)
        data.train.set_epoch(0)
        x, y = next(iter(data.train))
        assert x.shape == (8, 3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.long
        assert -3 < float(x.mean()) < 3
        val = [b for b in data.val]
        assert sum(len(b[1]) for b in val) == 12


def test_cifar10_pixel_layout_matches_the_format(tmp_path: Path) -> None:
    from cyclone_kit.runtime.engine.data import load_cifar10

    folder = _write_cifar(tmp_path, per_batch=2)
    with open(folder / "data_batch_1", "rb") as f:
        raw = pickle.load(f, encoding="bytes")
    (x, y), _ = load_cifar10(folder)
    # CIFAR rows are 1024 red, 1024 green, 1024 blue values, each row-major 32x32.
    assert int(x[0, 1, 0, 5]) == int(raw[b"data"][0][1024 + 5])
    assert int(y[0]) == raw[b"labels"][0]


def test_cifar10_missing_files_never_download(tmp_path: Path) -> None:
    folder = _write_cifar(tmp_path)
    (folder / "data_batch_3").unlink()
    with pytest.raises(ValidationError, match="missing data_batch_3") as err:
        build_data(TrainConfig(dataset="cifar10", data_dir=str(tmp_path)), DistEnv(), CPU, workers=0)
    assert "nothing is downloaded" in err.value.hint


# ------------------------------------------------------------------------ ImageFolder on a PNG tree
def test_imagefolder_on_a_png_tree(tmp_path: Path) -> None:
    from PIL import Image

    rng = np.random.default_rng(1)
    for split, count in (("train", 6), ("val", 2)):
        for cls in ("cat", "dog", "emu"):
            d = tmp_path / split / cls
            d.mkdir(parents=True)
            for i in range(count):
                Image.fromarray(rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)).save(d / f"{i}.png")
    tc = TrainConfig(model="tiny_cnn", dataset="imagefolder", data_dir=str(tmp_path), image_size=16, batch_size=4,
                     num_classes=3)
    data = build_data(tc, DistEnv(), CPU, workers=0)
    assert (data.info.num_classes, data.info.train_size, data.info.val_size) == (3, 18, 6)
    data.train.set_epoch(0)
    batches = list(data.train)
    assert len(batches) == 4 and batches[0][0].shape == (4, 3, 16, 16)
    assert sum(len(y) for _, y in data.val) == 6


def test_imagefolder_missing_dir(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="does not exist"):
        build_data(TrainConfig(dataset="imagefolder", data_dir=str(tmp_path / "nope")), DistEnv(), CPU, workers=0)


def test_imagefolder_without_classes(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="ImageFolder") as err:
        build_data(TrainConfig(dataset="imagefolder", data_dir=str(tmp_path)), DistEnv(), CPU, workers=0)
    assert "sub-folder per class" in err.value.hint


# ------------------------------------------------------------------------ Fashion-MNIST
def _write_idx(path: Path, array: np.ndarray, gz: bool) -> None:
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    data = header + array.astype(np.uint8).tobytes()
    if gz:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)


@pytest.mark.parametrize("gz", [True, False])
def test_fashion_mnist_in_torchvision_layout(tmp_path: Path, gz: bool) -> None:
    raw = tmp_path / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(2)
    for prefix, n in (("train", 20), ("t10k", 10)):
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)), gz)
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", rng.integers(0, 10, (n,)), gz)
    (x, y), (vx, _vy) = load_fashion_mnist(tmp_path)
    assert x.shape == (20, 1, 28, 28) and vx.shape == (10, 1, 28, 28) and y.dtype == torch.long


def test_fashion_mnist_corrupt_file(tmp_path: Path) -> None:
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                 "t10k-labels-idx1-ubyte"):
        (tmp_path / name).write_bytes(b"\x00\x00\x0d\x01garbage")
    with pytest.raises(ValidationError, match="unreadable"):
        load_fashion_mnist(tmp_path)


def test_fashion_mnist_missing(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="Fashion-MNIST not found") as err:
        load_fashion_mnist(tmp_path)
    assert "dataset-fashion-mnist" in err.value.hint


@pytest.mark.skipif(not (DEBIAN_FASHION_MNIST / "train-images-idx3-ubyte.gz").is_file(),
                    reason=f"Debian's dataset-fashion-mnist is not installed ({DEBIAN_FASHION_MNIST})")
def test_fashion_mnist_from_the_debian_package() -> None:
    (x, y), (vx, _vy) = load_fashion_mnist(DEBIAN_FASHION_MNIST)
    assert x.shape == (60000, 1, 28, 28) and vx.shape == (10000, 1, 28, 28)
    assert sorted(torch.unique(y).tolist()) == list(range(10))
    assert torch.bincount(y).tolist() == [6000] * 10
