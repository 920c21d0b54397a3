"""Scaling analysis: read ``metrics.jsonl`` runs, compute speed-up and efficiency, plot, report.

Typical use::

    from cyclone_kit.analysis import load_runs, scaling_table, fit_scaling_laws
    from cyclone_kit.analysis import plots

    data = load_runs(["runs/strong"])            # runs, steps, epochs, ranks tables
    table = scaling_table(data.runs)             # one row per (study, strategy, world size)
    fits = fit_scaling_laws(table)               # Amdahl (strong) / Gustafson (weak)
    plots.speedup_figure(table, fits)            # a matplotlib Figure

``write_report`` (the ``report`` command) writes everything to a directory. What a report may
state is decided in :mod:`cyclone_kit.analysis.honesty` (``review(runs, steps, table, fits)``),
what scaling costs in :mod:`cyclone_kit.analysis.cost`; the notebook finds studies with
:mod:`cyclone_kit.analysis.locate`. Importing this package imports pandas and numpy;
matplotlib is imported only by ``plots`` and ``report``.
"""

from __future__ import annotations

from typing import Any

from cyclone_kit.analysis.ingest import (
    Ingested,
    MetricsWarning,
    find_metrics_files,
    load_runs,
    parse_metrics_text,
    summarize_run,
)
from cyclone_kit.analysis.scaling import (
    SCALING_COLUMNS,
    ScalingFit,
    add_scaling_metrics,
    aggregate_runs,
    amdahl_speedup,
    compare_to_baselines,
    fit_amdahl,
    fit_gustafson,
    fit_scaling_laws,
    gustafson_speedup,
    infer_mode,
    karp_flatt,
    scaling_table,
    step_timing,
)

__all__ = [
    "SCALING_COLUMNS",
    "Ingested",
    "MetricsWarning",
    "ScalingFit",
    "add_scaling_metrics",
    "aggregate_runs",
    "amdahl_speedup",
    "compare_to_baselines",
    "find_metrics_files",
    "fit_amdahl",
    "fit_gustafson",
    "fit_scaling_laws",
    "gustafson_speedup",
    "infer_mode",
    "karp_flatt",
    "load_baseline",
    "load_runs",
    "parse_metrics_text",
    "scaling_table",
    "step_timing",
    "summarize_run",
    "write_report",
]


def __getattr__(name: str) -> Any:
    """Import the matplotlib-using report functions only when asked for."""
    if name in ("write_report", "load_baseline"):
        from cyclone_kit.analysis import report

        return getattr(report, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
