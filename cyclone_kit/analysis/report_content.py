"""The report's content: what it says about a study, as a list of blocks (pure).

:func:`report_blocks` builds, in order: the summary (headline ratios that hold), warnings (what the
honesty rules refuse), per study its setup, scaling table and fitted law, where the time goes and
what the model predicts (:mod:`cyclone_kit.analysis.explain`), the cost of scaling, the plots, the
baselines, incomplete runs, step timing, stragglers, data quality and the definitions. Rendering
is :mod:`cyclone_kit.analysis.render`'s; baselines are loaded by :mod:`cyclone_kit.analysis.baselines`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from cyclone_kit.analysis import plots
from cyclone_kit.analysis.cost import cost_points, usage_table
from cyclone_kit.analysis.explain import (
    Explanation,
    breakdown_header,
    breakdown_rows,
    error_rows,
    recommendations,
)
from cyclone_kit.analysis.honesty import (
    MIN_MEASURED_S,
    MIN_STEADY_WINDOWS,
    BaselineVerdict,
    FitVerdict,
    Review,
    review,
)
from cyclone_kit.analysis.ingest import Ingested
from cyclone_kit.analysis.render import Block, Bullets, Heading, Image, Paragraph, Table
from cyclone_kit.analysis.scaling import ScalingFit, compare_to_baselines, step_timing


def _fmt(value: Any, digits: int = 1) -> str:
    """A number with fixed decimals and thousands separators; empty for missing values."""
    if value is None or pd.isna(value):
        return ""
    if digits == 0:
        return str(round(float(value)))
    return f"{float(value):,.{digits}f}"


def _rate(value: Any) -> str:
    """A rate: 1 decimal from 100 up, else 3 significant digits (0.0417 solutions/s is not 0.0)."""
    if value is None or pd.isna(value):
        return ""
    return _fmt(value) if abs(float(value)) >= 100 else f"{float(value):.3g}"


def _solution_cost(strategy: str, study_runs: pd.DataFrame) -> tuple[float, str]:
    """(factor, unit) turning ``device_hours_per_1m_samples`` into what it means for this strategy.

    A time-to-solution "sample" is one whole run of the script: its cost is per solution, or per
    1M samples when the runs say how many samples one run processes (``[script] samples_per_run``).
    """
    if strategy != "time-to-solution":
        return 1.0, "per 1M samples"
    told = pd.to_numeric(study_runs.get("samples_per_run", pd.Series(dtype=float)), errors="coerce").dropna()
    if not told.empty and float(told.iloc[0]) > 0:
        return 1.0 / float(told.iloc[0]), "per 1M samples"
    return 1e-6, "per solution"


def _pct(value: Any) -> str:
    """A fraction as a percentage, or empty."""
    return "" if value is None or pd.isna(value) else f"{100.0 * float(value):.1f} %"


def _unit(runs: pd.DataFrame, n: int) -> str:
    """'GPU(s)' / 'CPU process(es)' / 'device(s)' for a count, from the runs' devices."""
    singular, plural = plots.units_of(runs)
    return singular if n == 1 else plural


def _values(series: pd.Series, limit: int = 6) -> str:
    """Distinct non-empty values of a column, comma-separated, at most ``limit`` shown."""
    values: list[str] = []
    for value in series.dropna():
        for part in str(value).split(","):
            part = part.strip()
            if part and part not in values:
                values.append(part)
    if len(values) > limit:
        return ", ".join(values[:limit]) + f", ... ({len(values)} in all)"
    return ", ".join(values)


