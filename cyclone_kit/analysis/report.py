"""The scaling report: ``scaling.csv``, plots (PNG + SVG), ``report.md`` and ``report.html``.

:func:`write_report` is the one entry point with side effects (it reads the runs and writes
OUT). The content is built as a list of small blocks by the pure :func:`report_blocks`
(:mod:`cyclone_kit.analysis.report_content`), then rendered twice (:mod:`cyclone_kit.analysis.render`):
Markdown (images by file name) and a self-contained HTML page (images embedded as base64 PNG, no
external resources). Baselines are read by :mod:`cyclone_kit.analysis.baselines`.

Baselines (``--baseline NAME=PATH``): PATH is a run directory, a study directory or a
``metrics.jsonl`` written by this tool on another platform (e.g. ``run SPEC --nproc 1`` on
Colab or Kaggle), or a CSV of published rows with at least the columns ``name``, ``device``,
``samples_per_s`` (optional: ``devices``, ``model``, ``dataset``, ``precision``,
``batch_per_device``, ``source``, ``kind``). Each baseline's ``samples_per_s`` is the total
throughput of its ``devices`` (default 1); the report's tables state, for every measured N,
"N GPUs here = X times NAME", and its summary gives a headline ratio only like for like.

What the report may state (fits, Karp-Flatt, short measurements, baselines) is decided by
:mod:`cyclone_kit.analysis.honesty`; what scaling costs by :mod:`cyclone_kit.analysis.cost`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

from cyclone_kit.analysis import plots
from cyclone_kit.analysis.baselines import BASELINE_COLUMNS, load_baseline, parse_baseline_spec
from cyclone_kit.analysis.cost import query_sacct, usage_table
from cyclone_kit.analysis.explain import Explanation, diagnose, phase_table
from cyclone_kit.analysis.honesty import Review, review
from cyclone_kit.analysis.ingest import Ingested, load_runs
from cyclone_kit.analysis.pipeline import pipeline_sections
from cyclone_kit.analysis.render import render_html, render_markdown
from cyclone_kit.analysis.report_content import report_blocks
from cyclone_kit.analysis.scaling import ScalingFit, compare_to_baselines, fit_scaling_laws, scaling_table
from cyclone_kit.core.errors import CycloneError
from cyclone_kit.launchers import LOCAL

__all__ = [
    "BASELINE_COLUMNS", "PLOT_STEMS", "ReportResult", "load_baseline", "parse_baseline_spec", "render_html",
    "render_markdown", "report_blocks", "write_report",
]

PLOT_STEMS = ("speedup", "efficiency", "throughput_per_device", "cost")


# ---------------------------------------------------------------- the edge


@dataclass(frozen=True)
class ReportResult:
    """What :func:`write_report` produced.

    Attributes:
        out_dir: the output directory.
        table: the scaling table written to ``scaling.csv``.
        data: the ingested runs.
        fits: the fitted scaling laws.
        baselines: the baseline rows used.
        files: every file written.
        checks: what the honesty rules found (:class:`~cyclone_kit.analysis.honesty.Review`).
        usage: device-hours and energy per run (the columns added to ``runs.csv``).
        accounting_note: why sacct gave nothing ("" when it answered).
    """

    out_dir: Path
    table: pd.DataFrame
    data: Ingested
    fits: tuple[ScalingFit, ...]
    baselines: pd.DataFrame
    files: tuple[Path, ...]
    checks: Review = field(default_factory=Review)
    usage: pd.DataFrame = field(default_factory=pd.DataFrame)
    accounting_note: str = ""

    @property
    def warnings(self) -> tuple[str, ...]:
        """Problems found while reading the runs."""
        return self.data.warnings

    @property
    def runs(self) -> pd.DataFrame:
        """The runs table with the usage columns (what ``runs.csv`` holds)."""
        return self.data.runs.join(self.usage) if not self.usage.empty else self.data.runs


def write_report(
    paths: Sequence[str | Path] | str | Path,
    out_dir: str | Path,
    baselines: Sequence[str | tuple[str, str | Path]] = (),
    *,
    title: str = "Scaling report",
    accounting: bool = True,
    network: str | Path | None = None,
) -> ReportResult:
    """Read every run below ``paths`` and write the scaling report to ``out_dir``.

    Writes ``scaling.csv``, ``runs.csv`` (with device-hours and energy per run),
    ``baselines.csv`` (when baselines are given), the :data:`PLOT_STEMS` plots as PNG (300 dpi)
    and SVG (editable text) when at least one run is complete, ``report.md`` and a
    self-contained ``report.html``.

    Args:
        paths: study directories, run directories or metrics files.
        out_dir: the output directory (created).
        baselines: ``"NAME=PATH"`` strings or ``(name, path)`` pairs.
        title: the report title.
        accounting: ask ``sacct`` for the runs' Slurm jobs (elapsed, GPUs, energy); without it,
            or when accounting is disabled, device-hours come from the metrics records.
        network: a doctor run's ``network.json`` for the predictions; None: the partition's published
            figures where its profile has them, else no prediction (the report says why).

    Raises:
        ValidationError: a path holds no metrics, or a baseline is unusable.
    """
    specs = [parse_baseline_spec(b) if isinstance(b, str) else (b[0], Path(b[1])) for b in baselines]
    baseline_rows = [load_baseline(name, path) for name, path in specs]
    data = load_runs(paths)
    table = scaling_table(data.runs)
    fits = tuple(fit_scaling_laws(table))
    baseline_frame = (
        pd.concat(baseline_rows, ignore_index=True) if baseline_rows
        else pd.DataFrame(columns=list(BASELINE_COLUMNS))
    )

    checks = review(data.runs, data.steps, table, fits, baseline_frame)
    accounting_note = ""
    sacct: dict = {}
    if accounting:
        on_slurm = data.runs[data.runs["launcher"].astype(str) != LOCAL.name]  # local runs' job ids are fake
        sacct, accounting_note = query_sacct(list(on_slurm["slurm_job_id"].dropna()))
    usage = usage_table(data.runs, data.ranks, sacct)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files: list[Path] = []
    table.to_csv(out / "scaling.csv", index=False)
    data.runs.join(usage).to_csv(out / "runs.csv", index=False)
    files += [out / "scaling.csv", out / "runs.csv"]
    if not baseline_frame.empty:
        comparisons = compare_to_baselines(table, baseline_frame)
        comparisons.to_csv(out / "baselines.csv", index=False)
        files.append(out / "baselines.csv")

    images: dict[str, bytes] = {}
    plots_written = not table.empty
    if plots_written:
        setup = plots.plot_setup(data.runs, table)
        mode = "/".join(sorted(set(table["mode"]) - {"unknown"}))
        scaling = f" ({mode} scaling)" if mode else ""
        figures = {
            "speedup": plots.speedup_figure(table, fits, title=f"Speed-up{scaling}", setup=setup, checks=checks),
            "efficiency": plots.efficiency_figure(table, fits, title=f"Parallel efficiency{scaling}", setup=setup,
                                                  checks=checks),
            "throughput_per_device": plots.throughput_figure(table, setup=setup),
            "cost": plots.cost_figure(table, fits, setup=setup),
        }
        for stem, fig in figures.items():
            written = plots.save_figure(fig, [out / f"{stem}.png", out / f"{stem}.svg"])
            files += written
            images[stem] = (out / f"{stem}.png").read_bytes()

    explanations = explain_studies(data, table, network)
    if plots_written:
        files += _explain_figures(explanations, setup, out, images)
    generated = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    blocks = report_blocks(
        data, table, fits, baseline_frame, title=title, generated=generated, plots_written=plots_written,
        checks=checks, usage=usage, accounting_note=accounting_note, explanations=explanations,
        pipeline=pipeline_sections(data.runs["run_dir"]),
    )
    (out / "report.md").write_text(render_markdown(blocks), encoding="utf-8")
    (out / "report.html").write_text(render_html(blocks, images), encoding="utf-8")
    files += [out / "report.md", out / "report.html"]
    return ReportResult(
        out_dir=out, table=table, data=data, fits=fits, baselines=baseline_frame, files=tuple(files),
        checks=checks, usage=usage, accounting_note=accounting_note,
    )


def explain_studies(data: Ingested, table: pd.DataFrame, network: str | Path | None = None
                    ) -> dict[str, Explanation]:
    """Per study: its phases at every N, the diagnosis, and the model's prediction (or why there is none)."""
    from cyclone_kit.analysis.forecast import forecast_data

    points = phase_table(data.steps, data.runs, data.ranks)
    out = {}
    for study in dict.fromkeys(data.runs["study"]):
        mine = points[points["study"] == study] if not points.empty else points
        if mine.empty:
            continue
        main = mine[mine["strategy"] == mine["strategy"].iloc[0]]
        forecast, why = None, ""
        try:
            subset = Ingested(runs=data.runs[data.runs["study"] == study], steps=data.steps, epochs=data.epochs,
                              ranks=data.ranks, warnings=())
            forecast = forecast_data(subset, table[table["study"] == study], network_path=str(network) if network
                                     else None)
        except CycloneError as e:
            why = e.message[0].lower() + e.message[1:] + (f" ({e.hint})" if e.hint else "")
        out[str(study)] = Explanation(str(study), main, diagnose(main), forecast, why)
    return out


