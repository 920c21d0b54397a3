"""Run directories: created whole or not at all.

A run directory is assembled under a hidden temporary name next to its final place and
renamed into place in one step; renaming onto an existing, non-empty directory fails, so two
``submit`` calls in the same second each get their own directory (``-2``, ``-3`` ...).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from cyclone_kit.errors import ValidationError


def run_dir_name(name: str, when: float | None = None) -> str:
    """``<name>-<YYYYmmdd-HHMMSS>`` in UTC (pure given ``when``)."""
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime(time.time() if when is None else when))}"


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write a file via temp file + fsync + rename, so readers never see half of it."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def create_run_dir(runs_dir: Path, name: str, files: Mapping[str, str | bytes], when: float | None = None) -> Path:
    """Create ``runs_dir/<name>-<stamp>[-k]/`` holding ``files`` plus an empty ``logs/``.

    Raises:
        ValidationError: ``runs_dir`` cannot be created or written.
    """
    runs_dir = Path(runs_dir)
    try:
        runs_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=runs_dir))
    except OSError as e:
        raise ValidationError(
            f"cannot create a run directory in {str(runs_dir)!r}: {e.strerror}",
            hint="pass --runs-dir with a writable directory",
        ) from None
    try:
        (tmp / "logs").mkdir()
        for rel, data in files.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            write_atomic(tmp / rel, data)
        os.chmod(tmp, 0o755)
        base = run_dir_name(name, when)
        for k in range(1, 1000):
            target = runs_dir / (base if k == 1 else f"{base}-{k}")
            try:
                os.rename(tmp, target)
                return target
            except OSError:
                if not target.exists():
                    raise
        raise ValidationError(f"too many runs named {base!r}", hint="use --name to pick another job name")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_run_dir(path: Path) -> None:
    """Remove a run directory that never got going (submission failed)."""
    shutil.rmtree(path, ignore_errors=True)
