"""Scaling maths on DataFrames: aggregation, speed-up, efficiency, Karp-Flatt, law fits.

Everything here is pure: DataFrames and numbers in, new DataFrames and numbers out.

Definitions (per study and strategy; N0 = the smallest world size of that study, the baseline):

* throughput T(N): the median over repeats of the runs' ``samples_per_s`` (global samples/s);
* speed-up S(N) = T(N) / T(N0);
* strong efficiency = S(N) * N0 / N; weak efficiency = (T(N)/N) / (T(N0)/N0). With throughput
  measured in samples/s the two are the same number; the mode decides the wording and which
  law is fitted;
* Karp-Flatt serial fraction e = (1/S - 1/p) / (1 - 1/p), p = N / N0 (empty at the baseline);
* Amdahl's law (strong scaling): S(p) = 1 / (s + (1 - s) / p), fitted by least squares on S;
* Gustafson's law (weak scaling, scaled speed-up): S(p) = p - s (p - 1), fitted in closed form;
* cost: device-hours per million samples = N / T(N) x 10^6 / 3600 (steady-state throughput).

Whether a fitted law or a point can be stood behind is decided in :mod:`cyclone_kit.analysis.honesty`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

#: Columns of the scaling table (``scaling.csv``), in order.
SCALING_COLUMNS = (
    "study",
    "strategy",
    "mode",
    "world_size",
    "num_nodes",
    "per_device_batch_size",
    "global_batch_size",
    "runs",
    "samples_per_s",
    "samples_per_s_min",
    "samples_per_s_max",
    "samples_per_s_per_device",
    "speedup",
    "efficiency",
    "karp_flatt",
    "device_hours_per_1m_samples",
)

#: Columns computed by :func:`add_scaling_metrics` (not by :func:`aggregate_runs`).
_METRIC_COLUMNS = ("speedup", "efficiency", "karp_flatt", "device_hours_per_1m_samples")

MODES = ("strong", "weak", "unknown")
_GROUP = ["study", "strategy"]


def infer_mode(runs: pd.DataFrame) -> str:
    """Return the scaling mode of one study's runs.

    The declared mode (``declared_mode``, from ``sweep.json``) wins when the runs agree on
    one. Otherwise: a constant global batch across at least two world sizes is strong
    scaling; a constant per-device batch is weak scaling; anything else (including a single
    world size) is ``"unknown"``.

    Args:
        runs: runs of one study (columns ``world_size``, ``global_batch_size``,
            ``per_device_batch_size``, optionally ``declared_mode``).
    """
    if "declared_mode" in runs:
        declared = runs["declared_mode"].dropna().unique()
        if len(declared) == 1 and declared[0] in ("strong", "weak"):
            return str(declared[0])
    if runs["world_size"].dropna().nunique() < 2:
        return "unknown"
    global_batch = runs["global_batch_size"].dropna()
    per_device = runs["per_device_batch_size"].dropna()
    if len(global_batch) == len(runs) and global_batch.nunique() == 1:
        return "strong"
    if len(per_device) == len(runs) and per_device.nunique() == 1:
        return "weak"
    return "unknown"


def _first_mode(values: pd.Series) -> object:
    """Most common non-null value of a column (first one on ties), or NA."""
    values = values.dropna()
    if values.empty:
        return pd.NA
    return values.mode().iloc[0]


def aggregate_runs(runs: pd.DataFrame) -> pd.DataFrame:
    """Aggregate complete runs per (study, strategy, world_size): median, min and max throughput.

    Runs with ``complete`` False (or no throughput) are left out. Repeats of a point are the
    runs sharing (study, strategy, world_size).

    Args:
        runs: the runs table (see :mod:`cyclone_kit.analysis.ingest`).

    Returns:
        One row per group with ``mode``, ``num_nodes``, batch sizes (most common value),
        ``runs`` (count), ``samples_per_s`` (median), ``samples_per_s_min``/``_max`` and
        ``samples_per_s_per_device``; sorted by study, strategy and world size.
    """
    keep = runs
    if "complete" in keep:
        keep = keep[keep["complete"].astype(bool)]
    keep = keep[keep["samples_per_s"].notna() & keep["world_size"].notna()]
    columns = [c for c in SCALING_COLUMNS if c not in _METRIC_COLUMNS]
    if keep.empty:
        return pd.DataFrame(columns=columns)
    modes = {key: infer_mode(group) for key, group in keep.groupby(_GROUP, sort=False)}
    grouped = keep.groupby([*_GROUP, "world_size"], sort=True)
    table = grouped.agg(
        num_nodes=("num_nodes", _first_mode),
        per_device_batch_size=("per_device_batch_size", _first_mode),
        global_batch_size=("global_batch_size", _first_mode),
        runs=("samples_per_s", "size"),
        samples_per_s=("samples_per_s", "median"),
        samples_per_s_min=("samples_per_s", "min"),
        samples_per_s_max=("samples_per_s", "max"),
    ).reset_index()
    table["world_size"] = table["world_size"].astype(int)
    table["mode"] = [modes[(s, g)] for s, g in zip(table["study"], table["strategy"], strict=True)]
    table["samples_per_s_per_device"] = table["samples_per_s"] / table["world_size"]
    for column in ("num_nodes", "per_device_batch_size", "global_batch_size"):
        table[column] = table[column].astype("Int64")
    table["runs"] = table["runs"].astype(int)
    return table[columns]


def karp_flatt(speedup: float, p: float) -> float:
    """Experimentally determined serial fraction e = (1/S - 1/p) / (1 - 1/p); nan for p <= 1."""
    if not p > 1 or not speedup > 0:
        return math.nan
    return (1.0 / speedup - 1.0 / p) / (1.0 - 1.0 / p)


def device_hours_per_1m_samples(world_size: float, samples_per_s: float) -> float:
    """Device-hours to process 10^6 samples at ``samples_per_s`` on ``world_size`` devices.

    ``world_size / samples_per_s * 1e6 / 3600``; nan when the throughput is not positive.
    """
    if not samples_per_s > 0:
        return math.nan
    return float(world_size) / float(samples_per_s) * 1e6 / 3600.0


def add_scaling_metrics(table: pd.DataFrame) -> pd.DataFrame:
    """Add ``speedup``, ``efficiency``, ``karp_flatt`` and the cost to an aggregated table.

    The baseline of each (study, strategy) is its smallest world size N0.

    Args:
        table: output of :func:`aggregate_runs`.

    Returns:
        A new table with the four columns, in :data:`SCALING_COLUMNS` order.
    """
    out = table.copy()
    if out.empty:
        for column in _METRIC_COLUMNS:
            out[column] = pd.Series(dtype=float)
        return out[list(SCALING_COLUMNS)]
    grouped = out.groupby(_GROUP, sort=False)
    base_n = grouped["world_size"].transform("min")
    base_t = out["samples_per_s"].where(out["world_size"] == base_n)
    base_t = base_t.groupby([out["study"], out["strategy"]]).transform("max")
    p = out["world_size"] / base_n
    out["speedup"] = out["samples_per_s"] / base_t
    # Strong: S * N0 / N. Weak: (T/N) / (T0/N0). Identical for throughput in samples/s.
    out["efficiency"] = out["speedup"] / p
    out["karp_flatt"] = [karp_flatt(s, q) for s, q in zip(out["speedup"], p, strict=True)]
    out["device_hours_per_1m_samples"] = [
        device_hours_per_1m_samples(n, t) for n, t in zip(out["world_size"], out["samples_per_s"], strict=True)
    ]
    return out[list(SCALING_COLUMNS)].reset_index(drop=True)


def scaling_table(runs: pd.DataFrame) -> pd.DataFrame:
    """The scaling table (``scaling.csv``) of a runs table: aggregate, then add the metrics."""
    return add_scaling_metrics(aggregate_runs(runs))


def amdahl_speedup(p: np.ndarray | float, serial_fraction: float) -> np.ndarray:
    """Amdahl's law: S(p) = 1 / (s + (1 - s) / p)."""
    p = np.asarray(p, dtype=float)
    return 1.0 / (serial_fraction + (1.0 - serial_fraction) / p)