def _setup_table(runs: pd.DataFrame) -> Table:
    """The setup of one study (model, data, precision, nodes, GPU type, versions)."""
    rows = [
        ("model", _values(runs["model"])),
        ("dataset", _values(runs["dataset"])),
        ("precision", _values(runs["precision"])),
        ("strategy", _values(runs["strategy"])),
        ("launcher", _values(runs["launcher"])),
        ("device", _values(runs["device"])),
        ("device name", _values(runs["device_name"])),
        ("world sizes", _values(runs["world_size"].astype("string"))),
        ("nodes", _values(runs["num_nodes"].astype("string"))),
        ("devices per node", _values(runs["local_world_size"].astype("string"))),
        ("per-device batch", _values(runs["per_device_batch_size"].astype("string"))),
        ("global batch", _values(runs["global_batch_size"].astype("string"))),
        ("hosts", _values(runs["hostnames"], limit=8)),
        ("Slurm job ids", _values(runs["slurm_job_id"])),
        ("torch", _values(runs["torch_version"])),
        ("torchvision", _values(runs["torchvision_version"])),
        ("cyclone_kit", _values(runs["cyclone_kit_version"])),
        ("git commit", _values(runs["git_commit"])),
        ("first start (UTC)", str(runs["start_time"].dropna().min()) if runs["start_time"].notna().any() else ""),
        ("runs (complete / all)", f"{int(runs['complete'].sum())} / {len(runs)}"),
        ("requeues", str(int(runs["restart_count"].fillna(0).sum()))),
    ]
    return Table(("setting", "value"), tuple((k, v or "-") for k, v in rows))


def _scaling_rows(table: pd.DataFrame, checks: Review, cost: tuple[float, str] = (1.0, "per 1M samples")) -> Table:
    """The scaling table of one study, formatted, with the honesty notes of each point."""
    header = (
        "N", "nodes", "per-device batch", "global batch", "runs", "samples/s (median)",
        "min - max", "samples/s per device", "speed-up", "efficiency", "Karp-Flatt e",
        f"device-h {cost[1].replace('per ', '/ ')}", "notes",
    )
    rows = []
    for _, row in table.iterrows():
        notes = checks.notes(str(row["study"]), str(row["strategy"]), int(row["world_size"]))
        rows.append(
            (
                str(int(row["world_size"])),
                _fmt(row["num_nodes"], 0),
                _fmt(row["per_device_batch_size"], 0),
                _fmt(row["global_batch_size"], 0),
                str(int(row["runs"])),
                _rate(row["samples_per_s"]),
                f"{_rate(row['samples_per_s_min'])} - {_rate(row['samples_per_s_max'])}",
                _rate(row["samples_per_s_per_device"]),
                f"{float(row['speedup']):.2f}",
                _pct(row["efficiency"]),
                "" if pd.isna(row["karp_flatt"]) else f"{float(row['karp_flatt']):.4f}",
                _hours(row["device_hours_per_1m_samples"] * cost[0]),
                "; ".join(notes),
            )
        )
    return Table(header, tuple(rows))


def _hours(value: Any) -> str:
    """Device-hours with 3 significant digits (small values keep their digits)."""
    return "" if value is None or pd.isna(value) else f"{float(value):.3g}"


def _fit_text(fit: ScalingFit, verdict: FitVerdict | None, unit_runs: pd.DataFrame) -> str:
    """One paragraph on a fitted law: its prediction inside the horizon, or why there is none."""
    law = fit.law.capitalize()
    if verdict is not None and not verdict.meaningful:
        return (f"No meaningful {law} fit (strategy {fit.strategy}): {verdict.reason}. "
                "No serial fraction or prediction is given.")
    largest = verdict.largest if verdict is not None else fit.base_world_size
    targets = verdict.targets() if verdict is not None else ()
    predicted = fit.predict(list(targets)) if targets else []
    parts = [
        f"at {n} {_unit(unit_runs, n)}: speed-up {s:.2f} (efficiency {100 * s * fit.base_world_size / n:.0f} %, "
        f"cost {n / fit.base_world_size / s:.2f}x the {_unit(unit_runs, 1)}-hours per sample of N0)"
        for n, s in zip(targets, predicted, strict=True)
    ]
    text = (f"{law} fit (strategy {fit.strategy}): serial fraction s = {fit.serial_fraction:.4f}, "
            f"RMSE {fit.rmse:.3f} over {fit.points} points.")
    if verdict is not None and verdict.reason:
        text += f" Caveat: {verdict.reason}."
    if parts:
        text += f" Predicted {'; '.join(parts)}. These are extrapolations, not measurements."
    skipped = [f * largest for f in (2, 4) if f * largest not in targets]
    if skipped:
        horizon = verdict.horizon if verdict is not None else largest
        text += (f" No prediction at N = {', '.join(str(n) for n in skipped)}: beyond the extrapolation horizon "
                 f"N = {horizon} (no more doublings than were measured).")
    return text


