"""The unit tier starts no process: pure functions, parsers and renderers only.

Tests that start a process (a CLI in a fresh interpreter, ``bash -n``, ranks) belong in
tests/integration or tests/slurm; here every way to start one fails the test at once.
"""

from __future__ import annotations

import os
import subprocess

import pytest

HINT = "tests/unit starts no process: move this test to tests/integration (or tests/slurm)"


def _refuse(*_args: object, **_kwargs: object) -> None:
    raise AssertionError(HINT)


@pytest.fixture(autouse=True)
def no_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail any attempt to start a process (subprocess, os.fork, posix_spawn, os.system)."""
    monkeypatch.setattr(subprocess.Popen, "_execute_child", _refuse)
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "execv", "execve"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, _refuse)