def gustafson_speedup(p: np.ndarray | float, serial_fraction: float) -> np.ndarray:
    """Gustafson's law (scaled speed-up): S(p) = p - s (p - 1)."""
    p = np.asarray(p, dtype=float)
    return p - serial_fraction * (p - 1.0)


@dataclass(frozen=True)
class ScalingFit:
    """A scaling law fitted to one study's measured speed-ups.

    Attributes:
        study: the study name.
        strategy: the strategy (ddp, fsdp, ...).
        law: ``"amdahl"`` or ``"gustafson"``.
        serial_fraction: the fitted s in [0, 1].
        base_world_size: N0, the world size that p = N / N0 is relative to.
        rmse: root-mean-square error of the fit on the speed-ups.
        points: the number of measured points used.
    """

    study: str
    strategy: str
    law: str
    serial_fraction: float
    base_world_size: int
    rmse: float
    points: int

    def predict(self, world_sizes: Sequence[float] | np.ndarray) -> np.ndarray:
        """Predicted speed-up (relative to N0) at the given world sizes."""
        p = np.asarray(world_sizes, dtype=float) / self.base_world_size
        if self.law == "gustafson":
            return gustafson_speedup(p, self.serial_fraction)
        return amdahl_speedup(p, self.serial_fraction)

    @property
    def label(self) -> str:
        """Human label, e.g. ``Amdahl prediction (s = 0.031)``."""
        return f"{self.law.capitalize()} prediction (s = {self.serial_fraction:.3g})"


