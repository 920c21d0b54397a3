"""The metrics contract (schema 1): the one definition the runtime writes and the analysis reads.

Torch-free and pandas-free: :mod:`cyclone_kit.runtime.metrics` (the writer),
:mod:`cyclone_kit.analysis.ingest` (the reader) and :mod:`cyclone_kit.analysis.synthetic` (the
generator of synthetic studies) all build or read records through this module.

Files (inside a run directory, see :class:`cyclone_kit.rundir.layout.RunDir`):

* :data:`METRICS_FILE` (``metrics.jsonl``): one JSON object a line, each with ``"kind"`` and
  ``"schema": 1``, written by rank 0 and flushed per line. A requeued or resumed run appends
  another ``start ... end`` segment.
* ``ranks/rank-NNNNN.json`` (:func:`rank_summary_name`): one summary per rank
  (:data:`RANK_SUMMARY_FIELDS`, plus ``energy_j`` on GPU runs that measured it).

Records (the fields every writer must give; a writer may add more):

* ``start`` (:data:`START_FIELDS`): run_id, world_size, num_nodes, local_world_size,
  per_device_batch_size, global_batch_size, model, dataset, precision, strategy, launcher,
  device, device_name, hostnames, slurm_job_id, time, versions {torch, torchvision,
  cyclone_kit}, git_commit, restart_count.
* ``step`` (:data:`STEP_FIELDS`): step, epoch, loss, step_time_s, data_time_s, samples_per_s
  (global), time.
* ``epoch`` (:data:`EPOCH_FIELDS`): epoch, val_accuracy (or null), epoch_time_s, time.
* ``end`` (:data:`END_FIELDS`): status (one of :data:`STATUSES`), steps, samples_per_s (global
  steady state), wall_time_s, time.
"""

from __future__ import annotations

import datetime
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

#: The schema version every record carries.
SCHEMA = 1
#: The metrics file of a run directory.
METRICS_FILE = "metrics.jsonl"
#: The folder of per-rank files in a run directory (summaries here; error records: cyclone_kit.rundir.failures).
RANKS_DIR = "ranks"
#: Glob of the per-rank summaries inside :data:`RANKS_DIR`.
RANK_SUMMARY_GLOB = "rank-*.json"

KINDS = ("start", "step", "epoch", "end")
STATUSES = ("completed", "preempted", "cancelled", "failed")
#: The launchers the runtime records in ``start.launcher`` (see cyclone_kit.runtime.env.detect).
LAUNCHERS = ("slurm", "torchrun", "openmpi", "mpich", "submitit", "single", "local")

START_FIELDS = (
    "run_id", "world_size", "num_nodes", "local_world_size", "per_device_batch_size", "global_batch_size",
    "model", "dataset", "precision", "strategy", "launcher", "device", "device_name", "hostnames",
    "slurm_job_id", "time", "versions", "git_commit", "restart_count",
)
VERSION_FIELDS = ("torch", "torchvision", "cyclone_kit")
STEP_FIELDS = ("step", "epoch", "loss", "step_time_s", "data_time_s", "samples_per_s", "time")
#: Step-record fields of a pipeline run: per pipeline position, the seconds per optimizer step spent
#: computing and idle (bubble, waiting on neighbours) inside the schedule, means over the replicas.
PIPELINE_STEP_FIELDS = ("stage_compute_s", "stage_idle_s")
EPOCH_FIELDS = ("epoch", "val_accuracy", "epoch_time_s", "time")
END_FIELDS = ("status", "steps", "samples_per_s", "wall_time_s", "time")
RANK_SUMMARY_FIELDS = ("rank", "host", "device", "samples_per_s", "peak_memory_bytes")
#: Rank-summary fields written only when measured: the GPU energy in joules (NVML, cyclone_kit.runtime.power).
RANK_SUMMARY_OPTIONAL_FIELDS = ("energy_j",)
#: Rank-summary fields of the cores a rank really had (written when known): ``cpu_cores`` (how many CPUs its
#: affinity allows), ``cpu_set`` (which, as ``0-3,8``), ``machine_id`` (the kernel's boot id: ranks of several
#: Slurm nodes with one machine id share one machine's cores, as on an emulated cluster) and ``threads``
#: (torch's compute threads in the rank).
RANK_SUMMARY_CPU_FIELDS = ("cpu_cores", "cpu_set", "machine_id", "threads")
#: kind -> the fields a record of that kind must carry.
FIELDS: Mapping[str, tuple[str, ...]] = {"start": START_FIELDS, "step": STEP_FIELDS, "epoch": EPOCH_FIELDS,
                                         "end": END_FIELDS}


def rank_summary_name(rank: int) -> str:
    """``rank-00003.json``: the file name of a rank's summary inside :data:`RANKS_DIR` (pure)."""
    return f"rank-{rank:05d}.json"


