"""Checkpoints: atomic writes, keep-last-K, corrupt files skipped, RNG round trip, kill mid-write."""

from __future__ import annotations

import hashlib
import itertools
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from cyclone_kit.runtime import checkpoint as ck
from cyclone_kit.runtime.engine.dataparallel import use_static_graph
from cyclone_kit.runtime.engine.plan import lr_factor, make_plan, resolve_precision, scaled_lr


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
    assert capfd.readouterr().err.count("skipping damaged checkpoint") == 2


def test_a_checksum_file_is_written_beside_each_checkpoint_and_rotated_with_it(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        ck.save_checkpoint(tmp_path, _state(step), step, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-000000002.pt", "ckpt-000000002.pt.sha256", "ckpt-000000003.pt", "ckpt-000000003.pt.sha256"]
    newest = ck.checkpoint_path(tmp_path, 3)
    digest, name = ck.digest_path(newest).read_text().split()
    assert name == newest.name and digest == hashlib.sha256(newest.read_bytes()).hexdigest()  # sha256sum -c format
    assert ck.verify_checkpoint(newest) is True


def test_a_flipped_byte_in_the_newest_is_caught_by_the_checksum_and_the_previous_one_loads(tmp_path: Path) -> None:
    ck.save_checkpoint(tmp_path, _state(10), 10, keep=3)
    newest = ck.save_checkpoint(tmp_path, _state(20), 20, keep=3)
    data = bytearray(newest.read_bytes())
    # Flip one bit inside the tensor data: torch.load alone would load it (1000.0156 for 1000.0, as in the issue).
    offset = data.rfind(torch.full((4,), 20.0).numpy().tobytes())
    assert offset > 0
    data[offset + 1] ^= 0x01
    newest.write_bytes(bytes(data))
    assert not torch.equal(torch.load(newest, weights_only=True)["model"]["w"], torch.full((4,), 20.0))
    scan = ck.scan_latest(tmp_path)
    assert scan.found is not None and scan.found[0]["step"] == 10
    assert [s.path for s in scan.skipped] == [newest] and "checksum mismatch" in scan.skipped[0].reason


def test_a_checkpoint_without_a_checksum_file_still_loads(tmp_path: Path) -> None:
    """Written before checksums existed, or copied without its .sha256: nothing to verify against."""
    path = ck.save_checkpoint(tmp_path, _state(5), 5, keep=1)
    ck.digest_path(path).unlink()
    assert ck.verify_checkpoint(path) is False
    assert ck.load_latest(tmp_path)[0]["step"] == 5
    ck.digest_path(path).write_text("garbage\n")
    assert "checksum file" in ck.scan_latest(tmp_path).skipped[0].reason


def test_a_fresh_start_is_refused_when_checkpoints_exist_but_none_loads(tmp_path: Path) -> None:
    path = ck.save_checkpoint(tmp_path, _state(5), 5, keep=1)
    path.write_bytes(path.read_bytes()[:-10])
    scan = ck.scan_latest(tmp_path)
    why = ck.fresh_start_refusal(scan, tmp_path, resuming=False, from_scratch=False)
    assert scan.found is None and why is not None and "ckpt-000000005.pt" in why and "step 0" in why
    assert ck.fresh_start_refusal(scan, tmp_path, resuming=True, from_scratch=True) is None


def test_a_resume_without_any_checkpoint_is_refused_and_a_new_run_is_not(tmp_path: Path) -> None:
    empty = ck.scan_latest(tmp_path / "none")
    assert ck.fresh_start_refusal(empty, tmp_path, resuming=False, from_scratch=False) is None
    assert "no checkpoint to resume from" in ck.fresh_start_refusal(empty, tmp_path, resuming=True, from_scratch=False)
    ck.save_checkpoint(tmp_path, _state(5), 5, keep=1)
    assert ck.fresh_start_refusal(ck.scan_latest(tmp_path), tmp_path, resuming=True, from_scratch=False) is None


def test_serialized_size_is_the_size_written(tmp_path: Path) -> None:
    path = ck.save_checkpoint(tmp_path, _state(7), 7, keep=1)
    assert ck.serialized_size(_state(7)) == path.stat().st_size


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


@pytest.mark.parametrize("strategy", ["pipeline"])  # pipeline has its own engine (runtime/engine/pipeline.py), no model wrapper
def test_unavailable_strategies_are_a_validation_error(strategy: str) -> None:
    from cyclone_kit.config.job import TrainConfig
    from cyclone_kit.core.errors import ValidationError
    from cyclone_kit.runtime.dist import DeviceChoice
    from cyclone_kit.runtime.engine.dataparallel import STRATEGIES, wrap_model
    from cyclone_kit.runtime.engine.models import TinyCNN

    with pytest.raises(ValidationError, match="not available yet") as err:
        wrap_model(strategy, TinyCNN(), DeviceChoice("cpu", None, "cpu", "gloo"), TrainConfig(), distributed=True)
    assert set(STRATEGIES) <= {"ddp", "fsdp", "horovod", "pipeline"} and "ddp" in err.value.hint


def test_single_process_needs_no_wrapper() -> None:
    from cyclone_kit.config.job import TrainConfig
    from cyclone_kit.runtime.dist import DeviceChoice
    from cyclone_kit.runtime.engine.dataparallel import wrap_model
    from cyclone_kit.runtime.engine.models import TinyCNN

    model = TinyCNN()
    for strategy in ("ddp", "fsdp"):
        assert wrap_model(strategy, model, DeviceChoice("cpu", None, "cpu", "gloo"), TrainConfig(), False) is model


def test_ddp_static_graph_by_default_but_never_with_accumulation_or_compile() -> None:
    from cyclone_kit.config.job import TrainConfig

    assert use_static_graph(TrainConfig())
    assert not use_static_graph(TrainConfig(grad_accum=2))  # no_sync + static graph: reducer assert
    assert not use_static_graph(TrainConfig(compile=True))
    assert not use_static_graph(TrainConfig(static_graph=False))


# --------------------------------------------------------------------------- asynchronous writes
def test_snapshot_is_a_real_copy_of_tensors_and_containers() -> None:
    model = torch.nn.Linear(3, 2)
    sd = model.state_dict()
    state = {"model": sd, "lists": [torch.ones(2), {"n": 1}], "pair": (torch.zeros(1), "x"), "step": 4}
    copy = ck.snapshot(state)
    assert copy["model"]._metadata == sd._metadata and type(copy["model"]) is type(sd)  # load_state_dict needs it
    with torch.no_grad():
        model.weight.add_(1.0)  # an optimizer step, in place
    state["lists"][0].mul_(0)
    state["lists"][1]["n"] = 2
    state["lists"].append("later")
    assert not torch.equal(copy["model"]["weight"], model.weight)
    assert torch.equal(copy["lists"][0], torch.ones(2)) and copy["lists"][1] == {"n": 1} and len(copy["lists"]) == 2
    assert copy["pair"][1] == "x" and copy["step"] == 4


def test_background_writer_keeps_one_write_in_flight_and_raises_a_failure_once() -> None:
    import threading

    gate, order = threading.Event(), []
    writer = ck.BackgroundWriter()
    assert not writer.start(lambda: (gate.wait(), order.append(1)), 1).busy
    assert writer.busy
    threading.Thread(target=lambda: (time_wait(writer), gate.set())).start()
    waited = writer.start(lambda: order.append(2), 2)  # waits for write 1 (released once this thread waits)
    assert waited.busy and order[0] == 1
    writer.wait()
    assert order == [1, 2] and not writer.busy

    def fail() -> None:
        raise OSError(28, "No space left on device")

    writer.start(fail, 3)
    with pytest.raises(OSError, match="No space left"):
        writer.start(lambda: None, 4)  # the next save raises the failed one's error ...
    writer.wait()  # ... once: it was not started, nothing is pending
    writer.start(fail, 5)
    writer.wait(raise_error=False)  # a failing segment only warns


def time_wait(writer: ck.BackgroundWriter) -> None:
    """Return once the main thread is inside BackgroundWriter.wait (an event, read from its stack)."""
    import sys
    import threading
    import time

    main, code = threading.main_thread().ident, ck.BackgroundWriter.wait.__code__
    while True:
        frame = sys._current_frames().get(main)
        while frame is not None and frame.f_code is not code:
            frame = frame.f_back
        if frame is not None:
            return
        time.sleep(0.001)


def test_snapshot_into_a_finished_snapshot_reuses_its_buffers() -> None:
    state = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3), "t": (torch.zeros(2),), "step": 1}
    first = ck.snapshot(state)
    state["w"].add_(10)
    state["b"] = torch.ones(4)  # another shape: a new buffer
    second = ck.snapshot(state, into=first)
    assert second["w"].data_ptr() == first["w"].data_ptr() and torch.equal(second["w"], state["w"])
    assert second["b"].shape == (4,) and second["t"][0].data_ptr() == first["t"][0].data_ptr()
    state["w"].add_(1)
    assert not torch.equal(second["w"], state["w"]), "still a copy"


def test_copy_checkpoint_verifies_the_bytes_and_keeps_the_rules(tmp_path: Path) -> None:
    local, shared = tmp_path / "local", tmp_path / "shared"
    for step in (10, 20, 30):
        ck.copy_checkpoint(ck.save_checkpoint(local, _state(step), step, keep=1), shared, keep=2)
    assert [s for s, _ in ck.list_checkpoints(local)] == [30] and [s for s, _ in ck.list_checkpoints(shared)] == [30, 20]
    assert ck.verify_checkpoint(ck.checkpoint_path(shared, 30))
    assert ck.load_latest(shared)[0]["step"] == 30
    src = ck.save_checkpoint(local, _state(40), 40, keep=1)
    data = bytearray(src.read_bytes())
    data[len(data) // 2] ^= 0x01  # the first copy damaged (a flipped bit in node memory)
    src.write_bytes(bytes(data))
    with pytest.raises(ck.DamagedCheckpoint, match="the first copy is damaged"):
        ck.copy_checkpoint(src, shared, keep=2)
    assert [s for s, _ in ck.list_checkpoints(shared)] == [30, 20] and not list(shared.glob(".ckpt-*"))
    assert not ck.digest_path(ck.checkpoint_path(shared, 40)).exists()