def fit_amdahl(p: Sequence[float] | np.ndarray, speedup: Sequence[float] | np.ndarray) -> float:
    """Least-squares serial fraction s in [0, 1] of Amdahl's law for speed-ups at p.

    Minimises sum (S_i - 1/(s + (1-s)/p_i))^2 over s: a grid over [0, 1] brackets the
    minimum, golden-section search refines it (no scipy needed).

    Raises:
        ValueError: fewer than one point with p > 1.
    """
    p = np.asarray(p, dtype=float)
    s_measured = np.asarray(speedup, dtype=float)
    mask = np.isfinite(p) & np.isfinite(s_measured) & (p > 1)
    if not mask.any():
        raise ValueError("Amdahl fit needs at least one point with p > 1")
    p, s_measured = p[mask], s_measured[mask]

    def sse(s: np.ndarray) -> np.ndarray:
        model = 1.0 / (s[:, None] + (1.0 - s[:, None]) / p[None, :])
        return ((model - s_measured[None, :]) ** 2).sum(axis=1)

    grid = np.linspace(0.0, 1.0, 1001)
    best = int(np.argmin(sse(grid)))
    lo, hi = grid[max(best - 1, 0)], grid[min(best + 1, len(grid) - 1)]
    ratio = (math.sqrt(5.0) - 1.0) / 2.0
    for _ in range(60):
        a = hi - ratio * (hi - lo)
        b = lo + ratio * (hi - lo)
        if sse(np.array([a]))[0] <= sse(np.array([b]))[0]:
            hi = b
        else:
            lo = a
    candidates = np.array([0.0, 1.0, min(max((lo + hi) / 2.0, 0.0), 1.0)])
    return float(candidates[int(np.argmin(sse(candidates)))])


def fit_gustafson(p: Sequence[float] | np.ndarray, speedup: Sequence[float] | np.ndarray) -> float:
    """Closed-form least-squares serial fraction s in [0, 1] of Gustafson's law.

    S = p - s (p - 1) is linear in s, so s = sum((p - S)(p - 1)) / sum((p - 1)^2), clipped.

    Raises:
        ValueError: fewer than one point with p > 1.
    """
    p = np.asarray(p, dtype=float)
    s_measured = np.asarray(speedup, dtype=float)
    mask = np.isfinite(p) & np.isfinite(s_measured) & (p > 1)
    if not mask.any():
        raise ValueError("Gustafson fit needs at least one point with p > 1")
    x = p[mask] - 1.0
    s = float(((p[mask] - s_measured[mask]) * x).sum() / (x * x).sum())
    return min(max(s, 0.0), 1.0)


