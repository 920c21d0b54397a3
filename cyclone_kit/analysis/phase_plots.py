"""The report's "where the time goes" and "predicted vs measured" figures (data in, Figure out).

Same conventions as :mod:`cyclone_kit.analysis.plots`: an Agg canvas, saved only when given a path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import PercentFormatter

from cyclone_kit.analysis.explain import PARTS
from cyclone_kit.analysis.plots import PathArg, PlotSetup, freeze_layout, new_figure, save_figure, set_title

#: One color per part of a step (data, compute, exposed all-reduce, rest).
_COLORS = ("#4c72b0", "#55a868", "#c44e52", "#8c8c8c")


def breakdown_figure(points: pd.DataFrame, predicted: Mapping[int, Mapping[str, float]] | None = None,
                     path: PathArg = None, title: str = "Where the time goes", setup: PlotSetup | None = None
                     ) -> Figure:
    """Stacked bars of ms per step at every measured N (phases of :func:`~cyclone_kit.analysis.explain.phase_table`);
    with ``predicted`` (N -> part -> seconds), a hatched predicted bar beside each.

    A point without measured phases shows its data wait and the rest of its step as one grey "not broken down" part.
    """
    setup = setup or PlotSetup()
    fig, ax = new_figure()
    points = points.sort_values("world_size")
    ns = sorted({*points["world_size"].astype(int), *(predicted or {})})
    x = np.arange(len(ns))
    width = 0.38 if predicted else 0.6
    offset = -width / 2 if predicted else 0.0
    for i, n in enumerate(ns):
        row = points[points["world_size"] == n]
        if row.empty:
            continue
        p = row.iloc[0]
        bottom = 0.0
        parts = [(c, p[c]) for c, _ in PARTS] if p["phases"] else \
            [("data_time_s", p["data_time_s"]), ("not broken down", p["step_time_s"] - (p["data_time_s"] or 0.0))]
        for column, value in parts:
            value = 0.0 if value is None or np.isnan(value) else 1e3 * float(value)
            k = next((j for j, (c, _) in enumerate(PARTS) if c == column), 3)
            label = dict(PARTS).get(column, column) if i == 0 or not p["phases"] else None
            ax.bar(x[i] + offset, value, width, bottom=bottom, color=_COLORS[k], label=label,
                   hatch="//" if column == "not broken down" else None)
            bottom += value
    for i, n in enumerate(ns):
        if not predicted or n not in predicted:
            continue
        bottom = 0.0
        for k, (column, label) in enumerate(PARTS):
            value = 1e3 * float(predicted[n].get(column, 0.0))
            ax.bar(x[i] + width / 2, value, width, bottom=bottom, color=_COLORS[k], alpha=0.45, hatch="..",
                   edgecolor="white", label=f"{label} (predicted)" if i == 0 else None)
            bottom += value
    ax.set_xticks(x, [str(n) for n in ns])
    ax.set_xlabel(f"number of {setup.unit}, N")
    ax.set_ylabel("time per step (ms)")
    handles, labels = ax.get_legend_handles_labels()
    seen = dict(zip(labels, handles, strict=True))
    ax.legend(seen.values(), seen.keys(), fontsize="x-small")
    set_title(ax, title, setup)
    freeze_layout(fig)
    save_figure(fig, path)
    return fig


def prediction_figure(measured: Mapping[int, float], predicted: Mapping[int, tuple[float, float, float]],
                      path: PathArg = None, title: str = "Efficiency: predicted and measured",
                      setup: PlotSetup | None = None, label: str = "predicted") -> Figure:
    """Measured efficiency (points) and the model's (with its band from the calibration's spread) vs N."""
    setup = setup or PlotSetup()
    fig, ax = new_figure()
    ns = sorted(predicted)
    eff = np.array([predicted[n][0] for n in ns])
    low = np.array([predicted[n][1] for n in ns])
    high = np.array([predicted[n][2] for n in ns])
    ax.axhline(1.0, color="black", linestyle=":", linewidth=1, label="ideal (100 %)")
    ax.errorbar(ns, eff, yerr=[eff - low, high - eff], marker="s", linestyle="--", capsize=3, color="C1", label=label)
    ax.fill_between(ns, low, high, color="C1", alpha=0.15)
    shown: Sequence[int] = sorted(measured)
    ax.plot(shown, [measured[n] for n in shown], marker="o", linestyle="", color="C0", markersize=7, label="measured")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_xlabel(f"number of {setup.unit}, N (log2 scale)")
    ax.yaxis.set_major_formatter(PercentFormatter(xmax=1.0))
    ax.set_ylim(0.0, max(1.1, float(np.nanmax(high)) * 1.05 if len(high) else 1.1))
    ax.set_ylabel("efficiency (% of ideal)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    set_title(ax, title, setup)
    freeze_layout(fig)
    save_figure(fig, path)
    return fig
