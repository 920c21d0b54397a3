"""The runtime's writer of the metrics contract (:mod:`cyclone_kit.rundir.contract`, schema 1).

The records, their fields, the file names and the schema version are defined in
:mod:`cyclone_kit.rundir.contract` (re-exported here for the engines: ``mx.step_record`` ...);
:class:`MetricsWriter` is the only code that appends to ``metrics.jsonl``, one line a record,
flushed per line (a crash loses at most the line being written). Error records belong to
:mod:`cyclone_kit.rundir.failures` (``write_error_record`` is re-exported here).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, TextIO

from cyclone_kit.rundir.contract import (
    METRICS_FILE,
    SCHEMA,
    STATUSES,
    cpu_set_text,
    end_record,
    epoch_record,
    rank_summary,
    record,
    steady_state,
    step_record,
    utc_now,
)
from cyclone_kit.rundir.failures import write_error_record
from cyclone_kit.rundir.fileio import write_atomic
from cyclone_kit.rundir.layout import RunDir

__all__ = [
    "METRICS_FILE", "SCHEMA", "STATUSES", "MetricsWriter", "end_record", "epoch_record", "git_commit", "record",
    "steady_state", "step_record", "utc_now", "write_error_record", "write_rank_summary",
]


def git_commit(directory: str | Path) -> str | None:
    """``git rev-parse HEAD`` of ``directory`` when it is in a git work tree, else None."""
    try:
        out = subprocess.run(["git", "-C", str(directory), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    sha = out.stdout.strip()
    return sha if out.returncode == 0 and len(sha) >= 7 else None


class MetricsWriter:
    """Appends records to ``metrics.jsonl``, one line each, flushed per line.

    Use on rank 0 only. ``None`` as path makes a writer that discards records (other ranks).
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._file: TextIO | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
            self._fix_partial_line()

    def _fix_partial_line(self) -> None:
        """Start on a fresh line when a crash left the file without its final newline."""
        assert self.path is not None and self._file is not None
        size = self.path.stat().st_size
        if size:
            with open(self.path, "rb") as f:
                f.seek(size - 1)
                if f.read(1) != b"\n":
                    self._file.write("\n")
                    self._file.flush()

    def write(self, rec: dict[str, Any]) -> None:
        """Write one record as one line and flush it."""
        if self._file is None:
            return
        rec = {k: _finite(v) for k, v in rec.items()}
        self._file.write(json.dumps(rec, separators=(",", ":"), allow_nan=False, default=_jsonable) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None


def write_rank_summary(run_dir: Path, rank: int, host: str, device: str, samples_per_s: float | None,
                       peak_memory_bytes: int | None, energy_j: float | None = None) -> Path:
    """Write ``ranks/rank-<rank:05d>.json`` atomically; returns its path.

    ``energy_j``: the rank's GPU energy from NVML (:mod:`cyclone_kit.runtime.power`); left out when not measured.
    """
    path = RunDir(run_dir).rank_summary(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    summary = rank_summary(rank, host, device, samples_per_s, peak_memory_bytes, energy_j=energy_j, cpu=cpu_facts())
    write_atomic(path, json.dumps(summary) + "\n")
    return path


def cpu_facts() -> dict[str, Any]:
    """The cores this process may run on (its affinity), the machine's boot id and torch's threads (what is known)."""
    facts: dict[str, Any] = {}
    with contextlib.suppress(AttributeError, OSError):
        cpus = os.sched_getaffinity(0)
        facts.update(cpu_cores=len(cpus), cpu_set=cpu_set_text(sorted(cpus)))
    with contextlib.suppress(OSError):
        facts["machine_id"] = Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    torch = sys.modules.get("torch")  # the rank's compute threads, where torch runs in this process
    if torch is not None and hasattr(torch, "get_num_threads"):
        facts["threads"] = int(torch.get_num_threads())
    return facts


def _finite(value: Any) -> Any:
    """NaN and infinities become null (JSON has no NaN; a diverged loss must not crash the writer)."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple | set):
        return list(value)
    return str(value)