def _differences(verdict: BaselineVerdict | None) -> str:
    """', differs: ...' for a baseline comparison, or ''."""
    if verdict is None or not verdict.differences:
        return ""
    return f"; differs: {'; '.join(verdict.differences)}"


def report_blocks(
    data: Ingested,
    table: pd.DataFrame,
    fits: Sequence[ScalingFit],
    baselines: pd.DataFrame,
    *,
    title: str = "Scaling report",
    generated: str = "",
    plots_written: bool = True,
    checks: Review | None = None,
    usage: pd.DataFrame | None = None,
    accounting_note: str = "",
    explanations: Mapping[str, Explanation] | None = None,
    pipeline: Sequence[Any] = (),
) -> list[Block]:
    """Build the report content (pure): setup, table, plots, fits, cost, baselines, problems.

    Args:
        data: the ingested runs.
        table: the scaling table.
        fits: fitted scaling laws.
        baselines: baseline rows (:data:`BASELINE_COLUMNS`), possibly empty.
        title: the report title.
        generated: a timestamp line, or empty.
        plots_written: whether the plot files exist (False when there is no complete run).
        checks: the honesty review (:func:`cyclone_kit.analysis.honesty.review`); computed when None.
        usage: device-hours and energy per run (:func:`cyclone_kit.analysis.cost.usage_table`);
            computed from the records when None.
        accounting_note: why sacct gave nothing ("" when it did or was not asked).
        explanations: study -> where its time goes, the diagnosis and the prediction
            (:mod:`cyclone_kit.analysis.explain`); none shown for a study without one.
        pipeline: the pipeline runs' sections (:func:`cyclone_kit.analysis.pipeline.pipeline_sections`).

    Returns:
        The blocks, in order, for :func:`render_markdown` and :func:`render_html`.
    """
    runs = data.runs
    if checks is None:
        checks = review(runs, data.steps, table, fits, baselines)
    if usage is None:
        usage = usage_table(runs, data.ranks)
    blocks: list[Block] = [Heading(1, title)]
    studies = list(dict.fromkeys(runs["study"]))
    intro = (
        f"{len(runs)} run(s) in {len(studies)} study/studies; {int(runs['complete'].sum())} complete, "
        f"{int((~runs['complete']).sum())} incomplete."
    )
    blocks.append(Paragraph(intro + (f" Generated {generated}." if generated else "")))
    explanations = explanations or {}
    blocks += _summary_blocks(runs, table, baselines, checks)
    for study in studies:
        blocks += _study_blocks(study, runs, table, fits, checks)
        blocks += explain_blocks(explanations.get(study))
    blocks += _cost_blocks(data, table, fits, checks, usage, accounting_note)
    if plots_written:
        blocks += _plot_blocks()
    blocks += _baseline_blocks(runs, table, baselines, checks)
    blocks += _incomplete_blocks(data)
    blocks += _restart_blocks(data)
    blocks += _timing_blocks(data)
    for section in pipeline:  # bubble per stage against (P-1)/(M+P-1), and the stage balance
        blocks += [Heading(2, section.title), Paragraph(section.text), Table(section.header, section.rows)]
    blocks += _rank_blocks(data)
    blocks += _quality_blocks(data)
    blocks += _definition_blocks()
    return blocks


