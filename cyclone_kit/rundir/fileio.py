"""The package's one atomic writer (and its first-writer-wins variant) and a forgiving JSON reader.

Every file a run directory holds is written through :func:`write_atomic` (readers never see
half of it) or :func:`write_new` (several ranks race; the first one wins). Stdlib only: the
watchdog and the runtime import it without cost.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

#: The one mode of every file the package writes: read-write for the owner, readable by the group
#: and others (teammates in a shared project directory read each other's runs), as a plain
#: ``open()`` under the usual umask 022 gives. mkstemp's private 0600 is never kept.
FILE_MODE = 0o644


@contextlib.contextmanager
def atomic_file(path: Path, *, fsync_dir: bool = False) -> Iterator[IO[bytes]]:
    """A binary file that becomes ``path`` only when the block ends without an error.

    Written to a temporary file in the same directory (mode :data:`FILE_MODE`), flushed, fsync'ed
    and renamed into place; on any error the temporary file is removed and ``path`` is untouched.
    ``fsync_dir`` also fsyncs the directory, so the rename survives a crash of the node.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if fsync_dir:
        with contextlib.suppress(OSError):  # some file systems refuse to fsync a directory
            dir_fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write a file via temp file + fsync + rename, so readers never see half of it (mode :data:`FILE_MODE`)."""
    with atomic_file(path) as f:
        f.write(data.encode() if isinstance(data, str) else data)


def write_new(path: Path, data: str) -> bool:
    """Create ``path`` with ``data`` unless it exists (the first writer wins); True when written."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            os.fchmod(f.fileno(), FILE_MODE)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, path)  # atomic, and fails when the file already exists
        return True
    except FileExistsError:
        return False
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def read_json(path: Path) -> Any:
    """The JSON document in ``path``, or None when it is missing or not JSON."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
