"""The report's pipeline section: the bubble each stage measured against the ideal, and the stage balance.

Pure over a run's records (:func:`pipeline_summary`), plus :func:`pipeline_sections`, which reads
the metrics file of each run directory through the contract. The ideal idle fraction of a
pipeline step with P stages and M micro-batches is (P-1)/(M+P-1) (GPipe and 1F1B; interleaved
1F1B with v stages per rank: (P-1)/(vM+P-1)); the measured one is a stage's idle time over its
compute plus idle time in the schedule's steps (the first step record of a segment is warm-up
and left out). Torch-free; pandas-free.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cyclone_kit.rundir.contract import METRICS_FILE, PIPELINE_STEP_FIELDS


def ideal_bubble(stages: int, microbatches: int, virtual: int = 1) -> float:
    """(P-1)/(vM+P-1): the idle fraction of an ideal pipeline step (equal stages, free transfers)."""
    return (stages - 1) / (virtual * microbatches + stages - 1)


@dataclass(frozen=True)
class Section:
    """One pipeline run's section: a title, a paragraph, and a table (plain text)."""

    title: str
    text: str
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


def pipeline_summary(records: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The pipeline figures of one run's records (None for a run that is no pipeline, pure).

    Returns:
        ``stages``, ``replicas``, ``microbatches``, ``virtual``, ``schedule``, ``ideal``
        (the ideal bubble), ``balance`` (the start record's split), and per stage
        ``compute_s``, ``idle_s`` (mean seconds per optimizer step) and ``bubble`` (measured).
    """
    starts = [r for r in records if r.get("kind") == "start" and r.get("strategy") == "pipeline"]
    if not starts or "stages" not in starts[0]:
        return None
    start = starts[-1]
    p, m, v = int(start["stages"]), int(start.get("microbatches", 1)), int(start.get("virtual_stages", 1))
    steady: list[Mapping[str, Any]] = []
    seen_start = False
    for rec in records:  # skip the first step record after every start (warm-up)
        if rec.get("kind") == "start":
            seen_start = True
        elif rec.get("kind") == "step" and all(f in rec for f in PIPELINE_STEP_FIELDS):
            if seen_start:
                seen_start = False
            else:
                steady.append(rec)
    if not steady:
        steady = [r for r in records if r.get("kind") == "step" and all(f in r for f in PIPELINE_STEP_FIELDS)]
    compute = [sum(r["stage_compute_s"][i] for r in steady) / len(steady) for i in range(p)] if steady else []
    idle = [sum(r["stage_idle_s"][i] for r in steady) / len(steady) for i in range(p)] if steady else []
    bubble = [i / (c + i) if c + i > 0 else None for c, i in zip(compute, idle, strict=True)]
    return {"stages": p, "replicas": int(start.get("replicas", 1)), "microbatches": m, "virtual": v,
            "schedule": start.get("pipeline_schedule", "gpipe"), "ideal": ideal_bubble(p, m, v),
            "balance": start.get("balance") or {}, "compute_s": compute, "idle_s": idle, "bubble": bubble,
            "windows": len(steady), "model": start.get("model", "")}


def _stage_blocks(balance: Mapping[str, Any], virtual: int, stages: int) -> list[str]:
    """The blocks of each pipeline position, e.g. ``layer1.0-layer2.1`` (pure)."""
    names, cuts = balance.get("blocks") or [], balance.get("cuts") or []
    out = []
    for p in range(stages):
        spans = []
        for s in (p + k * stages for k in range(virtual)):
            if s + 1 < len(cuts):
                a, b = cuts[s], cuts[s + 1]
                spans.append(names[a] if b - a == 1 else f"{names[a]}..{names[b - 1]}")
        out.append(", ".join(spans))
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def section(run: str, summary: Mapping[str, Any]) -> Section:
    """The report section of one pipeline run (pure)."""
    p, v, bal = summary["stages"], summary["virtual"], summary["balance"]
    stage_times = bal.get("stage_times_s") or []
    per_position = [sum(stage_times[q + k * p] for k in range(v) if q + k * p < len(stage_times))
                    for q in range(p)]
    mean = sum(per_position) / len(per_position) if per_position else 0.0
    rows = []
    names = _stage_blocks(bal, v, p)
    for q in range(p):
        share = per_position[q] / mean if mean else None
        rows.append((str(q), names[q] if q < len(names) else "",
                     f"{per_position[q] * 1000:.1f}" if q < len(per_position) else "-",
                     "-" if share is None else f"{share:.2f}",
                     f"{summary['compute_s'][q] * 1000:.1f}" if summary["compute_s"] else "-",
                     f"{summary['idle_s'][q] * 1000:.1f}" if summary["idle_s"] else "-",
                     _pct(summary["bubble"][q]) if summary["bubble"] else "-", _pct(summary["ideal"])))
    limited = bal.get("granularity_limited")
    ratio = bal.get("max_over_mean")
    text = (f"{summary['model']}: {p} stage(s) x {summary['replicas']} replica(s), {summary['schedule']}, "
            f"M = {summary['microbatches']} micro-batches"
            + (f", {v} stages per rank" if v > 1 else "")
            + f". Ideal bubble (P-1)/({'vM' if v > 1 else 'M'}+P-1) = {_pct(summary['ideal'])}. "
            + (f"Split balanced by measured block time: slowest stage / mean = {ratio:.2f}" if ratio else "")
            + (" (the block granularity cannot do better: one block outweighs a fair share)." if limited else ".")
            + f" Measured over {summary['windows']} steady step record(s).")
    return Section(f"Pipeline ({run})", text,
                   ("stage", "blocks", "split time ms", "split / mean", "compute ms/step", "idle ms/step",
                    "bubble measured", "bubble ideal"), tuple(rows))


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    """The records of ``run_dir``'s metrics file (lines that do not parse are skipped)."""
    path = Path(run_dir) / METRICS_FILE
    out = []
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                out.append(rec)
    return out


def pipeline_sections(run_dirs: Iterable[str | Path]) -> list[Section]:
    """A section for every pipeline run among ``run_dirs`` (others are skipped)."""
    out = []
    for run_dir in run_dirs:
        summary = pipeline_summary(read_records(Path(run_dir)))
        if summary is not None:
            out.append(section(Path(run_dir).name, summary))
    return out