def _summary_blocks(runs: pd.DataFrame, table: pd.DataFrame, baselines: pd.DataFrame, checks: Review) -> list[Block]:
    """Headline comparisons first (what a reader of a proposal looks for, and only what holds), then the warnings."""
    blocks: list[Block] = []
    # Headline comparisons first: what a reader of a proposal looks for, and only what holds.
    headline: list[str] = []
    comparisons = compare_to_baselines(table, baselines) if not baselines.empty else pd.DataFrame()
    for (study, strategy), group in table.groupby(["study", "strategy"], sort=False):
        study_runs = runs[runs["study"] == study]
        top = group.loc[group["world_size"].idxmax()]
        n = int(top["world_size"])
        base = group.loc[group["world_size"].idxmin()]
        if n != int(base["world_size"]):
            speedup = float(top["speedup"])
            caveats = []
            if speedup < 1:
                caveats.append("slower than the baseline, not faster")
            if "measured too briefly" in checks.notes(str(study), str(strategy), n):
                caveats.append("measured too briefly to trust")
            headline.append(
                f"{study} ({strategy}): {n} {_unit(study_runs, n)} here = {speedup:.2f} times "
                f"the {int(base['world_size'])}-{_unit(study_runs, 1)} baseline of this study "
                f"(efficiency {_pct(top['efficiency'])})"
                + (f": {'; '.join(caveats)}." if caveats else ".")
            )
        if not comparisons.empty:
            mine = comparisons[
                (comparisons["study"] == study) & (comparisons["strategy"] == strategy)
                & (comparisons["world_size"] == n)
            ]
            refused = []
            for _, row in mine.iterrows():
                base_row = baselines[baselines["name"] == row["baseline"]].iloc[0]
                verdict = checks.baseline(str(row["baseline"]), str(study), str(strategy))
                who = f"{row['baseline']} ({row['baseline_device']}, {int(base_row['devices'])} device(s))"
                if verdict is not None and not verdict.like_for_like:
                    refused.append(str(row["baseline"]))
                else:
                    headline.append(
                        f"{study} ({strategy}): {n} {_unit(study_runs, n)} here = {row['times']:.2f} times "
                        f"{who}{_differences(verdict)}."
                    )
            if refused:
                headline.append(
                    f"{study} ({strategy}): no headline ratio against {', '.join(refused)}: not like for like "
                    "(what differs: Warnings; the raw ratios: Baselines)."
                )
    if headline:
        blocks += [Heading(2, "Summary"), Bullets(tuple(headline))]
    if checks.warnings:
        blocks += [
            Heading(2, "Warnings"),
            Paragraph("What the numbers below cannot support (the rules are in cyclone_kit.analysis.honesty):"),
            Bullets(checks.warnings),
        ]
    return blocks


def _study_blocks(study: str, runs: pd.DataFrame, table: pd.DataFrame, fits: Sequence[ScalingFit], checks: Review) -> list[Block]:
    """One study: its mode, setup, scaling table per strategy and the fitted law."""
    blocks: list[Block] = []
    study_runs = runs[runs["study"] == study]
    study_table = table[table["study"] == study]
    blocks.append(Heading(2, f"Study {study}"))
    modes = ", ".join(sorted(set(study_table["mode"]))) or "unknown"
    blocks.append(Paragraph(f"Mode: {modes} scaling. Baseline N0 = the smallest world size measured."))
    blocks += [Heading(3, "Setup"), _setup_table(study_runs)]
    copies = study_runs[study_runs.get("warning", pd.Series("", index=study_runs.index)).fillna("") != ""]
    if not copies.empty:  # the launch shim saw ranks that never formed one process group
        blocks.append(Paragraph(
            f"Not a scaling study as run: {len(copies)} run(s) did not train as one job "
            f"({copies['warning'].iloc[0]}). Those runs are left out of every table, fit and plot."))
    for strategy, group in study_table.groupby("strategy", sort=False):
        cost = _solution_cost(str(strategy), study_runs)
        blocks += [Heading(3, f"Scaling table ({strategy})"), _scaling_rows(group, checks, cost)]
        if strategy == "time-to-solution":  # a user script without ck.log_step (runtime/launch.py)
            blocks.append(Paragraph(
                "Time to solution: the script logged no steps, so its throughput is solutions per second "
                "(1 / the whole script's wall time, from the launch shim) and speed-up = T(N0) / T(N) for the "
                "same work. Start-up is included in every time (interpreter, imports, process-group set-up, "
                f"data loading), so short runs understate the speed-up. Cost is device-hours {cost[1]}. "
                "Add ck.log_step for steady-state samples/s."))
        fit = next((f for f in fits if f.study == study and f.strategy == strategy), None)
        if fit is not None:
            blocks.append(Paragraph(_fit_text(fit, checks.fit(str(study), str(strategy)), study_runs)))
    if study_table.empty:
        blocks.append(Paragraph("No complete run in this study: nothing to tabulate."))
    return blocks


