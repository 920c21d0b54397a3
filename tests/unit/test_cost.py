"""Issue 15.2/15.3: device-hours per 1M samples, device-hours and energy per run, the cost section and plot."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pandas as pd
import pytest

from cyclone_kit.analysis.cost import cost_points, matching_allocations, usage_table
from cyclone_kit.analysis.ingest import load_runs
from cyclone_kit.analysis.report import write_report
from cyclone_kit.analysis.scaling import device_hours_per_1m_samples, scaling_table
from cyclone_kit.analysis.synthetic import SyntheticRun, write_study
from cyclone_kit.core.errors import ParseError
from cyclone_kit.slurm.accounting import (
    JobUsage,
    accounting_disabled,
    parse_sacct_usage,
    parse_tres,
    sacct_usage_argv,
)

OUTPUT = Path(__file__).parent / "slurm_output"
Gpu = partial(SyntheticRun, model="resnet50", per_device_batch_size=64, steps=40)


def test_report_gives_exact_device_hours_per_1m_samples(tmp_path: Path) -> None:
    study = write_study(tmp_path, "cost", "strong", [
        ("n1", Gpu(1, 250.0)), ("n2", Gpu(2, 400.0)), ("n4", Gpu(4, 720.0, num_nodes=2)),
    ])
    write_report([study], tmp_path / "out", accounting=False)
    table = pd.read_csv(tmp_path / "out" / "scaling.csv")
    # N / samples_per_s x 1e6 / 3600: 1/250 -> 1.1111, 2/400 -> 1.3889, 4/720 -> 1.5432 GPU-hours.
    expected = [1 / 250 * 1e6 / 3600, 2 / 400 * 1e6 / 3600, 4 / 720 * 1e6 / 3600]
    assert table["device_hours_per_1m_samples"].tolist() == pytest.approx(expected, rel=1e-12)
    assert device_hours_per_1m_samples(4, 720.0) == pytest.approx(1.5432098765432098, rel=1e-12)
    assert pd.isna(device_hours_per_1m_samples(1, 0.0))

    runs = pd.read_csv(tmp_path / "out" / "runs.csv")
    # No accounting: world size x the end records' wall time (10 s per segment in synthetic runs).
    assert runs["device_hours_source"].tolist() == ["records"] * 3
    assert runs["device_hours"].tolist() == pytest.approx([10 / 3600, 20 / 3600, 40 / 3600], rel=1e-12)
    assert runs["energy_source"].tolist() == ["not measured"] * 3 and runs["energy_j"].isna().all()

    md = (tmp_path / "out" / "report.md").read_text()
    assert ("cost (ddp): at N0 = 1 GPU, 1M samples take 1.11 GPU-hours. 2 GPUs are 1.60 times as fast for "
            "1.25 times the GPU-hours per sample (1.39 per 1M samples). 4 GPUs are 2.88 times as fast for "
            "1.39 times the GPU-hours per sample (1.54 per 1M samples).") in md
    # Amdahl at 8 and 16 GPUs (two doublings measured): speed-up and cost both predicted.
    assert "Predicted by the Amdahl fit (extrapolation): 8 GPUs: " in md and "16 GPUs: " in md
    assert "Energy: not measured (no sacct ConsumedEnergy, no NVML readings)." in md
    assert "Device-hours per run (runs.csv, device_hours): 3 from records." in md
    assert "![Speed-up against relative cost" in md and (tmp_path / "out" / "cost.svg").is_file()
    assert "| device-h / 1M samples |" in md


def test_energy_from_rank_summaries_gives_joules_per_sample(tmp_path: Path) -> None:
    study = write_study(tmp_path, "e", "strong", [("n1", Gpu(1, 250.0)), ("n2", Gpu(2, 400.0))])
    for name, joules in (("n1", [5120.0]), ("n2", [3000.0, 3400.0])):
        ranks = study / name / "ranks"
        ranks.mkdir()
        for rank, energy in enumerate(joules):
            (ranks / f"rank-{rank:05d}.json").write_text(json.dumps(
                {"rank": rank, "host": "gpu01", "device": f"cuda:{rank}", "samples_per_s": 200.0,
                 "peak_memory_bytes": 2**30, "energy_j": energy}))
    result = write_report([study], tmp_path / "out", accounting=False)
    runs = pd.read_csv(tmp_path / "out" / "runs.csv")
    assert runs["energy_source"].tolist() == ["nvml", "nvml"]
    # n1: 40 steps x 64 samples = 2560 -> 5120 J / 2560 = 2 J; n2: 40 x 128 = 5120 -> 6400 / 5120 = 1.25 J.
    assert runs["joules_per_sample"].tolist() == pytest.approx([2.0, 1.25])
    md = (tmp_path / "out" / "report.md").read_text()
    assert "Energy: N = 1: 2 J per sample; N = 2: 1.25 J per sample." in md
    assert "not measured" not in md.split("## Cost of scaling")[1].split("##")[0]
    points = cost_points(result.table, result.data.runs, result.usage)
    assert points["relative_cost"].tolist() == pytest.approx([1.0, 2 / 1.6])


def _usage(job: str, start: str, end: str, elapsed: int, tres: str, energy: float | None = None) -> JobUsage:
    return JobUsage(job, "COMPLETED", start, end, elapsed, parse_tres(tres), energy)


def test_sacct_usage_wins_when_it_matches_the_run_in_time() -> None:
    runs = pd.DataFrame([{
        "run_dir": "r", "world_size": 8, "slurm_job_id": "77", "start_time": "2026-03-01T10:00:10+00:00",
        "end_time": "2026-03-01T10:09:50+00:00", "wall_time_s": 570.0, "steps": 100, "global_batch_size": 512,
    }])
    ranks = pd.DataFrame(columns=["run_dir", "energy_j"])
    # Requeued once: two allocations of job 77, 2 nodes x 4 GPUs, 300 s + 290 s, energy in the second only.
    accounting = {"77": [
        _usage("77", "2026-03-01T10:00:00+00:00", "2026-03-01T10:05:00+00:00", 300, "cpu=80,gres/gpu=8,node=2"),
        _usage("77", "2026-03-01T10:05:30+00:00", "2026-03-01T10:10:20+00:00", 290, "cpu=80,gres/gpu=8,node=2",
               energy=1.0e6),
        _usage("77", "2025-01-01T00:00:00+00:00", "2025-01-01T01:00:00+00:00", 3600, "gres/gpu=8"),  # id reused
    ]}
    assert len(matching_allocations(runs.iloc[0].to_dict(), accounting)) == 2
    usage = usage_table(runs, ranks, accounting).iloc[0]
    assert usage["device_hours_source"] == "sacct" and usage["devices"] == 8
    assert usage["device_hours"] == pytest.approx(8 * (300 + 290) / 3600)
    assert usage["energy_source"] == "sacct" and usage["energy_j"] == 1.0e6
    assert usage["joules_per_sample"] == pytest.approx(1.0e6 / (100 * 512))
    # A synthetic run's time matches no allocation: records.
    other = usage_table(runs.assign(start_time="2026-01-01T00:00:00Z", end_time="2026-01-01T00:00:00Z"), ranks,
                        accounting).iloc[0]
    assert other["device_hours_source"] == "records" and other["device_hours"] == pytest.approx(8 * 570 / 3600)


def test_sacct_usage_parser_on_captured_output() -> None:
    # Captured from the local cluster (Slurm 22.05, slurmdbd) with sacct_usage_argv(["14", ..., "28"]).
    usages = parse_sacct_usage((OUTPUT / "sacct_usage.txt").read_text())
    assert len(usages) == 16
    by_id: dict[str, list[JobUsage]] = {}
    for usage in usages:
        by_id.setdefault(usage.job_id, []).append(usage)
    done = by_id["22"][0]
    assert (done.state, done.start, done.end, done.elapsed_s) == (
        "COMPLETED", "2026-12-01T11:19:14", "2026-12-01T11:19:20", 6)
    assert done.tres == {"billing": 8, "cpu": 8, "node": 2} and done.gpus == 0  # no GPU TRES tracked here
    # A requeued job: one record per run (--duplicates), the requeued one with its elapsed time.
    assert [(u.state, u.elapsed_s) for u in by_id["27"]] == [("REQUEUED", 8), ("PENDING", 0)]
    cancelled = by_id["15"][0]  # cancelled before it started: no start, nothing allocated
    assert (cancelled.state, cancelled.start, cancelled.tres) == ("CANCELLED by 0", "", {})
    running = by_id["25"][0]
    assert (running.end, running.elapsed_s, running.energy_j) == ("", 2, None)
    assert all(u.energy_j is None for u in usages)  # the local cluster gathers no energy (0 or empty)
    # With AccountingStorageTRES=gres/gpu (gpu partition, 2 fake GPUs): the allocated GPUs.
    gpu_jobs = parse_sacct_usage((OUTPUT / "sacct_usage_gpu.txt").read_text())
    assert [(u.job_id, u.gpus, u.elapsed_s) for u in gpu_jobs] == [("86", 2, 0), ("91", 2, 12)]
    assert accounting_disabled((OUTPUT / "sacct_disabled.txt").read_text())
    assert not accounting_disabled("sacct: error: Invalid job id")
    with pytest.raises(ParseError, match="raw output"):
        parse_sacct_usage("1|2|3\n")
    assert parse_tres("billing=4,cpu=4,gres/gpu=2,mem=4G,node=1") == {
        "billing": 4, "cpu": 4, "gres/gpu": 2, "mem": 4096, "node": 1}
    argv = sacct_usage_argv(["12", "13_1"])
    assert argv[0] == "sacct" and "--jobs=12,13_1" in argv and "--duplicates" in argv and "--allocations" in argv


def test_scaling_table_cost_column_is_the_last_and_exact(tmp_path: Path) -> None:
    study = write_study(tmp_path, "s", "weak", [("a", Gpu(1, 100.0)), ("b", Gpu(2, 150.0))])
    table = scaling_table(load_runs(study).runs)
    assert table.columns[-1] == "device_hours_per_1m_samples"
    assert table["device_hours_per_1m_samples"].tolist() == pytest.approx([1e6 / 100 / 3600, 2e6 / 150 / 3600])
