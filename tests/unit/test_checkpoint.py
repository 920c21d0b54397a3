"""Checkpoints: atomic writes, keep-last-K, corrupt files skipped, RNG round trip, kill mid-write."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from cyclone_kit.runtime import checkpoint as ck
from cyclone_kit.runtime.plan import lr_factor, make_plan, resolve_precision, scaled_lr
from cyclone_kit.runtime.train import use_static_graph


def _state(step: int) -> dict:
    return {"model": {"w": torch.full((4,), float(step))}, "step": step, "rng": [ck.capture_rng()]}


def test_save_load_and_keep_last_k(tmp_path: Path) -> None:
    for step in (10, 20, 30, 40):
        ck.save_checkpoint(tmp_path, _state(step), step, keep=2)
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [40, 30]
    state, path = ck.load_latest(tmp_path)
    assert state["step"] == 40 and path.name == "ckpt-000000040.pt"
    assert torch.equal(state["model"]["w"], torch.full((4,), 40.0))
    assert not list(tmp_path.glob(".*.tmp"))


def test_corrupt_newest_is_skipped(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    ck.save_checkpoint(tmp_path, _state(10), 10, keep=3)
    newest = ck.save_checkpoint(tmp_path, _state(20), 20, keep=3)
    newest.write_bytes(newest.read_bytes()[:100])  # truncated, as by a full disk
    (tmp_path / "ckpt-000000030.pt").write_bytes(b"not a checkpoint")
    state, _path = ck.load_latest(tmp_path)
    assert state["step"] == 10
    assert capfd.readouterr().err.count("skipping unreadable checkpoint") == 2


def test_foreign_pickle_is_refused(tmp_path: Path) -> None:
    torch.save({"something": 1}, tmp_path / "ckpt-000000005.pt")
    assert ck.load_latest(tmp_path) is None


def test_no_checkpoint_dir_means_none(tmp_path: Path) -> None:
    assert ck.load_latest(tmp_path / "missing") is None


def test_rng_round_trip_restores_every_generator(tmp_path: Path) -> None:
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    ck.save_checkpoint(tmp_path, {"model": {}, "step": 1, "rng": [ck.capture_rng()]}, 1, keep=1)
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    state, _ = ck.load_latest(tmp_path)  # weights_only=True load
    ck.restore_rng(state["rng"][0])
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]




# ------------------------------------------------------------------------ schedule maths (pure)
def test_linear_lr_scaling_goyal() -> None:
    assert scaled_lr(0.1, 8192, 256, "linear") == pytest.approx(3.2)
    assert scaled_lr(0.1, 1024, 256, "sqrt") == pytest.approx(0.2)
    assert scaled_lr(0.1, 1024, 256, "none") == 0.1


def test_warmup_then_cosine() -> None:
    factors = [lr_factor(s, 5, 25) for s in range(25)]
    assert factors[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert factors[5] == pytest.approx(1.0)
    assert all(a >= b for a, b in itertools.pairwise(factors[5:]))
    assert lr_factor(24, 5, 25) < 0.01


def test_plan_epochs_override_steps_and_batch_arithmetic() -> None:
    from cyclone_kit.config.job import TrainConfig

    tc = TrainConfig(batch_size=32, grad_accum=2, epochs=3, lr=0.1, base_batch_size=256)
    plan = make_plan(tc, world_size=4, samples_per_rank=1000)
    assert (plan.global_batch, plan.steps_per_epoch, plan.total_steps) == (256, 15, 45)
    assert plan.lr == pytest.approx(0.1)


def test_plan_too_little_data_is_a_validation_error() -> None:
    from cyclone_kit.config.job import TrainConfig
    from cyclone_kit.core.errors import ValidationError

    with pytest.raises(ValidationError, match="fewer than one"):
        make_plan(TrainConfig(batch_size=64), world_size=2, samples_per_rank=10)


@pytest.mark.parametrize(
    ("requested", "kind", "bf16", "expected"),
    [("auto", "cuda", True, "bf16"), ("auto", "cuda", False, "fp16"), ("auto", "cpu", False, "fp32"),
     ("fp16", "cpu", False, "fp32"), ("bf16", "cuda", False, "fp16"), ("fp32", "cuda", True, "fp32")],
)
def test_resolve_precision(requested: str, kind: str, bf16: bool, expected: str) -> None:
    assert resolve_precision(requested, kind, bf16) == expected


@pytest.mark.parametrize("strategy", ["pipeline"])  # pipeline has its own loop (runtime/engine.py), no model wrapper
def test_unavailable_strategies_are_a_validation_error(strategy: str) -> None:
    from cyclone_kit.config.job import TrainConfig
    from cyclone_kit.core.errors import ValidationError
    from cyclone_kit.runtime.dist import DeviceChoice
    from cyclone_kit.runtime.models import TinyCNN
    from cyclone_kit.runtime.train import STRATEGIES, wrap_model

    with pytest.raises(ValidationError, match="not available yet") as err:
        wrap_model(strategy, TinyCNN(), DeviceChoice("cpu", None, "cpu", "gloo"), TrainConfig(), distributed=True)
    assert set(STRATEGIES) <= {"ddp", "fsdp", "horovod", "pipeline"} and "ddp" in err.value.hint


def test_single_process_needs_no_wrapper() -> None:
    from cyclone_kit.config.job import TrainConfig
    from cyclone_kit.runtime.dist import DeviceChoice
    from cyclone_kit.runtime.models import TinyCNN
    from cyclone_kit.runtime.train import wrap_model

    model = TinyCNN()
    for strategy in ("ddp", "fsdp"):
        assert wrap_model(strategy, model, DeviceChoice("cpu", None, "cpu", "gloo"), TrainConfig(), False) is model


def test_ddp_static_graph_by_default_but_never_with_accumulation_or_compile() -> None:
    from cyclone_kit.config.job import TrainConfig

    assert use_static_graph(TrainConfig())
    assert not use_static_graph(TrainConfig(grad_accum=2))  # no_sync + static graph: reducer assert
    assert not use_static_graph(TrainConfig(compile=True))
    assert not use_static_graph(TrainConfig(static_graph=False))
