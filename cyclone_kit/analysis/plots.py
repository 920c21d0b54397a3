"""Scaling plots for a paper: each function takes data, returns a matplotlib Figure, saves only if asked.

Figures are built with the object-oriented API on an Agg canvas (no pyplot state, no display
needed), so they work on a login node, in a batch job and inline in a notebook.

What every figure does (issue 17):

* PNG at :data:`PNG_DPI` dpi; SVG with editable text (``svg.fonttype = none``) and PDF with
  embedded TrueType text, for journals that want vector figures;
* a title that names the model, device, precision and global batch (from :func:`plot_setup`);
* the x axis in the study's unit (GPUs, CPU processes) on a log2 scale, and a mark where the
  runs go from one node to more;
* readable legend labels ("measured", the strategy, or the study when several are drawn);
* a fitted law only when :mod:`cyclone_kit.analysis.honesty` calls it meaningful: solid over the
  measured range, dashed (on a shaded background) where it is extrapolated, and only up to the
  horizon those rules allow;
* error bars (min-max over repeats) only when a point has repeats; points measured too briefly
  ringed (when given the honesty review).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator, PercentFormatter

from cyclone_kit.analysis.honesty import FitVerdict, Review, fit_verdicts
from cyclone_kit.analysis.scaling import ScalingFit

PathArg = str | Path | Sequence[str | Path] | None

#: Resolution of PNG files.
PNG_DPI = 300

#: Settings for vector output: text stays text (editable in Inkscape/Illustrator).
_VECTOR_RC = {"svg.fonttype": "none", "pdf.fonttype": 42, "ps.fonttype": 42}


@dataclass(frozen=True)
class PlotSetup:
    """What the figures say about the runs: the unit of N and the setup for the titles.

    Attributes:
        unit: the plural unit of N (``GPUs``, ``CPU processes``, ``devices``).
        unit_one: the singular unit (``GPU``, ``CPU process``, ``device``).
        details: e.g. ``tiny_cnn, CPU, fp32, global batch 128``.
    """

    unit: str = "devices"
    unit_one: str = "device"
    details: str = ""


def _distinct(values: pd.Series) -> list[str]:
    """Distinct non-empty values, in order."""
    out: list[str] = []
    for value in values.dropna():
        text = str(value).strip()
        if text and text.lower() not in ("nan", "none", "<na>") and text not in out:
            out.append(text)
    return out


def units_of(runs: pd.DataFrame) -> tuple[str, str]:
    """(singular, plural) unit of N from the runs' devices: GPU(s), CPU process(es) or device(s)."""
    devices = set(_distinct(runs["device"])) if "device" in runs and not runs.empty else set()
    kinds = {d.split(":")[0] for d in devices}
    if kinds == {"cuda"}:
        return "GPU", "GPUs"
    if kinds == {"cpu"}:
        return "CPU process", "CPU processes"
    return "device", "devices"


def plot_setup(runs: pd.DataFrame, table: pd.DataFrame | None = None) -> PlotSetup:
    """The :class:`PlotSetup` of some runs (complete ones when there are any).

    Args:
        runs: the runs table.
        table: the scaling table (its global batch sizes, for strong studies); optional.
    """
    if runs.empty:
        return PlotSetup()
    complete = runs[runs["complete"].astype(bool)] if "complete" in runs else runs
    complete = complete if not complete.empty else runs
    one, many = units_of(complete)
    parts = ["/".join(_distinct(complete["model"])) or "model unknown"]
    names = _distinct(complete["device_name"]) if "device_name" in complete else []
    kinds = {"cuda": "GPU", "cpu": "CPU"}
    device_kinds = {d.split(":")[0] for d in _distinct(complete["device"])}
    if names and device_kinds == {"cpu"} and not any("cpu" in n.lower() for n in names):
        names = [f"{n} CPU" for n in names]  # "AMD EPYC" alone does not say it ran on the CPU
    device = "/".join(names) or "/".join(kinds.get(d.split(":")[0], d) for d in _distinct(complete["device"]))
    parts.append(device or "device unknown")
    parts.append("/".join(_distinct(complete["precision"])) or "precision unknown")
    batches = sorted({int(b) for b in complete["global_batch_size"].dropna()})
    per_device = sorted({int(b) for b in complete["per_device_batch_size"].dropna()})
    if len(batches) == 1:
        parts.append(f"global batch {batches[0]}")
    elif batches and len(per_device) == 1:
        parts.append(f"batch {per_device[0]} per {one} (global {batches[0]}-{batches[-1]})")
    elif batches:
        parts.append(f"global batch {'/'.join(str(b) for b in batches)}")
    return PlotSetup(unit=many, unit_one=one, details=", ".join(parts))


