"""Scaling plots: each function takes data, returns a matplotlib Figure, saves only if asked.

Figures are built with the object-oriented API on an Agg canvas (no pyplot state, no
display needed), so they work on a login node, in a batch job and inline in a notebook.
All plots use a log2 x axis (world size N, devices) and one line per study (and strategy).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator, PercentFormatter

from cyclone_kit.analysis.scaling import ScalingFit

PathArg = str | Path | Sequence[str | Path] | None

#: How far the fitted-law prediction extends, as a multiple of the largest measured N.
PREDICTION_FACTOR = 4


def save_figure(fig: Figure, path: PathArg) -> list[Path]:
    """Save ``fig`` to each path given (format from the suffix); nothing when path is None."""
    if path is None:
        return []
    paths = [Path(path)] if isinstance(path, str | Path) else [Path(p) for p in path]
    for target in paths:
        target.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(target, metadata=_metadata(target))
    return paths


def _metadata(target: Path) -> dict[str, str | None]:
    """Reproducible file metadata (no creation date in SVG/PDF)."""
    if target.suffix.lower() in (".svg", ".pdf"):
        return {"Date": None}
    return {}


def _new_figure() -> tuple[Figure, object]:
    """A Figure on an Agg canvas, and its single Axes."""
    fig = Figure(figsize=(6.4, 4.4))
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _freeze_layout(fig: Figure) -> None:
    """Lay the figure out once (constrained), then keep those positions for every save.

    Running the layout engine at each ``savefig`` (PNG and SVG) costs more than drawing.
    """
    fig.set_layout_engine("constrained")
    fig.draw_without_rendering()
    fig.set_layout_engine("none")


def _series(table: pd.DataFrame) -> list[tuple[str, str, str, pd.DataFrame]]:
    """(label, study, strategy, rows sorted by N) for each line to draw."""
    out = []
    if table.empty:
        return out
    strategies_per_study = table.groupby("study")["strategy"].nunique()
    for (study, strategy), group in table.groupby(["study", "strategy"], sort=False):
        label = str(study) if strategies_per_study[study] == 1 else f"{study} ({strategy})"
        out.append((label, str(study), str(strategy), group.sort_values("world_size")))
    return out


def _log2_axis(ax: object, largest: float) -> None:
    """Log2 x axis with integer ticks at the powers of two up to ``largest``."""
    ax.set_xscale("log", base=2)
    top = max(int(np.ceil(np.log2(max(largest, 1.0)))), 1)
    ax.xaxis.set_major_locator(FixedLocator([2.0**k for k in range(0, top + 1)]))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _pos: f"{value:g}"))
    ax.set_xlim(0.8, 2.0**top * 1.25)
    ax.set_xlabel("world size N (devices, log2 scale)")
    ax.grid(True, which="major", alpha=0.3)


def _fit_for(fits: Sequence[ScalingFit] | None, study: str, strategy: str) -> ScalingFit | None:
    """The fit of one study/strategy, if any."""
    for fit in fits or ():
        if fit.study == study and fit.strategy == strategy:
            return fit
    return None


def _prediction_x(fit: ScalingFit, largest: float) -> np.ndarray:
    """World sizes from N0 to PREDICTION_FACTOR x the largest measured N."""
    return np.geomspace(fit.base_world_size, PREDICTION_FACTOR * largest, 64)


def _largest_x(table: pd.DataFrame, fits: Sequence[ScalingFit] | None) -> float:
    """The right end of the x axis."""
    largest = float(table["world_size"].max()) if not table.empty else 1.0
    return largest * (PREDICTION_FACTOR if fits else 1)


def speedup_figure(
    table: pd.DataFrame,
    fits: Sequence[ScalingFit] | None = None,
    path: PathArg = None,
    title: str = "Speed-up",
) -> Figure:
    """Speed-up vs N (log2/log2), with the ideal line and dashed fitted-law predictions.

    Args:
        table: the scaling table (``world_size``, ``speedup``, ``study``, ``strategy``).
        fits: fitted laws (see :func:`cyclone_kit.analysis.scaling.fit_scaling_laws`); each is
            drawn dashed up to 4x the largest measured N and labelled as a prediction.
        path: a file or files to save to (PNG, SVG, ...); None saves nothing.
        title: the axes title.
    """
    fig, ax = _new_figure()
    right = _largest_x(table, fits)
    _log2_axis(ax, right)
    ax.set_yscale("log", base=2)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _pos: f"{value:g}"))
    for base in sorted({int(g["world_size"].min()) for _, _, _, g in _series(table)}):
        xs = np.array([base, right])
        label = "ideal (linear)" if base == 1 else f"ideal (linear from N0 = {base})"
        ax.plot(xs, xs / base, color="black", linestyle=":", linewidth=1, label=label)
    for index, (label, study, strategy, group) in enumerate(_series(table)):
        color = f"C{index % 10}"
        ax.plot(group["world_size"], group["speedup"], marker="o", color=color, label=f"{label} (measured)")
        fit = _fit_for(fits, study, strategy)
        if fit is not None:
            xs = _prediction_x(fit, float(group["world_size"].max()))
            ax.plot(xs, fit.predict(xs), linestyle="--", color=color, alpha=0.8, label=f"{label}: {fit.label}")
    ax.set_ylabel("speed-up S(N) = T(N) / T(N0)  (x, log2 scale)")
    ax.set_title(title)
    ax.legend(fontsize="small")
    _freeze_layout(fig)
    save_figure(fig, path)
    return fig


def efficiency_figure(
    table: pd.DataFrame,
    fits: Sequence[ScalingFit] | None = None,
    path: PathArg = None,
    title: str = "Parallel efficiency",
) -> Figure:
    """Efficiency (percent) vs N, with the 100 % ideal and dashed predicted efficiencies.

    Args:
        table: the scaling table (``world_size``, ``efficiency``, ``study``, ``strategy``).
        fits: fitted laws; predicted efficiency = predicted speed-up / p, dashed.
        path: a file or files to save to; None saves nothing.
        title: the axes title.
    """
    fig, ax = _new_figure()
    right = _largest_x(table, fits)
    _log2_axis(ax, right)
    ax.axhline(1.0, color="black", linestyle=":", linewidth=1, label="ideal (100 %)")
    for index, (label, study, strategy, group) in enumerate(_series(table)):
        color = f"C{index % 10}"
        ax.plot(group["world_size"], group["efficiency"], marker="o", color=color, label=f"{label} (measured)")
        fit = _fit_for(fits, study, strategy)
        if fit is not None:
            xs = _prediction_x(fit, float(group["world_size"].max()))
            predicted = fit.predict(xs) / (xs / fit.base_world_size)
            ax.plot(xs, predicted, linestyle="--", color=color, alpha=0.8, label=f"{label}: {fit.label}")
    ax.yaxis.set_major_formatter(PercentFormatter(xmax=1.0))
    top = float(table["efficiency"].max()) if not table.empty else 1.0
    ax.set_ylim(0.0, max(1.1, top * 1.1))
    ax.set_ylabel("efficiency (% of ideal)")
    ax.set_title(title)
    ax.legend(fontsize="small")
    _freeze_layout(fig)
    save_figure(fig, path)
    return fig


def throughput_figure(
    table: pd.DataFrame,
    path: PathArg = None,
    title: str = "Throughput per device",
    unit: str = "samples/s",
) -> Figure:
    """Throughput per device vs N, with the min-max spread over repeats as error bars.

    Args:
        table: the scaling table (``world_size``, ``samples_per_s``, ``samples_per_s_min``,
            ``samples_per_s_max``, ``samples_per_s_per_device``).
        path: a file or files to save to; None saves nothing.
        title: the axes title.
        unit: the throughput unit shown on the y axis.
    """
    fig, ax = _new_figure()
    _log2_axis(ax, _largest_x(table, None))
    top = 0.0
    for index, (label, _study, _strategy, group) in enumerate(_series(table)):
        n = group["world_size"].to_numpy(dtype=float)
        y = group["samples_per_s_per_device"].to_numpy(dtype=float)
        low = y - group["samples_per_s_min"].to_numpy(dtype=float) / n
        high = group["samples_per_s_max"].to_numpy(dtype=float) / n - y
        ax.errorbar(n, y, yerr=[low, high], marker="o", capsize=3, color=f"C{index % 10}", label=label)
        ax.axhline(y[0], color=f"C{index % 10}", linestyle=":", linewidth=1, alpha=0.6)
        top = max(top, float(np.nanmax(y + high)))
    ax.set_ylim(0.0, top * 1.12 if top > 0 else 1.0)
    ax.set_ylabel(f"throughput per device ({unit} per device)")
    ax.set_title(f"{title} (dotted: baseline N0; bars: min-max over repeats)", fontsize="medium")
    ax.legend(fontsize="small")
    _freeze_layout(fig)
    save_figure(fig, path)
    return fig
