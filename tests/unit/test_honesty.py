"""Issue 17.1: each honesty rule, triggered by a study, asserting the text and the absence of the bogus line."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pandas as pd
import pytest

from cyclone_kit.analysis import plots
from cyclone_kit.analysis.honesty import (
    MAX_RELATIVE_RMSE,
    baseline_verdict,
    fit_verdict,
    karp_flatt_flag,
    short_measurement,
)
from cyclone_kit.analysis.ingest import load_runs
from cyclone_kit.analysis.report import write_report
from cyclone_kit.analysis.scaling import ScalingFit, fit_scaling_laws, scaling_table
from cyclone_kit.analysis.synthetic import SyntheticRun, write_study

# A CPU study of a tiny CNN, measured long enough (40 step records, >= 12 s of steady state a run).
Cpu = partial(SyntheticRun, device="cpu", device_name=None, model="tiny_cnn", per_device_batch_size=32, steps=40)


def _report(tmp_path: Path, speeds: dict[int, float], baselines=(), **run_options) -> tuple[str, object]:
    """Write a strong study with the given N -> samples/s and report it; returns (report.md, result)."""
    study = write_study(tmp_path, "study", "strong", [
        (f"n{n}", Cpu(n, speed, num_nodes=1 if n <= 2 else 2, **run_options)) for n, speed in speeds.items()
    ])
    result = write_report([study], tmp_path / "out", baselines, accounting=False)
    return (tmp_path / "out" / "report.md").read_text(), result


def test_a_study_that_scales_badly_gets_no_fit_no_prediction_and_flagged_karp_flatt(tmp_path: Path) -> None:
    # The sweep: speed-up 1.00, 0.88, 0.62 with more CPU processes.
    md, result = _report(tmp_path, {1: 100.0, 2: 88.0, 4: 62.0})
    assert "No meaningful Amdahl fit (strategy ddp): the speed-up does not grow with N" in md
    assert "study (ddp): no meaningful fit: the speed-up does not grow with N" in md  # in Warnings
    for bogus in ("Amdahl fit (strategy ddp): serial fraction", "serial fraction s = 1.0000", "Predicted at", "Predicted by the"):
        assert bogus not in md, bogus
    assert "No cost prediction: no meaningful fit." in md
    # Karp-Flatt e = (1/0.88 - 1/2) / (1/2) = 1.2727 and (1/0.62 - 1/4) / (3/4) = 1.8172: flagged.
    assert "study (ddp) N=2: worse than serial (S < 1): slower than the baseline, e > 1 is not a serial " \
           "fraction (Karp-Flatt e = 1.2727)." in md
    assert "Karp-Flatt e = 1.8172" in md
    assert "| 1.2727 | " in md and "worse than serial (S < 1) |" in md  # the table cell carries the note
    assert "4 CPU processes here = 0.62 times the 1-CPU process baseline of this study (efficiency 15.5 %): " \
           "slower than the baseline, not faster." in md
    # Not drawn either: no fitted or predicted line, no extrapolated band.
    fig = plots.speedup_figure(result.table, result.fits)
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert not [label for label in labels if "Amdahl" in label], labels
    assert fig.axes[0].get_xlim()[1] < 8  # the axis ends at the data
    assert [f.serial_fraction for f in result.fits] == [1.0]  # the fit exists; the report refuses it
    page = (tmp_path / "out" / "report.html").read_text()
    assert "<h2>Warnings</h2>" in page and "No meaningful Amdahl fit" in page and "Predicted at" not in page


def test_superlinear_points_are_flagged_and_the_clamped_fit_is_refused(tmp_path: Path) -> None:
    md, _ = _report(tmp_path, {1: 100.0, 2: 230.0, 4: 480.0})
    # e = (1/2.3 - 1/2) / (1/2) = -0.1304
    assert "study (ddp) N=2: superlinear (S > p): e < 0 is not a serial fraction (Karp-Flatt e = -0.1304)." in md
    assert "No meaningful Amdahl fit (strategy ddp): the speed-ups are above ideal (superlinear)" in md
    assert "serial fraction s = 0.0000" not in md and "Predicted at" not in md
    assert "worse than serial" not in md


def test_points_measured_too_briefly_are_marked_and_long_ones_are_not(tmp_path: Path) -> None:
    md, _ = _report(tmp_path / "short", {1: 100.0, 2: 190.0, 4: 360.0}, steps=3)
    # 3 step records: the first is warm-up, 2 remain; N=4: 2 x 128/360 s = 0.7 s.
    assert ("study (ddp) N=4: measured over too little to trust: 2 steady-state step record(s) (need 5); "
            "0.7 s of steady state (need 5 s).") in md
    assert "(efficiency 90.0 %): measured too briefly to trust." in md  # the headline says so
    long_md, _ = _report(tmp_path / "long", {1: 100.0, 2: 190.0, 4: 360.0})
    assert "measured over too little" not in long_md and "measured too briefly" not in long_md
    assert "## Warnings" not in long_md  # a sound study has nothing to warn about
    assert "Amdahl fit (strategy ddp): serial fraction s = " in long_md


def test_an_unlike_baseline_gets_no_headline_ratio_but_a_like_one_does(tmp_path: Path) -> None:
    csv = tmp_path / "published.csv"
    csv.write_text(
        "name,device,devices,samples_per_s,model,dataset,precision,batch_per_device\n"
        "v100-resnet50,Tesla V100,1,367,resnet50,imagenet,fp32,256\n"
        "other-cpu,Xeon 6248,1,50,tiny_cnn,synthetic,fp32,32\n"
    )
    md, _ = _report(tmp_path, {1: 100.0, 2: 190.0, 4: 360.0}, baselines=[f"published={csv}"])
    assert ("study (ddp) vs v100-resnet50 (Tesla V100, 1 device(s)): no headline ratio, not like for like "
            "(model differs; per-device batch differs; differs: model resnet50 vs tiny_cnn; dataset imagenet vs "
            "synthetic; device Tesla V100 vs CPU; per-device batch 256 vs 32)") in md
    assert "study (ddp): no headline ratio against v100-resnet50: not like for like" in md  # in the Summary
    assert "here = 0.98 times v100-resnet50" not in md and "times v100-resnet50" not in md
    # Same model, precision and per-device batch: the headline ratio stands (360 / 50 = 7.20).
    assert "study (ddp): 4 CPU processes here = 7.20 times other-cpu (Xeon 6248, 1 device(s)); differs: device " \
           "Xeon 6248 vs CPU." in md
    # The raw ratios stay in the baseline table: 360 / 367 = 0.98.
    assert "| 4 CPU processes here | 0.98x (0.25x per device) | 7.20x (1.80x per device) |" in md


def test_extrapolation_stops_at_the_horizon_and_a_one_point_fit_says_so(tmp_path: Path) -> None:
    md, result = _report(tmp_path, {1: 100.0, 2: 180.0})
    # One doubling measured: predict at 2 x 2 = 4, not at 8.
    assert "Predicted at 4 CPU processes: speed-up " in md
    assert "No prediction at N = 8: beyond the extrapolation horizon N = 4" in md
    assert "at 8 CPU processes" not in md
    assert "Caveat: one point beyond N0: the law passes through it exactly" in md
    fig = plots.speedup_figure(result.table, result.fits)
    dashed = [line for line in fig.axes[0].get_lines() if line.get_linestyle() == "--"]
    assert len(dashed) == 1 and max(dashed[0].get_xdata()) == pytest.approx(4)


def test_a_law_that_misses_the_points_is_no_meaningful_fit() -> None:
    table = pd.DataFrame({"study": "s", "strategy": "ddp", "world_size": [1, 2, 4, 8],
                          "speedup": [1.0, 1.9, 1.2, 7.0]})
    fit = fit_scaling_laws(table.assign(mode="strong"))[0]
    verdict = fit_verdict(fit, table)
    assert not verdict.meaningful and "misses the measured speed-ups by" in verdict.reason
    assert verdict.targets() == () and verdict.horizon == 8
    good = fit_verdict(ScalingFit("s", "ddp", "amdahl", 0.05, 1, 0.001, 4), table.assign(speedup=[1.0, 1.9, 3.5, 5.9]))
    assert good.meaningful and good.horizon == 32 and good.targets() == (16, 32)
    assert MAX_RELATIVE_RMSE == 0.10


def test_rule_helpers_on_their_edges() -> None:
    assert karp_flatt_flag(0.05) == "" and karp_flatt_flag(float("nan")) == ""
    assert karp_flatt_flag(-0.2).startswith("superlinear") and karp_flatt_flag(1.3).startswith("worse than serial")
    assert short_measurement(5, 5.0) == ""
    assert short_measurement(4, 60.0) == "4 steady-state step record(s) (need 5)"
    runs = pd.DataFrame({"model": ["resnet50"], "precision": ["fp32"], "dataset": ["imagenet"],
                         "device": ["cuda"], "device_name": ["Tesla V100-SXM2-32GB"]})
    row = {"study": "s", "strategy": "ddp", "world_size": 16, "per_device_batch_size": 256}
    same = baseline_verdict({"name": "ref", "device": "V100", "model": "ResNet50", "precision": "FP32",
                             "dataset": "imagenet", "batch_per_device": 256}, runs, row)
    assert same.like_for_like and same.differences == ()
    unknown = baseline_verdict({"name": "ref", "device": "T4", "model": "resnet50"}, runs, row)
    assert not unknown.like_for_like and unknown.why_not == "the baseline does not state its precision"
    assert unknown.differences == ("device T4 vs Tesla V100-SXM2-32GB",)




def test_runs_table_sanity_for_the_rules(tmp_path: Path) -> None:
    """The measurement spans the short-measurement rule reads come from the step records."""
    study = write_study(tmp_path, "s", "strong", [("a", Cpu(1, 64.0, steps=6))])
    data = load_runs(study)
    from cyclone_kit.analysis.honesty import measurement_spans

    spans = measurement_spans(data.steps, data.runs)
    assert spans["steady_windows"].tolist() == [5]
    assert spans["measured_s"].tolist() == pytest.approx([5 * 32 / 64.0])
    assert scaling_table(data.runs)["world_size"].tolist() == [1]
