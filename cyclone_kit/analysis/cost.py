"""What scaling costs: device-hours and energy per run, and the cost of each point.

Per run (columns added to ``runs.csv``, see :data:`USAGE_COLUMNS`):

* ``device_hours`` = allocated devices x elapsed hours. With Slurm accounting (``sacct``), the
  elapsed time of every allocation of the run's job (a requeued job has several) and its
  allocated GPUs (``gres/gpu`` in AllocTRES; the run's world size when the cluster does not
  track GPUs, or for CPU runs, where each rank stands for one device): source ``sacct``.
  Without accounting: world size x the wall time the run's end records give (the training
  segments, without start-up or queue time): source ``records``.
* ``energy_j``: sacct's ConsumedEnergy when it is non-zero (source ``sacct``), else the sum of
  the ranks' NVML energy from their summaries when every rank has one (source ``nvml``), else
  empty (``not measured``). ``joules_per_sample`` divides it by the samples processed
  (steps x global batch).

Per point of a study, the cost of scaling is relative to N0: ``relative_cost`` = device-hours
per sample at N / the same at N0 = p / S(N) = 1 / efficiency.

:func:`usage_table` and :func:`cost_points` are pure; :func:`query_sacct` runs ``sacct``.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta

import pandas as pd

from cyclone_kit.core.errors import CycloneError
from cyclone_kit.slurm.accounting import (
    JobUsage,
    accounting_disabled,
    parse_sacct_usage,
    sacct_usage_argv,
)

#: Columns :func:`usage_table` adds to the runs table.
USAGE_COLUMNS = (
    "devices",
    "elapsed_s",
    "device_hours",
    "device_hours_source",
    "energy_j",
    "energy_source",
    "joules_per_sample",
)

#: Slack when matching a run's record times to a sacct allocation (clock skew, start-up).
MATCH_SLACK = timedelta(seconds=120)

Accounting = Mapping[str, Sequence[JobUsage]]


def _time(text: object) -> datetime | None:
    """An ISO time as an aware datetime (naive times, as sacct prints them, are local time)."""
    if text is None or (not isinstance(text, str)) or not text.strip():
        return None
    try:
        value = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        return None
    return value if value.tzinfo is not None else value.astimezone()


def matching_allocations(run: Mapping[str, object], accounting: Accounting) -> list[JobUsage]:
    """The sacct allocations of ``run``'s Slurm job that overlap the run's record times.

    Matching on time as well as on the id keeps a synthetic run, a local run's fake id, or a
    reused id on another cluster from borrowing a real job's figures.
    """
    job_id = run.get("slurm_job_id")
    if job_id is None or pd.isna(job_id):
        return []
    first, last = _time(run.get("start_time")), _time(run.get("end_time"))
    if first is None:
        return []
    last = last or first
    out = []
    for usage in accounting.get(str(job_id), ()):
        start, end = _time(usage.start), _time(usage.end)
        if start is None:
            continue
        if start - MATCH_SLACK <= last and (end is None or end + MATCH_SLACK >= first):
            out.append(usage)
    return out


def usage_table(runs: pd.DataFrame, ranks: pd.DataFrame, accounting: Accounting | None = None) -> pd.DataFrame:
    """Device-hours and energy of each run (pure).

    Args:
        runs: the runs table.
        ranks: the ranks table (``run_dir``, and ``energy_j`` when the ranks measured it).
        accounting: sacct allocations by job id (see :func:`query_sacct`), or None.

    Returns:
        The runs' index with :data:`USAGE_COLUMNS`.
    """
    accounting = accounting or {}
    energy_by_run: dict[str, float] = {}
    if not ranks.empty and "energy_j" in ranks:
        for run_dir, group in ranks.groupby("run_dir", sort=False):
            values = pd.to_numeric(group["energy_j"], errors="coerce")
            if len(values) and values.notna().all() and (values > 0).all():
                energy_by_run[str(run_dir)] = float(values.sum())
    rows = []
    for _, run in runs.iterrows():
        world = run["world_size"]
        world = int(world) if pd.notna(world) else None
        allocations = matching_allocations(run.to_dict(), accounting)
        devices, elapsed, hours, source = math.nan, math.nan, math.nan, ""
        if allocations and world:
            gpus = max(a.gpus for a in allocations)
            devices = gpus or world
            elapsed = float(sum(a.elapsed_s for a in allocations))
            hours = sum((a.gpus or world) * a.elapsed_s for a in allocations) / 3600.0
            source = "sacct"
        elif world and pd.notna(run["wall_time_s"]):
            devices, elapsed = world, float(run["wall_time_s"])
            hours, source = world * elapsed / 3600.0, "records"
        energy, energy_source = math.nan, "not measured"
        sacct_energy = [a.energy_j for a in allocations if a.energy_j]
        if sacct_energy:
            energy, energy_source = float(sum(sacct_energy)), "sacct"
        elif str(run["run_dir"]) in energy_by_run:
            energy, energy_source = energy_by_run[str(run["run_dir"])], "nvml"
        samples = math.nan
        if pd.notna(run["steps"]) and pd.notna(run["global_batch_size"]):
            samples = float(run["steps"]) * float(run["global_batch_size"])
        per_sample = energy / samples if samples > 0 and not math.isnan(energy) else math.nan
        rows.append((devices, elapsed, hours, source, energy, energy_source, per_sample))
    out = pd.DataFrame(rows, columns=list(USAGE_COLUMNS), index=runs.index)
    out["devices"] = out["devices"].astype("Int64") if not out.empty else out["devices"]
    return out


def cost_points(table: pd.DataFrame, runs: pd.DataFrame, usage: pd.DataFrame) -> pd.DataFrame:
    """The cost of each point of the scaling table, relative to N0 (pure).

    Returns:
        Columns study, strategy, world_size, speedup, device_hours_per_1m_samples,
        relative_cost (p / S), joules_per_sample (median over the point's complete runs, nan
        when not measured).
    """
    columns = ["study", "strategy", "world_size", "speedup", "device_hours_per_1m_samples", "relative_cost",
               "joules_per_sample"]
    if table.empty:
        return pd.DataFrame(columns=columns)
    out = table[["study", "strategy", "world_size", "speedup", "device_hours_per_1m_samples"]].copy()
    base = out.groupby(["study", "strategy"], sort=False)["world_size"].transform("min")
    out["relative_cost"] = (out["world_size"] / base) / out["speedup"]
    joined = runs[runs["complete"].astype(bool)].join(usage[["joules_per_sample"]])
    per_point = joined.groupby(["study", "strategy", "world_size"])["joules_per_sample"].median()
    out["joules_per_sample"] = [
        float(per_point.get((s, g, n), math.nan))
        for s, g, n in zip(out["study"], out["strategy"], out["world_size"], strict=True)
    ]
    return out[columns].reset_index(drop=True)


def query_sacct(job_ids: Sequence[object], *, timeout: float = 10) -> tuple[dict[str, list[JobUsage]], str]:
    """Ask ``sacct`` for the allocations of ``job_ids``.

    Returns:
        (allocations by job id, a note): the note says why nothing came back ("" on success),
        e.g. "Slurm accounting storage is disabled".
    """
    from cyclone_kit.core.proc import run_command
    from cyclone_kit.slurm.argv import check_job_id

    ids = []
    for job_id in job_ids:
        if job_id is None or pd.isna(job_id):
            continue
        try:
            ids.append(check_job_id(str(job_id)))
        except CycloneError:
            continue
    ids = list(dict.fromkeys(ids))
    if not ids:
        return {}, "the runs name no Slurm job"
    if shutil.which("sacct") is None:
        return {}, "not installed here"
    try:
        result = run_command(sacct_usage_argv(ids), timeout=timeout, check=False)
    except CycloneError as exc:
        return {}, f"it did not answer ({str(exc).splitlines()[0]})"
    if not result.ok:
        if accounting_disabled(result.stderr + result.stdout):
            return {}, "Slurm accounting storage is disabled"  # no slurmdbd on this cluster
        first = (result.stderr.strip().splitlines() or [f"exit {result.returncode}"])[-1]
        return {}, f"it failed ({first.removeprefix('sacct: ')})"
    try:
        usages = parse_sacct_usage(result.stdout)
    except CycloneError as exc:
        return {}, str(exc).splitlines()[0]
    out: dict[str, list[JobUsage]] = {}
    for usage in usages:
        out.setdefault(usage.job_id, []).append(usage)
    return out, ""