def _plot_blocks() -> list[Block]:
    """The plots written to OUT."""
    blocks: list[Block] = []
    blocks.append(Heading(2, "Plots"))
    blocks.append(Image("speedup", "Speed-up vs world size, ideal line and fitted-law prediction"))
    blocks.append(Image("efficiency", "Parallel efficiency vs world size"))
    blocks.append(Image("throughput_per_device", "Throughput per device vs world size"))
    blocks.append(Image("cost", "Speed-up against relative cost (device-hours per sample vs N0)"))
    return blocks


def _baseline_blocks(runs: pd.DataFrame, table: pd.DataFrame, baselines: pd.DataFrame, checks: Review) -> list[Block]:
    """Each study's own baseline (N0), the external baselines and the ratios against them."""
    blocks: list[Block] = []
    comparisons = compare_to_baselines(table, baselines) if not baselines.empty else pd.DataFrame()
    blocks.append(Heading(2, "Baselines"))
    study_lines = []
    for (study, strategy), group in table.groupby(["study", "strategy"], sort=False):
        base = group.loc[group["world_size"].idxmin()]
        study_runs = runs[(runs["study"] == study) & runs["complete"]]
        n0 = int(base["world_size"])
        device = _values(study_runs[study_runs["world_size"] == n0]["device_name"]) or _values(study_runs["device"])
        study_lines.append(
            f"{study} ({strategy}): N0 = {n0} {_unit(study_runs, n0)} ({device or 'unknown device'}), "
            f"{_fmt(base['samples_per_s'])} samples/s ({_fmt(base['samples_per_s_per_device'])} per device)."
        )
    if study_lines:
        blocks += [Paragraph("The baseline of each study (speed-up 1):"), Bullets(tuple(study_lines))]
    if baselines.empty:
        blocks.append(Paragraph(
            "No external baseline given. Add one with --baseline NAME=PATH: a run directory or "
            "metrics.jsonl from another platform (e.g. a 1-GPU run on Colab or Kaggle), or a CSV "
            "of published rows such as analysis/reference_baselines.csv."
        ))
    else:
        blocks.append(Table(
            ("baseline", "device", "devices", "samples/s", "samples/s per device", "model", "precision",
             "batch per device", "kind", "source"),
            tuple(
                (
                    str(b["name"]), str(b["device"]), str(int(b["devices"])), _fmt(b["samples_per_s"]),
                    _fmt(float(b["samples_per_s"]) / int(b["devices"])),
                    "" if pd.isna(b["model"]) else str(b["model"]),
                    "" if pd.isna(b["precision"]) else str(b["precision"]),
                    "" if pd.isna(b["batch_per_device"]) else str(b["batch_per_device"]),
                    str(b["kind"]), str(b["source"]),
                )
                for _, b in baselines.iterrows()
            ),
        ))
        names = list(dict.fromkeys(baselines["name"]))
        for (study, strategy), group in comparisons.groupby(["study", "strategy"], sort=False):
            study_runs = runs[runs["study"] == study]
            cells = {(int(r["world_size"]), r["baseline"]): r for _, r in group.iterrows()}
            rows = []
            for n in sorted({n for n, _ in cells}):
                rows.append((
                    f"{n} {_unit(study_runs, n)} here",
                    *(
                        f"{cells[(n, name)]['times']:.2f}x ({cells[(n, name)]['times_per_device']:.2f}x per device)"
                        for name in names
                    ),
                ))
            blocks += [
                Heading(3, f"{study} ({strategy}) versus the baselines"),
                Paragraph("Each cell: N here = X times that baseline's total throughput (and X per device)."),
                Table(("N", *names), tuple(rows)),
            ]
            notes = []
            for name in names:
                verdict = checks.baseline(str(name), str(study), str(strategy))
                if verdict is not None and not verdict.like_for_like:
                    notes.append(f"{name}: not like for like ({verdict.why_not}{_differences(verdict)}); "
                                 "its ratios compare different work and are no result.")
                elif verdict is not None and verdict.differences:
                    notes.append(f"{name}: like for like except {'; '.join(verdict.differences)}.")
            if notes:
                blocks.append(Bullets(tuple(notes)))
    return blocks


