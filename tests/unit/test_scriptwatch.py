"""cyclone_kit.runtime.watchers.scriptsteps's plumbing with real torch optimizers: armed, it counts every
optimizer step through torch's global hook and writes this rank's progress record; stopped (or
handed over to ck's watchdog) it removes the hook and marks the record ended. The stall itself
runs in real ranks in tests/integration/test_stall.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from cyclone_kit.runtime import importhook
from cyclone_kit.runtime.watchers import scriptsteps

torch = pytest.importorskip("torch")


@pytest.fixture
def armed(tmp_path: Path):
    env = SimpleNamespace(rank=0, world_size=1, host="c1", restart_count=0)
    cc = SimpleNamespace(stall_floor_s=60.0, stall_factor=20.0, requeue=False, max_requeues=0)
    ended: list[str] = []
    yield scriptsteps.arm(tmp_path, env, cc, {"SLURM_JOB_ID": "7"}, ended.append), tmp_path
    scriptsteps.stop()
    scriptsteps._STATE = None
    importhook._HOOKS.pop("torch.optim.optimizer", None)


def _steps(n: int) -> None:
    w = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([w], lr=0.1)
    for _ in range(n):
        w.sum().backward()
        opt.step()
        opt.zero_grad()


def test_every_optimizer_step_is_a_beat_until_stopped(armed) -> None:
    ok, run_dir = armed
    assert ok and scriptsteps._STATE is not None and scriptsteps._STATE.hook is not None
    _steps(4)
    assert scriptsteps._STATE.steps == 4 and scriptsteps._STATE.watch.step == 4
    scriptsteps.stop()
    _steps(2)  # the hook is gone
    assert scriptsteps._STATE.steps == 4
    record = json.loads((run_dir / "progress" / "rank-00000.json").read_text())
    assert (record["state"], record["step"], record["segment"], record["floor_s"]) == ("ended", 4, "7:0", 60.0)


def test_hand_over_before_the_first_step_leaves_no_record(armed) -> None:
    _, run_dir = armed
    scriptsteps.hand_over()  # ck.log_step's watchdog watches from here
    _steps(3)
    assert scriptsteps._STATE.steps == 0 and not (run_dir / "progress").exists()


def test_a_watchdog_turned_off_is_not_armed(tmp_path: Path) -> None:
    cc = SimpleNamespace(stall_floor_s=0.0, stall_factor=20.0)
    assert scriptsteps.arm(tmp_path, SimpleNamespace(rank=0), cc, {}, print) is False
