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


def test_sigkill_while_writing_leaves_the_previous_checkpoint_loadable(tmp_path: Path) -> None:
    """A process killed mid-write (SIGKILL) never leaves a half checkpoint under a real name."""
    script = textwrap.dedent(f"""
        import torch, sys
        from cyclone_kit.runtime import checkpoint as ck
        ck.save_checkpoint({str(tmp_path)!r}, {{"model": {{"w": torch.zeros(2)}}, "step": 1}}, 1, keep=5)
        print("ready", flush=True)
        big = {{"model": {{"w": torch.randn(16, 1024, 1024)}}, "step": 2}}  # 64 MB: slow to write
        step = 2
        while True:  # until the test kills it: any number of writes, however fast they are
            ck.save_checkpoint({str(tmp_path)!r}, {{**big, "step": step}}, step, keep=5)
            step += 1
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 120  # a hang guard: the loop ends on the temporary file (an event)
        while not list(tmp_path.glob(".ckpt-*.tmp")) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert list(tmp_path.glob(".ckpt-*.tmp")), "the writer never started a temporary file"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    state, _path = ck.load_latest(tmp_path)
    assert state["step"] >= 1
    for _, p in ck.list_checkpoints(tmp_path):  # every file under a real name loads
        ck.load_checkpoint(p)
