"""The package's one atomic writer (and its first-writer-wins variant) and a forgiving JSON reader.

Every file a run directory holds is written through :func:`write_atomic` (readers never see
half of it) or :func:`write_new` (several ranks race; the first one wins). Stdlib and
core.errors only: the watchdog and the runtime import it without cost. A full disk is reported
as :class:`~cyclone_kit.core.errors.DiskFullError` (naming the path and the bytes needed).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from cyclone_kit.core.errors import DiskFullError

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
    """Write a file via temp file + fsync + rename, so readers never see half of it (mode :data:`FILE_MODE`).

    Raises:
        DiskFullError: the file system is full (an OSError too; the message names the path and the bytes).
    """
    raw = data.encode() if isinstance(data, str) else data
    try:
        with atomic_file(path) as f:
            f.write(raw)
    except OSError as e:
        if not isinstance(e, DiskFullError) and is_disk_full(e):
            raise DiskFullError(disk_full_message("file", Path(path), len(raw), free_bytes(Path(path).parent)),
                                hint="free space on that file system") from None
        raise


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


# --------------------------------------------------------------------------- a full disk
#: errno values that mean "the file system has no room for this write" (full, or over quota).
NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def is_disk_full(exc: BaseException) -> bool:
    """True when ``exc`` or an exception it was raised from says the disk is full or over quota.

    torch.save reports a full disk as ``RuntimeError: [enforce fail at inline_container.cc...]``
    with the OSError chained below it (or only its text), so the whole chain is searched.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in NO_SPACE_ERRNOS:
            return True
        text = str(current)
        if "No space left on device" in text or "Disk quota exceeded" in text:
            return True
        current = current.__cause__ or current.__context__
    return False


def free_bytes(path: Path) -> int | None:
    """Bytes an unprivileged writer may still use on the file system of ``path`` (None when unknown)."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        st = os.statvfs(probe)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def size_text(n: int | None) -> str:
    """``12.3 MiB``: a byte count for people (pure)."""
    if n is None:
        return "an unknown amount"
    value = float(n)
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} bytes" if unit == "bytes" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} bytes"  # not reached


def disk_full_message(what: str, path: Path, needed: int | None, free: int | None) -> str:
    """``no space left on the device writing <what> <path>: it needs 1.2 MiB, 0 bytes free there`` (pure)."""
    return (f"no space left on the device writing {what} {path}: it needs {size_text(needed)}, "
            f"{size_text(free)} free there")


def append_line(fd: int, line: bytes) -> None:
    """Append one whole line to the file open (O_APPEND) as ``fd``, or nothing of it.

    A short write (the disk filled up in the middle) is cut off again, so readers never see a
    torn line; then the OSError (ENOSPC) is raised.
    """
    start = os.lseek(fd, 0, os.SEEK_END)
    try:
        written = os.write(fd, line)
        while written < len(line):
            more = os.write(fd, line[written:])
            if more == 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            written += more
    except OSError:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, start)
        raise