def save_figure(fig: Figure, path: PathArg) -> list[Path]:
    """Save ``fig`` to each path given (format from the suffix); nothing when path is None.

    PNG files get :data:`PNG_DPI` dpi; SVG keeps its text as text and PDF embeds TrueType fonts,
    so labels stay editable.
    """
    if path is None:
        return []
    paths = [Path(path)] if isinstance(path, str | Path) else [Path(p) for p in path]
    for target in paths:
        target.parent.mkdir(parents=True, exist_ok=True)
        with matplotlib.rc_context(_VECTOR_RC):
            fig.savefig(target, metadata=_metadata(target), dpi=PNG_DPI)
    return paths


def _metadata(target: Path) -> dict[str, str | None]:
    """Reproducible file metadata (no creation date in SVG/PDF)."""
    if target.suffix.lower() in (".svg", ".pdf"):
        return {"Date": None}
    return {}


def _new_figure() -> tuple[Figure, object]:
    """A Figure on an Agg canvas, and its single Axes."""
    fig = Figure(figsize=(6.4, 4.6))
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
    """(legend label, study, strategy, rows sorted by N) for each line to draw.

    One line is "measured"; lines of one study are named by strategy; several studies by study.
    """
    out: list[tuple[str, str, str, pd.DataFrame]] = []
    if table.empty:
        return out
    groups = list(table.groupby(["study", "strategy"], sort=False))
    strategies = [str(strategy) for (_, strategy), _ in groups]
    studies = [str(study) for (study, _), _ in groups]
    for (study, strategy), group in groups:
        name = str(strategy).upper() if len(str(strategy)) <= 5 else str(strategy)
        if len(groups) == 1:
            label = "measured"
        elif len(set(strategies)) == len(groups):  # the strategy tells the lines apart
            label = name
        elif len(set(studies)) == len(groups):
            label = str(study)
        else:
            label = f"{study}, {name}"
        out.append((label, str(study), str(strategy), group.sort_values("world_size")))
    return out


def _legend(fig: Figure, ax: object) -> None:
    """A legend inside the axes when short, below them (outside the data) when long."""
    handles, labels = ax.get_legend_handles_labels()
    if len(handles) <= 5:
        ax.legend(fontsize="small")
    else:
        fig.set_figheight(fig.get_figheight() + 0.22 * ((len(handles) + 1) // 2))  # keep the axes' height
        fig.legend(handles, labels, loc="outside lower center", ncols=2, fontsize="small")


def _log2_axis(ax: object, largest: float, setup: PlotSetup) -> None:
    """Log2 x axis with integer ticks at the powers of two up to ``largest``."""
    ax.set_xscale("log", base=2)
    top = max(int(np.ceil(np.log2(max(largest, 1.0)))), 1)
    ax.xaxis.set_major_locator(FixedLocator([2.0**k for k in range(0, top + 1)]))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _pos: f"{value:g}"))
    ax.set_xlim(0.8, 2.0**top * 1.25)
    ax.set_xlabel(f"number of {setup.unit}, N (log2 scale)")
    ax.grid(True, which="major", alpha=0.3)


def _node_boundaries(ax: object, table: pd.DataFrame) -> None:
    """A vertical line between the last N on k nodes and the first on more, labelled."""
    marks: dict[float, int] = {}
    for _, _, _, group in _series(table):
        nodes = group["num_nodes"].to_numpy()
        sizes = group["world_size"].to_numpy(dtype=float)
        for i in range(1, len(group)):
            if pd.notna(nodes[i]) and pd.notna(nodes[i - 1]) and int(nodes[i]) > int(nodes[i - 1]):
                marks[float(np.sqrt(sizes[i] * sizes[i - 1]))] = int(nodes[i])
    for index, (x, nodes) in enumerate(sorted(marks.items())):
        ax.axvline(x, color="0.45", linestyle="-.", linewidth=1,
                   label="node boundary" if index == 0 else "_nolegend_")
        ax.text(x, 0.98, f" {nodes} nodes \u2192", transform=ax.get_xaxis_transform(), rotation=90,
                va="top", ha="right", fontsize="x-small", color="0.3")