def _restart_blocks(data: Ingested) -> list[Block]:
    """The runs whose step was restarted inside the job (a lost or hung node left out), each restart marked."""
    from cyclone_kit.rundir.restarts import restart_line

    if not data.restarts:
        return []
    lines = []
    for run_dir, entry in data.restarts:
        line = f"{run_dir}: {restart_line(entry)}"
        if entry.get("shrunk"):
            line += (f". The segments after it ran on {entry.get('world_size_after')} ranks, not "
                     f"{entry.get('world_size_before')}: this run's throughput mixes world sizes")
        lines.append(line)
    return [Heading(2, "In-job restarts"),
            Paragraph("Steps started again inside the same job (no requeue): the node left out, the time from "
                      "the fault to the first step again, the steps recomputed from the newest checkpoint."),
            Bullets(tuple(lines))]


def _incomplete_blocks(data: Ingested) -> list[Block]:
    """The runs left out of the table, and why."""
    blocks: list[Block] = []
    incomplete = data.incomplete_runs
    blocks.append(Heading(2, "Incomplete runs"))
    if incomplete.empty:
        blocks.append(Paragraph("None: every run ended with status completed."))
    else:
        blocks.append(Paragraph("Left out of the table (the last segment did not complete):"))
        blocks.append(Table(
            ("run", "study", "N", "status", "reason", "segments", "corrupt lines"),
            tuple(
                (
                    str(r["run_dir"]), str(r["study"]), _fmt(r["world_size"], 0), str(r["status"]),
                    str(r["incomplete_reason"]), str(int(r["segments"])), str(int(r["corrupt_lines"])),
                )
                for _, r in incomplete.iterrows()
            ),
        ))
    return blocks


def _timing_blocks(data: Ingested) -> list[Block]:
    """Median step and data time per point."""
    blocks: list[Block] = []
    runs = data.runs
    timing = step_timing(data.steps, runs)
    if not timing.empty:
        blocks.append(Heading(2, "Step timing"))
        blocks.append(Paragraph(
            "Median time per training step and waiting for data (complete runs, all step records). "
            "A high data share means the run is input-bound: faster data loading (more workers, "
            "local copies of the dataset) helps before more GPUs do."
        ))
        blocks.append(Table(
            ("study", "strategy", "N", "step records", "step time (ms)", "data time (ms)", "data share"),
            tuple(
                (
                    str(r["study"]), str(r["strategy"]), str(int(r["world_size"])), str(int(r["step_records"])),
                    _fmt(1000.0 * r["step_time_s"], 1), _fmt(1000.0 * r["data_time_s"], 1), _pct(r["data_share"]),
                )
                for _, r in timing.iterrows()
            ),
        ))
    return blocks


def _rank_blocks(data: Ingested) -> list[Block]:
    """Per-rank throughput: stragglers and peak memory."""
    blocks: list[Block] = []
    ranks = data.ranks
    if not ranks.empty:
        blocks.append(Heading(2, "Per-rank throughput (stragglers)"))
        rows = []
        for run_dir, group in ranks.groupby("run_dir", sort=False):
            speeds = group["samples_per_s"].dropna()
            if speeds.empty:
                continue
            slow = group.loc[speeds.idxmin()]
            ratio = float(speeds.min() / speeds.median()) if speeds.median() > 0 else math.nan
            memory = group["peak_memory_bytes"].max()
            rows.append((
                str(run_dir), str(len(group)), f"rank {_fmt(slow['rank'], 0)} on {slow['host']}",
                _fmt(ratio, 2) + (" (straggler)" if ratio < 0.9 else ""),
                "" if pd.isna(memory) else f"{float(memory) / 2**30:.2f}",
            ))
        blocks.append(Table(("run", "ranks", "slowest", "slowest / median", "peak memory (GiB)"), tuple(rows)))
    return blocks


def _quality_blocks(data: Ingested) -> list[Block]:
    """Lines skipped while reading the metrics."""
    blocks: list[Block] = []
    blocks.append(Heading(2, "Data quality"))
    if data.warnings:
        blocks.append(Bullets(data.warnings))
    else:
        blocks.append(Paragraph("Every metrics line was read; no corrupt or truncated lines."))
    return blocks