def utc_now() -> str:
    """The current time as ISO-8601 UTC with milliseconds (``2026-01-31T12:00:00.000+00:00``)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


def record(kind: str, **fields: Any) -> dict[str, Any]:
    """A metrics record: ``kind`` and ``schema`` first, then the fields (pure)."""
    return {"kind": kind, "schema": SCHEMA, **fields}


def start_record(*, run_id: str, world_size: int, num_nodes: int, local_world_size: int,
                 per_device_batch_size: int, global_batch_size: int, model: str, dataset: str, precision: str,
                 strategy: str, launcher: str, device: str, device_name: str | None, hostnames: Sequence[str],
                 slurm_job_id: str | None, time: str, versions: Mapping[str, str | None], git_commit: str | None,
                 restart_count: int, **extra: Any) -> dict[str, Any]:
    """A ``start`` record (pure); ``extra`` fields (grad_accum, lr, threads ...) follow the contract's."""
    return record("start", run_id=run_id, world_size=world_size, num_nodes=num_nodes,
                  local_world_size=local_world_size, per_device_batch_size=per_device_batch_size,
                  global_batch_size=global_batch_size, model=model, dataset=dataset, precision=precision,
                  strategy=strategy, launcher=launcher, device=device, device_name=device_name,
                  hostnames=list(hostnames), slurm_job_id=slurm_job_id, time=time, versions=dict(versions),
                  git_commit=git_commit, restart_count=restart_count, **extra)


def step_record(step: int, epoch: int, loss: float, step_time_s: float, data_time_s: float,
                samples_per_s: float, time: str, **extra: Any) -> dict[str, Any]:
    """A ``step`` record (pure); ``extra`` fields (:data:`PIPELINE_STEP_FIELDS`) follow the contract's."""
    return record("step", step=step, epoch=epoch, loss=loss, step_time_s=step_time_s, data_time_s=data_time_s,
                  samples_per_s=samples_per_s, time=time, **extra)


def pipeline_step_fields(compute_s: Sequence[float], idle_s: Sequence[float]) -> dict[str, list[float]]:
    """The :data:`PIPELINE_STEP_FIELDS` of a step record, one value per pipeline position (pure)."""
    return {"stage_compute_s": [float(c) for c in compute_s], "stage_idle_s": [float(i) for i in idle_s]}


def epoch_record(epoch: int, val_accuracy: float | None, epoch_time_s: float, time: str) -> dict[str, Any]:
    """An ``epoch`` record (pure)."""
    return record("epoch", epoch=epoch, val_accuracy=val_accuracy, epoch_time_s=epoch_time_s, time=time)


def end_record(status: str, steps: int, samples_per_s: float | None, wall_time_s: float, time: str) -> dict[str, Any]:
    """An ``end`` record (pure); ``status`` is one of :data:`STATUSES`."""
    if status not in STATUSES:
        raise ValueError(f"unknown end status {status!r}")
    return record("end", status=status, steps=steps, samples_per_s=samples_per_s, wall_time_s=wall_time_s,
                  time=time)


def rank_summary(rank: int, host: str, device: str, samples_per_s: float | None,
                 peak_memory_bytes: int | None, energy_j: float | None = None,
                 cpu: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A rank's summary (``ranks/rank-NNNNN.json``; pure); ``energy_j`` only when measured.

    ``cpu``: the :data:`RANK_SUMMARY_CPU_FIELDS` the rank found (others are ignored).
    """
    summary = {"rank": rank, "host": host, "device": device, "samples_per_s": samples_per_s,
               "peak_memory_bytes": peak_memory_bytes}
    if energy_j is not None:
        summary["energy_j"] = energy_j
    summary.update({k: v for k, v in dict(cpu or {}).items() if k in RANK_SUMMARY_CPU_FIELDS and v is not None})
    return summary


def cpu_set_text(cpus: Sequence[int]) -> str:
    """``0-3,8``: a CPU set in the kernel's list format (pure)."""
    ids, parts = sorted(set(cpus)), []
    start = prev = None
    for cpu in [*ids, None]:
        if cpu is not None and prev is not None and cpu == prev + 1:
            prev = cpu
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = cpu
    return ",".join(parts)


def cpu_set_ids(text: str) -> set[int]:
    """The CPU ids of ``0-3,8`` (pure; empty for an empty or malformed text)."""
    ids: set[int] = set()
    try:
        for part in filter(None, str(text).split(",")):
            low, _, high = part.partition("-")
            ids.update(range(int(low), int(high or low) + 1))
    except ValueError:
        return set()
    return ids


def missing_fields(rec: Mapping[str, Any]) -> tuple[str, ...]:
    """The contract fields ``rec`` lacks for its kind (empty when it conforms; pure)."""
    required = ("kind", "schema", *FIELDS.get(str(rec.get("kind")), ()))
    return tuple(f for f in required if f not in rec)


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