def _mark_short(ax: object, table: pd.DataFrame, column: str, checks: Review | None) -> None:
    """Ring the points that rule 4 calls measured too briefly."""
    if checks is None:
        return
    short = {(f.study, f.strategy, f.world_size) for f in checks.points if f.rule == "short"}
    rows = [r for _, r in table.iterrows() if (str(r["study"]), str(r["strategy"]), int(r["world_size"])) in short]
    if rows:
        ax.plot([float(r["world_size"]) for r in rows], [float(r[column]) for r in rows], linestyle="none",
                marker="o", markersize=13, mfc="none", mec="crimson", mew=1.5, label="measured too briefly")


def _title(ax: object, what: str, setup: PlotSetup) -> None:
    """Two-line title: what the figure shows, then the setup."""
    ax.set_title(f"{what}\n{setup.details}" if setup.details else what, fontsize="medium")


def _fit_for(fits: Sequence[ScalingFit] | None, study: str, strategy: str) -> ScalingFit | None:
    """The fit of one study/strategy, if any."""
    for fit in fits or ():
        if fit.study == study and fit.strategy == strategy:
            return fit
    return None


def _drawable(table: pd.DataFrame, fits: Sequence[ScalingFit] | None) -> dict[tuple[str, str], FitVerdict]:
    """Verdicts of the fits that may be drawn (meaningful ones)."""
    return {k: v for k, v in fit_verdicts(table, list(fits or ())).items() if v.meaningful}


def _right_end(table: pd.DataFrame, verdicts: dict[tuple[str, str], FitVerdict]) -> float:
    """The right end of the x axis: the largest N, or the farthest extrapolation horizon."""
    largest = float(table["world_size"].max()) if not table.empty else 1.0
    return max([largest, *(float(v.horizon) for v in verdicts.values())])


def _draw_law(ax: object, fit: ScalingFit, verdict: FitVerdict, color: str, efficiency: bool) -> None:
    """The law: solid over the measured range, dashed from the largest N to the horizon."""
    def values(xs: np.ndarray) -> np.ndarray:
        speedup = fit.predict(xs)
        return speedup / (xs / fit.base_world_size) if efficiency else speedup

    inside = np.geomspace(fit.base_world_size, verdict.largest, 32)
    ax.plot(inside, values(inside), linestyle="-", linewidth=1, color=color, alpha=0.6,
            label=f"{fit.law.capitalize()} fit (s = {fit.serial_fraction:.3g})")
    if verdict.horizon > verdict.largest:
        outside = np.geomspace(verdict.largest, verdict.horizon, 32)
        ax.plot(outside, values(outside), linestyle="--", color=color, alpha=0.8,
                label=f"{fit.law.capitalize()} prediction, extrapolated to N = {verdict.horizon}")


def _shade_extrapolation(ax: object, verdicts: dict[tuple[str, str], FitVerdict]) -> None:
    """A grey band over the world sizes where only extrapolated values are drawn."""
    extrapolated = [v for v in verdicts.values() if v.horizon > v.largest]
    if extrapolated:
        left = min(v.largest for v in extrapolated)
        right = max(v.horizon for v in extrapolated)
        ax.axvspan(left, right * 1.25, color="0.92", zorder=0, label="extrapolated (no data)")


