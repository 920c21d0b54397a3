"""The metrics contract (schema 1): ``RUN_DIR/metrics.jsonl`` and ``RUN_DIR/ranks/rank-NNNNN.json``.

One JSON object a line, each with ``"kind"`` and ``"schema": 1``, written by rank 0 and flushed
per line (a crash loses at most the line being written):

* ``start``: run_id, world_size, num_nodes, local_world_size, per_device_batch_size,
  global_batch_size, model, dataset, precision, strategy, launcher, device, device_name,
  hostnames, slurm_job_id, time, versions {torch, torchvision, cyclone_kit}, git_commit,
  restart_count.
* ``step`` (every ``train.log_every`` steps): step, epoch, loss, step_time_s, data_time_s,
  samples_per_s (global), time.
* ``epoch``: epoch, val_accuracy (or null), epoch_time_s.
* ``end``: status (completed/preempted/failed), steps, samples_per_s (global steady state:
  median over the logged windows after warm-up), wall_time_s, time.

A requeued or resumed run appends another start ... end segment. Record builders are pure;
:class:`MetricsWriter` is the only code that touches the file.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import statistics
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from cyclone_kit.rundir import write_atomic

SCHEMA = 1
METRICS_FILE = "metrics.jsonl"
STATUSES = ("completed", "preempted", "failed")


def utc_now() -> str:
    """The current time as ISO-8601 UTC with milliseconds (``2026-01-31T12:00:00.000+00:00``)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


def record(kind: str, **fields: Any) -> dict[str, Any]:
    """A metrics record: ``kind`` and ``schema`` first, then the fields (pure)."""
    return {"kind": kind, "schema": SCHEMA, **fields}


def step_record(step: int, epoch: int, loss: float, step_time_s: float, data_time_s: float,
                samples_per_s: float, time: str) -> dict[str, Any]:
    """A ``step`` record (pure)."""
    return record("step", step=step, epoch=epoch, loss=loss, step_time_s=step_time_s, data_time_s=data_time_s,
                  samples_per_s=samples_per_s, time=time)


def epoch_record(epoch: int, val_accuracy: float | None, epoch_time_s: float, time: str) -> dict[str, Any]:
    """An ``epoch`` record (pure)."""
    return record("epoch", epoch=epoch, val_accuracy=val_accuracy, epoch_time_s=epoch_time_s, time=time)


def end_record(status: str, steps: int, samples_per_s: float | None, wall_time_s: float, time: str) -> dict[str, Any]:
    """An ``end`` record (pure); ``status`` is one of :data:`STATUSES`."""
    if status not in STATUSES:
        raise ValueError(f"unknown end status {status!r}")
    return record("end", status=status, steps=steps, samples_per_s=samples_per_s, wall_time_s=wall_time_s,
                  time=time)


def steady_state(window_rates: Sequence[float], warmup_windows: int = 1) -> float | None:
    """Median of the logged windows' samples/s after the first ``warmup_windows`` (pure).

    With too few windows the warm-up ones are kept rather than returning nothing; None when
    there is no window at all.
    """
    rates = [r for r in window_rates if r > 0]
    if not rates:
        return None
    steady = rates[warmup_windows:] if len(rates) > warmup_windows else rates
    return float(statistics.median(steady))


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
    folder = Path(run_dir) / "ranks"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank-{rank:05d}.json"
    data = {"rank": rank, "host": host, "device": device, "samples_per_s": samples_per_s,
            "peak_memory_bytes": peak_memory_bytes}
    if energy_j is not None:
        data["energy_j"] = energy_j
    write_atomic(path, json.dumps(data) + "\n")
    return path


def write_error_record(run_dir: Path, rank: int, host: str, exc: BaseException, traceback_text: str) -> Path:
    """Write ``ranks/error-rank-<rank:05d>.json`` (rank, host, type, message, traceback, time, pid)."""
    folder = Path(run_dir) / "ranks"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"error-rank-{rank:05d}.json"
    data = {"rank": rank, "host": host, "type": type(exc).__name__, "message": str(exc),
            "traceback": traceback_text, "time": utc_now(), "pid": os.getpid()}
    write_atomic(path, json.dumps(data, indent=1) + "\n")
    return path


def _finite(value: Any) -> Any:
    """NaN and infinities become null (JSON has no NaN; a diverged loss must not crash the writer)."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple | set):
        return list(value)
    return str(value)
