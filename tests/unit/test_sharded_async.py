"""Issue 31: FSDP's sharded checkpoints written in the background (``checkpoint.sharded`` with ``async_write``).

The pure parts: the feature test of ``torch.distributed.checkpoint.async_save`` and its line, the verdict
on every rank's write, and the session's rule that a ``.pt`` names shards only once every write is done,
on a session of one rank with stand-in futures (the real ranks: tests/integration/test_async_checkpoint.py
and test_strategies.py).
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from cyclone_kit.config.job import CheckpointConfig
from cyclone_kit.runtime import checkpoint as ckpt
from cyclone_kit.runtime import torchcompat
from cyclone_kit.runtime.env import DistEnv
from cyclone_kit.runtime.session import Session


def test_async_save_is_feature_tested_for_its_process_group() -> None:
    def with_group(state: Any, *, checkpoint_id: Any = None, process_group: Any = None) -> None:
        pass

    def without_group(state: Any, *, checkpoint_id: Any = None) -> None:
        pass

    assert torchcompat.has_dcp_async_save(SimpleNamespace(async_save=with_group))
    assert not torchcompat.has_dcp_async_save(SimpleNamespace(async_save=without_group))
    assert not torchcompat.has_dcp_async_save(SimpleNamespace(save=with_group))  # a torch without it
    import torch.distributed.checkpoint as dcp

    assert torchcompat.has_dcp_async_save(dcp), torch.__version__  # the installed torch has it
    line = torchcompat.dcp_async_line("2.2.0")
    assert "\n" not in line and line.startswith("sharded checkpoints are written blocking: torch 2.2.0")


def test_the_verdict_names_every_rank_whose_shards_were_not_written() -> None:
    assert ckpt.shard_verdict(10, [None, None]) is None
    verdict = ckpt.shard_verdict(10, [None, "OSError: [Errno 28] No space left", "RuntimeError: peer gone"])
    assert verdict is not None and "step 10" in verdict and "rank(s) 1, 2" in verdict
    assert "rank 1: OSError: [Errno 28] No space left" in verdict and "not kept" in verdict


class _Running:
    """A stand-in future still running when first asked (so the wait counts), done when its result is read."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error

    def done(self) -> bool:
        return False

    def result(self, timeout: float | None = None) -> None:
        time.sleep(0.001)
        if self.error is not None:
            raise self.error


def _session(run_dir: Path) -> Session:
    return Session(env=DistEnv(), environ={}, run_dir=run_dir, cc=CheckpointConfig(keep=2, sharded=True),
                   stop_flag=SimpleNamespace(uninstall=lambda: None), device=SimpleNamespace(kind="cpu"),
                   distributed=False, owns_group=False, threads=1, host="h", hostnames=["h"], t_start=0.0)


def _state(step: int) -> dict[str, Any]:
    return {"model": {"dcp": f"ckpt-{step:09d}.dcp"}, "optimizer": None, "optimizer_format": "dcp", "step": step,
            "rng": [{"torch": torch.ones(3)}]}


def test_the_pt_is_written_only_once_the_shards_are_done_and_is_a_copy(tmp_path: Path) -> None:
    session = _session(tmp_path)
    folder = session.checkpoint_dir
    (folder / "ckpt-000000004.dcp").mkdir(parents=True)
    state = _state(4)
    session.save_after_shards(state, 4, _Running(), after_write=lambda d: None, staged_s=0.25)
    state["rng"][0]["torch"].add_(1.0)  # the next steps change the live state: the .pt holds the copy
    assert ckpt.list_checkpoints(folder) == [], "nothing is written while the shards are in flight"
    with pytest.raises(RuntimeError, match="still in flight"):  # at most one in flight
        session.save_after_shards(_state(6), 6, _Running())
    path = session.finish_shards(before=6)
    assert path == ckpt.checkpoint_path(folder, 4) and ckpt.verify_checkpoint(path)
    loaded = ckpt.load_checkpoint(path)
    assert loaded["model"] == {"dcp": "ckpt-000000004.dcp"} and torch.equal(loaded["rng"][0]["torch"], torch.ones(3))
    assert session.finish_shards() is None, "nothing left in flight"
    fields = session._checkpoint_fields()
    assert fields["checkpoints_async"] == 1 and fields["checkpoint_waits"] == 1, fields
    assert fields["checkpoint_snapshot_s"] >= 0.25 and fields["checkpoint_wait_s"] > 0, fields


def test_a_failed_shard_write_writes_no_pt_and_fails_the_checkpoint(tmp_path: Path) -> None:
    session = _session(tmp_path)
    session.save_after_shards(_state(4), 4, _Running(OSError(28, "No space left on device")))
    with pytest.raises(ckpt.ShardWriteFailed, match=r"step 4 were not written on rank\(s\) 0") as raised:
        session.finish_shards()
    assert raised.value.hint and raised.value.exit_code == 1
    assert ckpt.list_checkpoints(session.checkpoint_dir) == []
    assert session.shards is None, "a failed checkpoint is no longer in flight (the failure path does not meet it)"


def test_a_failing_segment_waits_for_its_own_write_only_and_writes_no_pt(tmp_path: Path,
                                                                          capfd: pytest.CaptureFixture[str]) -> None:
    session = _session(tmp_path)
    done: Future[None] = Future()
    done.set_result(None)
    session.save_after_shards(_state(4), 4, done)
    assert session.finish_shards(failed=True) is None  # peers may be dead: no agreement, no .pt
    assert ckpt.list_checkpoints(session.checkpoint_dir) == []
    never: Future[None] = Future()  # a write that hangs: the failing rank waits at most timeout_s
    session.save_after_shards(_state(6), 6, never)
    assert session.finish_shards(failed=True, timeout_s=0.05) is None  # returns (a hang would meet pytest's timeout)
    assert "the sharded checkpoint of step 6 was not completed (still writing after 0.05 s)" in capfd.readouterr().err