def fit_scaling_laws(table: pd.DataFrame) -> list[ScalingFit]:
    """Fit a law to each (study, strategy) of a scaling table with at least two world sizes.

    Strong (and unknown) studies get Amdahl's law; weak studies get Gustafson's, since
    Amdahl's law describes a fixed total problem and a weak study grows the problem with N.

    Args:
        table: output of :func:`scaling_table`.

    Returns:
        One :class:`ScalingFit` per fitted study/strategy, in table order.
    """
    fits = []
    for (study, strategy), group in table.groupby(_GROUP, sort=False):
        group = group.dropna(subset=["speedup"])
        if group["world_size"].nunique() < 2:
            continue
        base = int(group["world_size"].min())
        p = group["world_size"].to_numpy(dtype=float) / base
        measured = group["speedup"].to_numpy(dtype=float)
        mode = str(group["mode"].iloc[0])
        law = "gustafson" if mode == "weak" else "amdahl"
        serial = fit_gustafson(p, measured) if law == "gustafson" else fit_amdahl(p, measured)
        predicted = gustafson_speedup(p, serial) if law == "gustafson" else amdahl_speedup(p, serial)
        rmse = float(np.sqrt(np.mean((predicted - measured) ** 2)))
        fits.append(
            ScalingFit(
                study=str(study),
                strategy=str(strategy),
                law=law,
                serial_fraction=serial,
                base_world_size=base,
                rmse=rmse,
                points=len(group),
            )
        )
    return fits


def compare_to_baselines(table: pd.DataFrame, baselines: pd.DataFrame) -> pd.DataFrame:
    """How many times each baseline's throughput each measured world size delivers.

    Args:
        table: the scaling table.
        baselines: rows with ``name``, ``device``, ``samples_per_s`` (total throughput of that
            baseline) and optionally ``devices`` (how many devices that figure is for).

    Returns:
        One row per (study, strategy, world_size, baseline): ``times`` =
        T(N) / baseline samples/s, and ``times_per_device`` = (T(N)/N) / (baseline per device).
    """
    rows = []
    for _, base in baselines.iterrows():
        base_total = float(base["samples_per_s"])
        devices = base.get("devices")
        devices = float(devices) if devices is not None and pd.notna(devices) and devices > 0 else 1.0
        for _, row in table.iterrows():
            rows.append(
                {
                    "study": row["study"],
                    "strategy": row["strategy"],
                    "world_size": int(row["world_size"]),
                    "baseline": base["name"],
                    "baseline_device": base.get("device"),
                    "baseline_samples_per_s": base_total,
                    "samples_per_s": float(row["samples_per_s"]),
                    "times": float(row["samples_per_s"]) / base_total if base_total > 0 else math.nan,
                    "times_per_device": (
                        float(row["samples_per_s_per_device"]) / (base_total / devices)
                        if base_total > 0
                        else math.nan
                    ),
                }
            )
    columns = [
        "study", "strategy", "world_size", "baseline", "baseline_device",
        "baseline_samples_per_s", "samples_per_s", "times", "times_per_device",
    ]
    return pd.DataFrame(rows, columns=columns)


def step_timing(steps: pd.DataFrame, runs: pd.DataFrame) -> pd.DataFrame:
    """Median step and data-loading time per (study, strategy, world_size), complete runs only.

    A large ``data_share`` (time waiting for the input pipeline over time per step) means the
    run is input-bound: more GPUs will not help until data loading is faster.

    Args:
        steps: the steps table (``run_dir``, ``step_time_s``, ``data_time_s``).
        runs: the runs table (``run_dir``, ``study``, ``strategy``, ``world_size``, ``complete``).

    Returns:
        Columns study, strategy, world_size, step_records, step_time_s (median),
        data_time_s (median), data_share (sum of data time / sum of step time).
    """
    columns = ["study", "strategy", "world_size", "step_records", "step_time_s", "data_time_s", "data_share"]
    keys = runs[runs["complete"].astype(bool)][["run_dir", "study", "strategy", "world_size"]]
    if steps.empty or keys.empty:
        return pd.DataFrame(columns=columns)
    frame = steps[["run_dir", "step_time_s", "data_time_s"]].copy()
    frame["run_dir"] = frame["run_dir"].astype(str)
    frame = frame.merge(keys, on="run_dir", how="inner")
    if frame.empty:
        return pd.DataFrame(columns=columns)
    grouped = frame.groupby(["study", "strategy", "world_size"], sort=True)
    out = grouped.agg(
        step_records=("step_time_s", "size"),
        step_time_s=("step_time_s", "median"),
        data_time_s=("data_time_s", "median"),
        step_sum=("step_time_s", "sum"),
        data_sum=("data_time_s", "sum"),
    ).reset_index()
    out["data_share"] = (out["data_sum"] / out["step_sum"]).where(out["step_sum"] > 0)
    out["world_size"] = out["world_size"].astype(int)
    return out[columns]