def _explain_figures(explanations: dict[str, Explanation], setup: plots.PlotSetup, out: Path,
                     images: dict[str, bytes]) -> list[Path]:
    """The breakdown and prediction figures of every explained study (PNG + SVG); their PNG bytes into ``images``."""
    from cyclone_kit.analysis import phase_plots
    from cyclone_kit.analysis.report_content import figure_stem

    files: list[Path] = []
    for study, ex in explanations.items():
        predicted_parts = None
        figures = {}
        if ex.forecast is not None:
            pts = ex.forecast.prediction.points
            predicted_parts = {p.world_size: {"data_time_s": p.data_s, "compute_time_s": p.compute_s,
                                              "comm_exposed_s": p.exposed_s, "other_time_s": p.rest_s} for p in pts}
            figures["prediction"] = phase_plots.prediction_figure(
                ex.forecast.measured, {p.world_size: (p.efficiency, p.efficiency_low, p.efficiency_high) for p in pts},
                title=f"Efficiency: predicted and measured ({study})", setup=setup)
        figures["breakdown"] = phase_plots.breakdown_figure(ex.points, predicted_parts,
                                                            title=f"Where the time goes ({study})", setup=setup)
        for kind, fig in figures.items():
            stem = f"{kind}-{figure_stem(study)}"
            files += plots.save_figure(fig, [out / f"{stem}.png", out / f"{stem}.svg"])
            images[stem] = (out / f"{stem}.png").read_bytes()
    return files
