"""The unit tier starts no process: pure functions, parsers and renderers only.

Tests that start a process (a CLI in a fresh interpreter, ``bash -n``, ranks) belong in
tests/integration or tests/slurm; here every way to start one fails the test at once. One
exception, not the test's own doing: importing torch runs ``ldconfig -p`` once to find the
CUDA libraries (cuda.pathfinder), so whichever unit test imports torch first would fail by
the order the tests run in. That library lookup is let through.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

HINT = "tests/unit starts no process: move this test to tests/integration (or tests/slurm)"
#: Programs that imports themselves run (never a test's own process): torch's CUDA library lookup.
IMPORT_TIME_PROGRAMS = frozenset({"ldconfig"})
_EXECUTE_CHILD = subprocess.Popen._execute_child  # type: ignore[attr-defined]


def _refuse(*_args: object, **_kwargs: object) -> None:
    raise AssertionError(HINT)


def _execute_child(self: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> Any:
    argv = [args] if isinstance(args, str | bytes | os.PathLike) else list(args)
    if argv and Path(os.fsdecode(argv[0])).name in IMPORT_TIME_PROGRAMS:
        return _EXECUTE_CHILD(self, args, *rest, **kwargs)
    raise AssertionError(f"{HINT} (it ran {argv[:3]})")


@pytest.fixture(autouse=True)
def no_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail any attempt to start a process (subprocess, os.fork, posix_spawn, os.system)."""
    monkeypatch.setattr(subprocess.Popen, "_execute_child", _execute_child)
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "execv", "execve"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, _refuse)