def speedup_figure(
    table: pd.DataFrame,
    fits: Sequence[ScalingFit] | None = None,
    path: PathArg = None,
    title: str = "Speed-up",
    setup: PlotSetup | None = None,
    checks: Review | None = None,
) -> Figure:
    """Speed-up vs N (log2/log2), with the ideal line and the meaningful fitted laws.

    Args:
        table: the scaling table (``world_size``, ``speedup``, ``num_nodes``, ``study``, ``strategy``).
        fits: fitted laws; only those :func:`~cyclone_kit.analysis.honesty.fit_verdict` calls
            meaningful are drawn, extrapolated (dashed) only up to their horizon.
        path: a file or files to save to (PNG, SVG, PDF); None saves nothing.
        title: the first line of the title (the setup is the second).
        setup: units and setup for labels (see :func:`plot_setup`); generic when None.
        checks: the honesty review; points it calls measured too briefly are ringed.
    """
    setup = setup or PlotSetup()
    fig, ax = _new_figure()
    verdicts = _drawable(table, fits)
    right = _right_end(table, verdicts)
    _log2_axis(ax, right, setup)
    ax.set_yscale("log", base=2)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _pos: f"{value:g}"))
    _shade_extrapolation(ax, verdicts)
    for base in sorted({int(g["world_size"].min()) for _, _, _, g in _series(table)}):
        xs = np.array([base, right])
        label = "ideal (linear)" if base == 1 else f"ideal (linear from N0 = {base})"
        ax.plot(xs, xs / base, color="black", linestyle=":", linewidth=1, label=label)
    for index, (label, study, strategy, group) in enumerate(_series(table)):
        color = f"C{index % 10}"
        ax.plot(group["world_size"], group["speedup"], marker="o", color=color, label=label)
        fit = _fit_for(fits, study, strategy)
        if fit is not None and (study, strategy) in verdicts:
            _draw_law(ax, fit, verdicts[(study, strategy)], color, efficiency=False)
    _mark_short(ax, table, "speedup", checks)
    _node_boundaries(ax, table)
    lowest = float(table["speedup"].min()) if not table.empty else 1.0
    if lowest < 1:  # slower than N0: keep a labelled power of two below the lowest point
        ax.set_ylim(bottom=2.0 ** np.floor(np.log2(lowest)) * 0.9)
    ax.set_ylabel("speed-up S(N) = T(N) / T(N0) (log2 scale)")
    _title(ax, title, setup)
    _legend(fig, ax)
    _freeze_layout(fig)
    save_figure(fig, path)
    return fig


def efficiency_figure(
    table: pd.DataFrame,
    fits: Sequence[ScalingFit] | None = None,
    path: PathArg = None,
    title: str = "Parallel efficiency",
    setup: PlotSetup | None = None,
    checks: Review | None = None,
) -> Figure:
    """Efficiency (percent) vs N, with the 100 % ideal and the meaningful laws' efficiencies.

    Args:
        table: the scaling table (``world_size``, ``efficiency``, ``study``, ``strategy``).
        fits: fitted laws (drawn as in :func:`speedup_figure`).
        path: a file or files to save to; None saves nothing.
        title: the first line of the title.
        setup: units and setup for labels; generic when None.
        checks: the honesty review; points it calls measured too briefly are ringed.
    """
    setup = setup or PlotSetup()
    fig, ax = _new_figure()
    verdicts = _drawable(table, fits)
    _log2_axis(ax, _right_end(table, verdicts), setup)
    _shade_extrapolation(ax, verdicts)
    ax.axhline(1.0, color="black", linestyle=":", linewidth=1, label="ideal (100 %)")
    for index, (label, study, strategy, group) in enumerate(_series(table)):
        color = f"C{index % 10}"
        ax.plot(group["world_size"], group["efficiency"], marker="o", color=color, label=label)
        fit = _fit_for(fits, study, strategy)
        if fit is not None and (study, strategy) in verdicts:
            _draw_law(ax, fit, verdicts[(study, strategy)], color, efficiency=True)
    _mark_short(ax, table, "efficiency", checks)
    _node_boundaries(ax, table)
    ax.yaxis.set_major_formatter(PercentFormatter(xmax=1.0))
    top = float(table["efficiency"].max()) if not table.empty else 1.0
    ax.set_ylim(0.0, max(1.1, top * 1.1))
    ax.set_ylabel("efficiency (% of ideal)")
    _title(ax, title, setup)
    _legend(fig, ax)
    _freeze_layout(fig)
    save_figure(fig, path)
    return fig


