"""Baselines (``--baseline NAME=PATH``): other platforms' throughput to compare a study with.

PATH is a run directory, a study directory or a ``metrics.jsonl`` written by this tool on another
platform (e.g. ``run SPEC --nproc 1`` on Colab or Kaggle), or a CSV of published rows with at least
the columns ``name``, ``device``, ``samples_per_s`` (optional: ``devices``, ``model``, ``dataset``,
``precision``, ``batch_per_device``, ``source``, ``kind``). Each baseline's ``samples_per_s`` is
the total throughput of its ``devices`` (default 1).
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import pandas as pd

from cyclone_kit.analysis.ingest import MetricsWarning, load_runs
from cyclone_kit.core.errors import ValidationError

#: Baseline table columns.
BASELINE_COLUMNS = (
    "name", "device", "devices", "samples_per_s", "model", "dataset", "precision", "batch_per_device", "kind",
    "source",
)

#: Plot file stems written to OUT (each as .png at 300 dpi and .svg with editable text).



def parse_baseline_spec(spec: str) -> tuple[str, Path]:
    """Split a ``NAME=PATH`` baseline argument.

    Raises:
        ValidationError: no ``=``, or an empty name or path.
    """
    name, sep, path = spec.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValidationError(
            f"baseline {spec!r} is not NAME=PATH",
            hint="write e.g. --baseline colab=runs/colab-1gpu or "
            "--baseline published=analysis/reference_baselines.csv",
        )
    return name.strip(), Path(path.strip())


def _baselines_from_csv(name: str, path: Path) -> pd.DataFrame:
    """Rows of a published-baselines CSV."""
    try:
        # Whole-line comments only: a '#' inside a quoted source field must survive.
        text = "".join(line for line in path.read_text(encoding="utf-8").splitlines(keepends=True)
                       if not line.lstrip().startswith("#"))
        frame = pd.read_csv(io.StringIO(text))
    except (OSError, ValueError) as exc:
        raise ValidationError(f"baseline {name}: cannot read {path}: {exc}",
                              hint="pass a CSV with columns name,device,samples_per_s") from exc
    missing = [c for c in ("name", "device", "samples_per_s") if c not in frame.columns]
    if missing:
        raise ValidationError(
            f"baseline {name}: {path} lacks column(s) {', '.join(missing)}",
            hint="a baseline CSV needs the columns name,device,samples_per_s "
            "(optional: devices,model,dataset,precision,batch_per_device,source,kind)",
        )
    frame = frame.copy()
    frame["samples_per_s"] = pd.to_numeric(frame["samples_per_s"], errors="coerce")
    bad = frame["samples_per_s"].isna() | (frame["samples_per_s"] <= 0)
    if bad.any():
        rows = ", ".join(str(i + 2) for i in frame.index[bad])
        raise ValidationError(f"baseline {name}: {path} has no positive samples_per_s on line(s) {rows}",
                              hint="every row needs a positive number in samples_per_s")
    for column in BASELINE_COLUMNS:
        if column not in frame.columns:
            frame[column] = pd.NA
    frame["devices"] = pd.to_numeric(frame["devices"], errors="coerce").fillna(1).astype(int)
    frame["batch_per_device"] = pd.to_numeric(frame["batch_per_device"], errors="coerce").astype("Int64")
    frame["kind"] = frame["kind"].fillna("published")
    frame["source"] = frame["source"].fillna(str(path))
    return frame[list(BASELINE_COLUMNS)]


def _baselines_from_runs(name: str, path: Path) -> pd.DataFrame:
    """One row: the smallest-world-size complete runs found under ``path`` (median)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MetricsWarning)
        data = load_runs([path], warn=False)
    runs = data.complete_runs
    if runs.empty:
        raise ValidationError(f"baseline {name}: no completed run under {path}",
                              hint="pass a run directory whose metrics.jsonl ends with status completed")
    smallest = runs[runs["world_size"] == runs["world_size"].min()]
    first = smallest.iloc[0]
    device = first["device_name"] if pd.notna(first["device_name"]) and first["device_name"] else first["device"]
    return pd.DataFrame(
        [
            {
                "name": name,
                "device": device,
                "devices": int(first["world_size"]),
                "samples_per_s": float(smallest["samples_per_s"].median()),
                "model": first["model"],
                "dataset": first["dataset"],
                "precision": first["precision"],
                "batch_per_device": first["per_device_batch_size"],
                "kind": "measured",
                "source": f"{path} ({len(smallest)} run(s), median)",
            }
        ],
        columns=list(BASELINE_COLUMNS),
    )


def load_baseline(name: str, path: str | Path) -> pd.DataFrame:
    """Load one ``--baseline`` as rows of :data:`BASELINE_COLUMNS`.

    Args:
        name: the NAME given (the row name for run baselines).
        path: a CSV of published rows, or a run/study directory or ``metrics.jsonl``.

    Raises:
        ValidationError: the path does not exist, or holds nothing usable.
    """
    path = Path(path)
    if not path.exists():
        raise ValidationError(f"baseline {name}: {path} does not exist",
                              hint="pass an existing run directory, metrics.jsonl or CSV")
    if path.is_file() and path.suffix.lower() == ".csv":
        return _baselines_from_csv(name, path)
    return _baselines_from_runs(name, path)
