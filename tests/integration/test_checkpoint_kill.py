"""Checkpoints under a real SIGKILL: a writer killed mid-write leaves the previous checkpoint loadable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from cyclone_kit.runtime import checkpoint as ck
from tests.helpers.slow_parts import hold_files, slow_parts_env


def test_sigkill_while_writing_leaves_the_previous_checkpoint_loadable(tmp_path: Path) -> None:
    """A process killed mid-write (SIGKILL) never leaves a half checkpoint under a real name.

    The moment is made, not hoped for (issue 27; :mod:`tests.helpers.slow_parts`): the second
    checkpoint's temporary file is held before its fsync (``hold_write=2``) and the kill lands while it
    is held, whatever the speed of the machine and its disk."""
    ckpts = tmp_path / "ckpts"
    holds = hold_files(tmp_path / "slow")
    env = {**os.environ, **slow_parts_env(tmp_path / "slow", hold_write=2)}
    script = textwrap.dedent(f"""
        import torch, sys
        from cyclone_kit.runtime import checkpoint as ck
        ck.save_checkpoint({str(ckpts)!r}, {{"model": {{"w": torch.zeros(2)}}, "step": 1}}, 1, keep=5)
        print("ready", flush=True)
        big = {{"model": {{"w": torch.randn(16, 1024, 1024)}}, "step": 2}}  # 64 MB
        ck.save_checkpoint({str(ckpts)!r}, big, 2, keep=5)  # held before its fsync until the kill
        print("the held write was never killed", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 120  # a hang guard: the loop ends on the held write (an event)
        while not holds.writing() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert holds.writing(), "the second write was never held"
        tmp = list(ckpts.glob(".ckpt-*.tmp"))
        assert [p.name for p in tmp] == [Path(line).name for line in (holds.folder / "writing").read_text().split()]
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert list(ckpts.glob(".ckpt-*.tmp")) == tmp, "killed mid-write: the temporary file is left, not renamed"
    state, _path = ck.load_latest(ckpts)
    assert state["step"] == 1, "the checkpoint before the killed write is the newest"
    for _, p in ck.list_checkpoints(ckpts):  # every file under a real name loads
        ck.load_checkpoint(p)