def _definition_blocks() -> list[Block]:
    """The definitions of every figure in the report."""
    blocks: list[Block] = []
    blocks += [
        Heading(2, "Definitions"),
        Bullets((
            "Throughput of a run: samples/s (global, steady state) from its end record; a requeued "
            "run counts once, with the throughput of its completed segment(s).",
            "T(N): median over repeats at world size N; min - max shows the spread.",
            "Speed-up S(N) = T(N) / T(N0), N0 = the smallest world size of the study.",
            "Efficiency: strong = S(N) x N0 / N; weak = (T(N)/N) / (T(N0)/N0).",
            "Karp-Flatt e = (1/S - 1/p) / (1 - 1/p), p = N / N0: the experimentally determined "
            "serial fraction; growing e with N points at overhead (communication), not serial code. "
            "e < 0 (superlinear) and e > 1 (slower than N0) are flagged: they are no serial fraction.",
            "Prediction: Amdahl's law S = 1 / (s + (1 - s)/p) fitted to strong studies, Gustafson's "
            "S = p - s (p - 1) to weak ones (least squares). A fit at a bound of [0, 1] or with an RMSE "
            "above 10 % of the speed-ups is reported as no meaningful fit and not drawn; a meaningful one "
            "is extrapolated (dashed, shaded) by no more doublings than were measured, at most 4x.",
            f"Measured too briefly: fewer than {MIN_STEADY_WINDOWS} steady-state step records or less than "
            f"{MIN_MEASURED_S:g} s of steady state in a run (the first step record of a segment is warm-up).",
            "Cost: device-hours per 1M samples = N / T(N) x 10^6 / 3600; relative cost = that over the "
            "same at N0 = p / S = 1 / efficiency. runs.csv: device_hours = allocated devices x elapsed "
            "(source sacct: AllocTRES gres/gpu, else the world size, x Elapsed of every allocation; "
            "source records: world size x the wall time in the end records).",
            "Energy: sacct ConsumedEnergy when non-zero, else the ranks' NVML energy (GPU runs with "
            "nvidia-ml-py); joules per sample = energy / (steps x global batch).",
            "Baselines: a headline ratio only like for like (same model and precision, stated, and the "
            "same per-device batch when the baseline states it); a different device is stated, not refused.",
        )),
    ]
    return blocks



def _cost_blocks(
    data: Ingested,
    table: pd.DataFrame,
    fits: Sequence[ScalingFit],
    checks: Review,
    usage: pd.DataFrame,
    accounting_note: str,
) -> list[Block]:
    """The "Cost of scaling" section: device-hours per sample, relative cost, energy, predictions."""
    if table.empty:
        return []
    runs = data.runs
    points = cost_points(table, runs, usage)
    blocks: list[Block] = [Heading(2, "Cost of scaling")]
    for (study, strategy), group in points.groupby(["study", "strategy"], sort=False):
        study_runs = runs[runs["study"] == study]
        one = _unit(study_runs, 1)
        base = group.loc[group["world_size"].idxmin()]
        n0 = int(base["world_size"])
        factor, per = _solution_cost(str(strategy), study_runs)
        what = "one solution (a whole run of the script) takes" if per == "per solution" else "1M samples take"
        sentences = [
            f"{study} ({strategy}): at N0 = {n0} {_unit(study_runs, n0)}, {what} "
            f"{_hours(base['device_hours_per_1m_samples'] * factor)} {one}-hours."
        ]
        for _, row in group[group["world_size"] != n0].iterrows():
            n = int(row["world_size"])
            sentences.append(
                f"{n} {_unit(study_runs, n)} are {float(row['speedup']):.2f} times as fast for "
                f"{float(row['relative_cost']):.2f} times the {one}-hours {per.replace('1M samples', 'sample')} "
                f"({_hours(row['device_hours_per_1m_samples'] * factor)} {per})."
            )
        fit = next((f for f in fits if f.study == study and f.strategy == strategy), None)
        verdict = checks.fit(str(study), str(strategy))
        if fit is not None and verdict is not None and verdict.targets():
            predicted = fit.predict(list(verdict.targets()))
            per_million = float(base["device_hours_per_1m_samples"]) * factor
            sentences.append("Predicted by the " + fit.law.capitalize() + " fit (extrapolation): " + "; ".join(
                f"{n} {_unit(study_runs, n)}: {s:.2f} times as fast for {n / n0 / s:.2f} times the cost "
                f"({per_million * n / n0 / s:.3g} {one}-hours {per})"
                for n, s in zip(verdict.targets(), predicted, strict=True)
            ) + ".")
        elif fit is not None and verdict is not None and not verdict.meaningful:
            sentences.append("No cost prediction: no meaningful fit.")
        energy = group["joules_per_sample"].dropna()
        if energy.empty:
            sentences.append("Energy: not measured (no sacct ConsumedEnergy, no NVML readings).")
        else:
            sentences.append("Energy: " + "; ".join(
                f"N = {int(r['world_size'])}: {float(r['joules_per_sample']):.3g} J per sample"
                for _, r in group.dropna(subset=["joules_per_sample"]).iterrows()
            ) + ".")
        blocks.append(Paragraph(" ".join(sentences)))
    sources = usage["device_hours_source"].replace("", pd.NA).dropna()
    counts = sources.value_counts()
    where = ", ".join(f"{count} from {source}" for source, count in counts.items()) or "none known"
    note = f" Not from sacct: {accounting_note}." if accounting_note else ""
    blocks.append(Paragraph(
        f"Device-hours per run (runs.csv, device_hours): {where}.{note} Records-based hours count the "
        "training segments only (no start-up or queue time)."
    ))
    return blocks


