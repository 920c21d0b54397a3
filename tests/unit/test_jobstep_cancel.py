"""The step watcher's cancel rule (runtime/watchers/jobstep._run_step) around a stall that is taken back.

A rank's watchdog may record ``stalled`` and then take it back: it made a step while it settled
(d7a8dd7). The step watcher, which cancels the step GRACE_S after it saw a failure, must forget a
failure that is no longer there. The step here is a stand-in for srun whose every wait between two looks
of the watcher moves the rank on by one event (its progress record: stalled, then running again, then
the step's end), and the watcher's clock moves past GRACE_S at every reading: no verdict depends on how
fast anything runs.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

from cyclone_kit.rundir import failures
from cyclone_kit.rundir.layout import RunDir
from cyclone_kit.runtime.watchers import jobstep as sw


class _Clock:
    """A clock that moves 2 x GRACE_S at every reading: each look of the watcher is past its grace."""

    def __init__(self) -> None:
        self.now = time.time()

    def time(self) -> float:
        self.now += 2 * sw.GRACE_S
        return self.now


class _Step:
    """srun's stand-in: each wait writes the next state of rank 0's progress record; the last one ends it."""

    def __init__(self, record: Path, segment: str, states: list[str | int]) -> None:
        self.record, self.segment, self.states = record, segment, list(states)
        self.killed = False

    def wait(self, timeout: float | None = None) -> int:
        state = self.states.pop(0)
        if isinstance(state, int):
            return state
        self.record.write_text(json.dumps({"rank": 0, "segment": self.segment, "state": state, "host": "c1",
                                           "step": 3}))
        raise subprocess.TimeoutExpired("srun", timeout or 0)

    def kill(self) -> None:
        self.killed = True


def _watch(tmp_path: Path, monkeypatch: Any, states: list[str | int]) -> tuple[Any, list[str], list[bool]]:
    run_dir = tmp_path / "run"
    rd = RunDir(run_dir)
    rd.progress.mkdir(parents=True)
    env = {"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "0"}
    step = _Step(rd.progress_record(0), failures.segment_id(env), states)
    cancelled: list[str] = []
    looks: list[bool] = []
    real_view = sw.segment_view

    def view(*args: Any, **kwargs: Any) -> sw.SegmentView:
        seen = real_view(*args, **kwargs)
        looks.append(seen.failed)
        return seen

    monkeypatch.setattr(sw, "segment_view", view)
    monkeypatch.setattr(sw, "cancel_steps", lambda job: cancelled.append(job) or [f"{job}.0"])
    monkeypatch.setattr(sw, "time", _Clock())
    monkeypatch.setattr(sw.subprocess, "Popen", lambda argv, env=None: step)
    end = sw._run_step(["srun", "rank"], dict(env), run_dir, "7", None, lambda pair: None, poll_s=0.0)
    return end, cancelled, looks


def test_a_stall_taken_back_before_the_grace_ends_cancels_no_step(tmp_path: Path, monkeypatch: Any) -> None:
    end, cancelled, looks = _watch(tmp_path, monkeypatch, ["stalled", "running", "running", 0])
    assert looks[:3] == [True, False, False], looks  # the watcher saw the stall, then saw it taken back
    assert cancelled == [], "the watcher cancelled the step of a rank that took its stall back"
    assert (end.code, end.terminated, end.cause) == (0, False, None), end


def test_a_stall_that_stays_is_cancelled_after_the_grace(tmp_path: Path, monkeypatch: Any) -> None:
    end, cancelled, looks = _watch(tmp_path, monkeypatch, ["stalled", "stalled", 1])
    assert looks[:2] == [True, True], looks
    assert cancelled == ["7"], "a stall that stays ends the step after GRACE_S"
    assert end.code == 1 and not end.terminated, end