def throughput_figure(
    table: pd.DataFrame,
    path: PathArg = None,
    title: str = "Throughput per device",
    unit: str = "samples/s",
    setup: PlotSetup | None = None,
) -> Figure:
    """Throughput per device vs N; error bars (min-max) only where a point has repeats.

    Args:
        table: the scaling table (``world_size``, ``runs``, ``samples_per_s_min``,
            ``samples_per_s_max``, ``samples_per_s_per_device``).
        path: a file or files to save to; None saves nothing.
        title: the first line of the title ("device" is replaced by the study's unit).
        unit: the throughput unit shown on the y axis.
        setup: units and setup for labels; generic when None.
    """
    setup = setup or PlotSetup()
    fig, ax = _new_figure()
    _log2_axis(ax, _right_end(table, {}), setup)
    top = 0.0
    repeats = int(table["runs"].max()) if not table.empty else 1
    for index, (label, _study, _strategy, group) in enumerate(_series(table)):
        n = group["world_size"].to_numpy(dtype=float)
        y = group["samples_per_s_per_device"].to_numpy(dtype=float)
        color = f"C{index % 10}"
        if repeats > 1:
            low = y - group["samples_per_s_min"].to_numpy(dtype=float) / n
            high = group["samples_per_s_max"].to_numpy(dtype=float) / n - y
            ax.errorbar(n, y, yerr=[low, high], marker="o", capsize=3, color=color, label=label)
            top = max(top, float(np.nanmax(y + high)))
        else:
            ax.plot(n, y, marker="o", color=color, label=label)
            top = max(top, float(np.nanmax(y)))
        ax.axhline(y[0], color=color, linestyle=":", linewidth=1, alpha=0.6,
                   label=f"N0 = {int(n[0])} (ideal: flat)" if index == 0 else "_nolegend_")
    _node_boundaries(ax, table)
    ax.set_ylim(0.0, top * 1.15 if top > 0 else 1.0)
    ax.set_ylabel(f"throughput per {setup.unit_one} ({unit})")
    what = title.replace("device", setup.unit_one)
    if repeats > 1:
        what += f" (bars: min-max over up to {repeats} repeats)"
    _title(ax, what, setup)
    _legend(fig, ax)
    _freeze_layout(fig)
    save_figure(fig, path)
    return fig


def cost_figure(
    table: pd.DataFrame,
    fits: Sequence[ScalingFit] | None = None,
    path: PathArg = None,
    title: str = "Speed-up against relative cost",
    setup: PlotSetup | None = None,
) -> Figure:
    """Speed-up vs relative cost (device-hours per sample relative to N0 = p / S), one point per N.

    Ideal scaling stays on the vertical line at cost 1; each step right is the price of the
    speed-up gained. Meaningful fitted laws add their predictions (hollow markers) inside the
    extrapolation horizon.

    Args:
        table: the scaling table (``world_size``, ``speedup``).
        fits: fitted laws (only meaningful ones are used).
        path: a file or files to save to; None saves nothing.
        title: the first line of the title.
        setup: units and setup for labels; generic when None.
    """
    setup = setup or PlotSetup()
    fig, ax = _new_figure()
    verdicts = _drawable(table, fits)
    ax.axvline(1.0, color="black", linestyle=":", linewidth=1, label="ideal (no extra cost)")
    for index, (label, study, strategy, group) in enumerate(_series(table)):
        color = f"C{index % 10}"
        base = float(group["world_size"].min())
        cost = (group["world_size"].to_numpy(dtype=float) / base) / group["speedup"].to_numpy(dtype=float)
        speedup = group["speedup"].to_numpy(dtype=float)
        ax.plot(cost, speedup, marker="o", color=color, label=label)
        for n, x, y in zip(group["world_size"], cost, speedup, strict=True):
            ax.annotate(f"N={int(n)}", (x, y), textcoords="offset points", xytext=(5, -10), fontsize="x-small")
        fit = _fit_for(fits, study, strategy)
        verdict = verdicts.get((study, strategy))
        if fit is not None and verdict is not None and verdict.targets():
            targets = np.array(verdict.targets(), dtype=float)
            predicted = fit.predict(targets)
            ax.plot((targets / base) / predicted, predicted, linestyle="none", marker="o", mfc="none",
                    color=color, label=f"{fit.law.capitalize()} prediction (extrapolated)")
            for n, x, y in zip(targets, (targets / base) / predicted, predicted, strict=True):
                ax.annotate(f"N={int(n)} (predicted)", (x, y), textcoords="offset points", xytext=(-6, -12),
                            ha="right", fontsize="x-small", color=color)
    ax.set_xlabel(f"relative cost: {setup.unit_one}-hours per sample / the same at N0 (= p / S)")
    ax.set_ylabel("speed-up S(N) (log2 scale)")
    ax.set_yscale("log", base=2)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _pos: f"{value:g}"))
    ax.margins(x=0.15, y=0.1)  # room for the N labels at the edges
    ax.autoscale_view()
    ax.set_xlim(left=min(0.9, ax.get_xlim()[0]))
    ax.grid(True, alpha=0.3)
    _title(ax, title, setup)
    _legend(fig, ax)
    _freeze_layout(fig)
    save_figure(fig, path)
    return fig


#: The figure helpers other figure modules share (cyclone_kit.analysis.phase_plots).
new_figure = _new_figure
freeze_layout = _freeze_layout
set_title = _title