def explain_blocks(explanation: Explanation | None) -> list[Block]:
    """Where the time goes at every N, what ate the efficiency, what to change, and predicted vs measured."""
    if explanation is None or explanation.points.empty:
        return []
    points = explanation.points
    blocks: list[Block] = [Heading(3, "Where the time goes")]
    if not points["phases"].any():
        blocks.append(Paragraph(
            "The step records carry no phases (compute, gradient all-reduce): only the data wait is known, so the "
            "step is not broken down and no cause is named. Runs of this version's built-in engine, or scripts that "
            "call ck.instrument, record the phases. (A prediction may still be calibrated on a 1-rank run: it "
            "communicates nothing, so its compute is its step time minus its data wait.)"))
    blocks.append(Table(breakdown_header(), tuple(breakdown_rows(points))))
    blocks.append(Image(f"breakdown-{figure_stem(explanation.study)}", "Where the time goes: ms per step at every N"))
    for _, p in points.iterrows():
        if p["cores_per_rank"] < p["threads"]:  # NaN compares False: unknown cores say nothing
            blocks.append(Paragraph(
                f"At N = {int(p['world_size'])} the ranks shared cores: {p['cores_per_rank']:.2g} core(s) per rank "
                f"(their CPU affinity, counted once per machine) for {p['threads']:.0f} compute thread(s) each. "
                "Compute slows there because of the machine, not the network."))
    diagnosis = explanation.diagnosis
    if diagnosis is not None:
        blocks.append(Paragraph(diagnosis.sentence))
        advice = recommendations(diagnosis)
        if advice:
            blocks += [Paragraph("What acts on that cause:"), Bullets(advice)]
    forecast = explanation.forecast
    if forecast is None:
        if explanation.no_forecast:
            blocks.append(Paragraph(f"No prediction: {explanation.no_forecast}."))
        return blocks
    prediction = forecast.prediction
    label = "published network figures (not measured here)" if forecast.network.published else \
        "the network figures doctor measured"
    blocks.append(Heading(3, "Predicted and measured"))
    blocks.append(Paragraph(
        f"The performance model (cyclone_kit.analysis.predict), calibrated on the study's 1-node run and {label} "
        f"({forecast.network.origin}); the band is the calibration's step-time spread (10th - 90th percentile)."))
    predicted = {p.world_size: (p.efficiency, p.efficiency_low, p.efficiency_high) for p in prediction.points}
    nodes = {p.world_size: p.nodes for p in prediction.points}
    blocks.append(Table(("N", "nodes", "measured efficiency", "predicted (band)", "error (points)"),
                        tuple(error_rows(forecast.measured, predicted, nodes))))
    blocks.append(Image(f"prediction-{figure_stem(explanation.study)}", "Efficiency: predicted (with band) and measured"))
    if prediction.notes:
        blocks.append(Bullets(prediction.notes))
    blocks += [Paragraph("The prediction assumes:"), Bullets(prediction.assumptions)]
    return blocks


def figure_stem(study: str) -> str:
    """A file-name-safe form of a study name."""
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in str(study))
