"""A small real file system for disk-full tests: a tmpfs of a given size, mounted and removed again."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_disk(mount_point: Path, size_kib: int) -> Iterator[Path]:
    """Mount a ``size_kib`` KiB tmpfs on ``mount_point`` for the block (skips when mounting is not permitted)."""
    mount_point.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None:
        pytest.skip("no mount command here: the full-disk tests need a tmpfs")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(mount_point)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {done.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], capture_output=True, check=False)


def fill(path: Path, leave_bytes: int = 0) -> Path:
    """Fill the file system of ``path`` with a file ``path/filler`` until at most ``leave_bytes`` are free."""
    filler = path / "filler"
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    with open(filler, "ab") as f:
        try:
            f.write(b"\0" * max(free - leave_bytes, 0))
            f.flush()
        except OSError:
            pass
    return filler
