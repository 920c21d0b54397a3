"""Synthetic ``metrics.jsonl`` runs and studies, for tests, benchmarks and demos.

Every record is built by :mod:`cyclone_kit.rundir.contract`, the metrics contract (schema 1) that the
training runtime writes through too, so synthetic studies cannot drift from real ones.
:func:`run_records` is pure; :func:`write_run` and :func:`write_study` write files.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cyclone_kit.rundir import contract
from cyclone_kit.rundir.layout import RunDir, StudyDir

_TIME = "2026-01-01T00:00:00Z"


@dataclass(frozen=True)
class SyntheticRun:
    """One synthetic run.

    Attributes:
        world_size: number of ranks.
        samples_per_s: the global steady-state throughput each completed segment reports.
        per_device_batch_size: batch per rank.
        num_nodes: nodes used.
        statuses: the ``end`` status of each segment, in order; None for a segment cut off
            without an ``end`` record (a crash).
        steps: step records per segment.
        strategy: ddp, fsdp, ...
        device: ``"cpu"`` or ``"cuda"``.
        device_name: e.g. ``Tesla V100-SXM2-32GB``.
        model: model name.
        dataset: dataset name.
        segment_samples_per_s: override of the throughput per segment (same length as statuses).
    """

    world_size: int
    samples_per_s: float
    per_device_batch_size: int = 32
    num_nodes: int = 1
    statuses: tuple[str | None, ...] = ("completed",)
    steps: int = 5
    strategy: str = "ddp"
    device: str = "cuda"
    device_name: str = "Tesla V100-SXM2-32GB"
    model: str = "resnet50"
    dataset: str = "synthetic"
    segment_samples_per_s: tuple[float, ...] | None = None


def run_records(run: SyntheticRun, run_id: str = "run") -> list[dict[str, Any]]:
    """The records of one synthetic run, segment after segment."""
    records: list[dict[str, Any]] = []
    step = 0
    for index, status in enumerate(run.statuses):
        throughput = run.segment_samples_per_s[index] if run.segment_samples_per_s else run.samples_per_s
        records.append(contract.start_record(
            run_id=run_id, world_size=run.world_size, num_nodes=run.num_nodes,
            local_world_size=max(run.world_size // run.num_nodes, 1),
            per_device_batch_size=run.per_device_batch_size,
            global_batch_size=run.per_device_batch_size * run.world_size,
            model=run.model, dataset=run.dataset, precision="fp32", strategy=run.strategy,
            launcher="slurm", device=run.device, device_name=run.device_name,
            hostnames=[f"gpu{n + 1:02d}" for n in range(run.num_nodes)],
            slurm_job_id=str(1000 + index), time=_TIME,
            versions={"torch": "2.4.0", "torchvision": "0.19.0", "cyclone_kit": "0.1.0"},
            git_commit=None, restart_count=index,
        ))
        global_batch = run.per_device_batch_size * run.world_size
        for _ in range(run.steps):
            step += 1
            records.append(contract.step_record(step, 0, 2.0 / step, global_batch / throughput, 0.001, throughput,
                                                _TIME))
        records.append(contract.epoch_record(0, 0.5, 1.0, _TIME))
        if status is not None:
            records.append(contract.end_record(status, step, throughput, 10.0, _TIME))
    return records


def metrics_text(records: Sequence[dict[str, Any]]) -> str:
    """JSON Lines text of the records (one object a line, newline-terminated)."""
    return "".join(json.dumps(r) + "\n" for r in records)


def write_run(run_dir: str | Path, run: SyntheticRun, *, extra_text: str = "") -> Path:
    """Write ``run_dir/metrics.jsonl`` for ``run`` (plus ``extra_text`` appended verbatim)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = RunDir(run_dir).metrics
    path.write_text(metrics_text(run_records(run, run_id=run_dir.name)) + extra_text, encoding="utf-8")
    return path


def write_study(
    root: str | Path,
    study: str,
    mode: str | None,
    runs: Sequence[tuple[str, SyntheticRun]],
    *,
    repeats: Sequence[int] | None = None,
) -> Path:
    """Write a study directory: ``sweep.json`` (when ``mode`` is given) and one run per point.

    Args:
        root: the parent directory; the study goes to ``root/study``.
        study: the study name.
        mode: ``"strong"``, ``"weak"``, or None to write no ``sweep.json``.
        runs: (point name, run) pairs; each run goes to ``root/study/<name>``.
        repeats: the repeat index of each point (default all 0).

    Returns:
        The study directory.
    """
    study_dir = Path(root) / study
    points = []
    for index, (name, run) in enumerate(runs):
        write_run(study_dir / name, run)
        points.append({
            "name": name, "world_size": run.world_size, "nodes": run.num_nodes,
            "ntasks_per_node": max(run.world_size // run.num_nodes, 1),
            "per_device_batch_size": run.per_device_batch_size,
            "repeat": repeats[index] if repeats else 0, "run_dir": name,
        })
    if mode is not None:
        sweep = {"schema": 1, "kind": "sweep", "study": study, "mode": mode, "base_spec": {}, "points": points}
        StudyDir(study_dir).sweep.write_text(json.dumps(sweep, indent=2), encoding="utf-8")
    return study_dir
