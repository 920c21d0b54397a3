"""Reading metrics.jsonl: segments, statuses, corrupt lines, studies from sweep.json, tables."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from cyclone_kit.analysis.ingest import (
    MetricsWarning,
    find_metrics_files,
    load_runs,
    parse_metrics_text,
    summarize_run,
)
from cyclone_kit.analysis.synthetic import SyntheticRun, metrics_text, run_records, write_run, write_study
from cyclone_kit.core.errors import ValidationError


def lines(*records: dict) -> str:
    """JSON Lines text of records that get ``schema: 1`` unless they set it."""
    return "".join(json.dumps({"schema": 1, **r}) + "\n" for r in records)


START = {"kind": "start", "world_size": 2, "num_nodes": 1, "per_device_batch_size": 8,
         "global_batch_size": 16, "strategy": "ddp", "device": "cpu", "hostnames": ["a"], "restart_count": 0}


def test_parse_counts_corrupt_unsupported_and_truncated_lines() -> None:
    text = (
        lines(START, {"kind": "step", "step": 1, "samples_per_s": 10.0})
        + "garbage\n"  # not JSON
        + "[1, 2]\n"  # JSON, not an object
        + '{"schema": 1}\n'  # no kind
        + '{"kind": "step", "schema": 3, "step": 2}\n'  # a schema version not read
        + lines({"kind": "mystery"})  # unknown kinds are ignored, not corrupt
        + "\n   \n"  # blank lines are fine
        + '{"kind": "end", "sch'  # cut short by a crash
    )
    parsed = parse_metrics_text(text)
    assert (parsed.corrupt_lines, parsed.unsupported_lines, parsed.truncated) == (4, 1, True)
    assert parsed.steps_frame()["step"].tolist() == [1]
    assert len(parsed.segments) == 1
    assert parsed.segments[0]["end"] is None


def test_a_corrupt_line_in_the_middle_is_not_a_truncation() -> None:
    parsed = parse_metrics_text(lines(START) + "{oops\n" + lines({"kind": "end", "status": "completed"}))
    assert (parsed.corrupt_lines, parsed.truncated) == (1, False)


def test_segments_split_at_each_start_and_records_before_a_start_form_one() -> None:
    text = lines(
        {"kind": "step", "step": 1},
        START, {"kind": "step", "step": 2}, {"kind": "end", "status": "preempted", "samples_per_s": 5.0},
        {**START, "restart_count": 1}, {"kind": "step", "step": 3}, {"kind": "epoch", "epoch": 0, "val_accuracy": 0.7},
        {"kind": "end", "status": "completed", "samples_per_s": 9.0, "steps": 3, "wall_time_s": 4.0},
    )
    parsed = parse_metrics_text(text)
    assert [seg["start"] is not None for seg in parsed.segments] == [False, True, True]
    assert parsed.steps_frame()["segment"].tolist() == [0, 1, 2]
    assert [e["segment"] for e in parsed.epochs] == [2]


def test_summary_of_a_requeued_run() -> None:
    run = SyntheticRun(4, 400.0, statuses=("preempted", "preempted", "completed"),
                       segment_samples_per_s=(100.0, 200.0, 400.0), num_nodes=2)
    summary = summarize_run(parse_metrics_text(metrics_text(run_records(run))))
    assert summary["status"] == "completed"
    assert summary["complete"] is True
    assert summary["samples_per_s"] == 400.0
    assert summary["segments"] == 3
    assert summary["restart_count"] == 2
    assert summary["wall_time_s"] == 30.0  # 3 segments x 10 s
    assert summary["steps"] == 15
    assert summary["hostnames"] == "gpu01,gpu02"
    assert summary["val_accuracy"] == 0.5


@pytest.mark.parametrize(
    ("statuses", "status", "reason"),
    [
        (("completed", None), "incomplete", "no end record"),  # requeued, then crashed
        (("preempted",), "preempted", "preempted and not resumed"),
        (("preempted", "cancelled"), "cancelled", "cancelled by the user"),  # issue 17: a user's cancel
        (("failed",), "failed", "ended with status 'failed'"),
        ((None,), "incomplete", "no end record"),
    ],
)
def test_runs_whose_last_segment_did_not_complete_are_incomplete(statuses, status, reason) -> None:
    summary = summarize_run(parse_metrics_text(metrics_text(run_records(SyntheticRun(1, 5.0, statuses=statuses)))))
    assert summary["status"] == status
    assert summary["complete"] is False
    assert reason in summary["incomplete_reason"]
    assert math.isnan(summary["samples_per_s"])


def test_summary_without_start_or_throughput() -> None:
    no_start = summarize_run(parse_metrics_text(lines({"kind": "end", "status": "completed", "samples_per_s": 1.0})))
    assert (no_start["complete"], no_start["incomplete_reason"]) == (False, "no start record")
    no_speed = summarize_run(parse_metrics_text(lines(START, {"kind": "end", "status": "completed"})))
    assert (no_speed["complete"], no_speed["incomplete_reason"]) == (False, "end record has no samples_per_s")
    empty = summarize_run(parse_metrics_text(""))
    assert empty["incomplete_reason"] == "no records"


def test_load_runs_reads_studies_points_steps_and_ranks(tmp_path: Path) -> None:
    study = write_study(tmp_path, "strong-a", "strong", [
        ("n1-r0", SyntheticRun(1, 100.0, steps=3)),
        ("n1-r1", SyntheticRun(1, 110.0, steps=3)),
        ("n2-r0", SyntheticRun(2, 150.0, steps=4, statuses=("failed",))),
    ], repeats=[0, 1, 0])
    ranks = study / "n1-r0" / "ranks"
    ranks.mkdir()
    (ranks / "rank-00000.json").write_text(json.dumps(
        {"rank": 0, "host": "gpu01", "device": "cuda:0", "samples_per_s": 100.0, "peak_memory_bytes": 2**30}))
    (ranks / "rank-00001.json").write_text("{broken")
    with pytest.warns(MetricsWarning, match="rank-00001"):
        data = load_runs(study)
    runs = data.runs.set_index("point")
    assert list(runs.index) == ["n1-r0", "n1-r1", "n2-r0"]
    assert set(runs["study"]) == {"strong-a"}
    assert set(runs["declared_mode"]) == {"strong"}
    assert runs.loc["n1-r1", "repeat"] == 1
    assert runs["complete"].tolist() == [True, True, False]
    assert list(data.complete_runs["samples_per_s"]) == [100.0, 110.0]
    assert list(data.incomplete_runs["status"]) == ["failed"]
    assert len(data.steps) == 3 + 3 + 4
    assert {"run_dir", "segment", "step", "loss", "step_time_s", "data_time_s", "samples_per_s"} <= set(data.steps)
    assert data.steps["step_time_s"].dtype.kind == "f"
    assert len(data.epochs) == 3
    assert data.ranks[["rank", "host", "samples_per_s"]].values.tolist() == [[0, "gpu01", 100.0]]


def test_run_dirs_inside_a_study_find_the_nearest_sweep_json(tmp_path: Path) -> None:
    outer = write_study(tmp_path, "outer", "weak", [("n1", SyntheticRun(1, 1.0))])
    inner = write_study(outer, "inner", "strong", [("n1", SyntheticRun(1, 1.0))])
    data = load_runs([inner / "n1", outer / "n1" / "metrics.jsonl"])
    assert list(data.runs["study"]) == ["inner", "outer"]
    assert list(data.runs["declared_mode"]) == ["strong", "weak"]


def test_study_names_without_a_sweep_json(tmp_path: Path) -> None:
    write_run(tmp_path / "my-study" / "a", SyntheticRun(1, 1.0, model="resnet18", dataset="cifar10"))
    write_run(tmp_path / "lonely", SyntheticRun(1, 1.0, model="resnet18", dataset="cifar10"))
    assert list(load_runs(tmp_path / "my-study").runs["study"]) == ["my-study"]
    # A run directory given directly is labelled by model and dataset.
    assert list(load_runs(tmp_path / "lonely").runs["study"]) == ["resnet18-cifar10"]
    assert load_runs(tmp_path / "lonely").runs["declared_mode"].isna().all()


def test_a_broken_sweep_json_is_ignored_with_a_warning(tmp_path: Path) -> None:
    write_run(tmp_path / "s" / "a", SyntheticRun(1, 1.0))
    (tmp_path / "s" / "sweep.json").write_text("{nope")
    with pytest.warns(MetricsWarning, match="sweep.json"):
        data = load_runs(tmp_path / "s")
    assert list(data.runs["study"]) == ["s"]


def test_find_metrics_files_dedups_and_rejects_empty_or_missing_paths(tmp_path: Path) -> None:
    path = write_run(tmp_path / "s" / "a", SyntheticRun(1, 1.0))
    found = find_metrics_files([tmp_path / "s", path, tmp_path / "s" / "a"])
    assert [f for f, _ in found] == [path]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValidationError, match=r"no metrics\.jsonl found under") as err:
        find_metrics_files([tmp_path / "empty"])
    assert err.value.hint
    with pytest.raises(ValidationError, match="does not exist"):
        load_runs(tmp_path / "missing")


def test_records_with_fields_of_the_wrong_type_are_refused_with_their_line_and_the_rest_kept(tmp_path: Path) -> None:
    good_step = {"kind": "step", "step": 1, "epoch": 0, "loss": 0.5, "step_time_s": 0.1, "samples_per_s": 10.0}
    text = lines(
        START, good_step, {"kind": "step", "step": "abc", "loss": None}, {**good_step, "step": 2, "loss": "NaN"},
        {"kind": "end", "status": "completed", "samples_per_s": "fast"},
        {"kind": "end", "status": "completed", "steps": 2, "samples_per_s": 10.0, "wall_time_s": 1.0},
    )
    parsed = parse_metrics_text(text)
    assert [line for line, _ in parsed.refused] == [3, 5]
    assert parsed.refused[0][1] == "step field 'step' is 'abc', not an integer"
    assert [r["step"] for r in parsed.steps] == [1, 2] and summarize_run(parsed)["complete"]
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "metrics.jsonl").write_text(text + "garbage\n")
    data = load_runs(tmp_path / "r", warn=False)
    assert bool(data.runs["complete"].iloc[0]) and data.runs["samples_per_s"].iloc[0] == 10.0
    skipped = next(w for w in data.warnings if "skipped" in w)
    assert "1 corrupt line(s) (line 7)" in skipped and "2 record(s) with a field of the wrong type" in skipped
    assert "line 3: step field 'step' is 'abc'" in skipped and "kept the 4 good record(s)" in skipped
    assert any("the loss was not finite (NaN or infinite) in 1 step record(s): step(s) 2" in w for w in data.warnings)
    assert data.steps["loss"].isna().tolist() == [False, True]  # "NaN" read as the value it names


def test_fast_and_exact_paths_agree() -> None:
    good = lines(START, {"kind": "step", "step": 1, "loss": 0.25}, {"kind": "end", "status": "completed",
                                                                       "samples_per_s": 3.5})
    fast = parse_metrics_text(good)
    # A line that is two JSON values ("1, 2") must count as one corrupt line, not two records.
    exact = parse_metrics_text(good + "1, 2\n")
    assert (fast.corrupt_lines, exact.corrupt_lines) == (0, 1)
    assert summarize_run(fast)["samples_per_s"] == summarize_run(exact)["samples_per_s"] == 3.5
    assert fast.steps_frame().equals(exact.steps_frame())
    crlf = parse_metrics_text(good.replace("\n", "\r\n"))
    assert (crlf.corrupt_lines, summarize_run(crlf)["complete"]) == (0, True)


def test_schema_1_and_schema_2_records_are_both_read_the_phases_null_for_schema_1(tmp_path: Path) -> None:
    """A run started before the step phases existed (schema 1) and resumed after (schema 2)."""
    phases = {"compute_time_s": 0.06, "comm_time_s": 0.03, "comm_exposed_s": 0.01, "other_time_s": 0.002,
              "bubble_time_s": None}
    text = lines(
        {**START, "run_id": "r"}, {"kind": "step", "step": 1, "step_time_s": 0.1, "data_time_s": 0.0,
                                   "samples_per_s": 160.0},
        {"kind": "end", "status": "preempted", "steps": 1, "samples_per_s": 160.0, "wall_time_s": 1.0},
        {**START, "run_id": "r", "schema": 2, "restart_count": 1, "phase_timing": "host-clock",
         "comm_timing": "ddp-comm-hook"},
        {"kind": "step", "schema": 2, "step": 2, "step_time_s": 0.08, "data_time_s": 0.008, "samples_per_s": 200.0,
         **phases},
        {"kind": "end", "schema": 2, "status": "completed", "steps": 2, "samples_per_s": 200.0, "wall_time_s": 1.0},
    )
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text(text)
    data = load_runs(tmp_path / "run", warn=False)
    assert data.warnings == ()
    (row,) = data.runs.to_dict("records")
    assert (row["status"], row["phase_timing"], row["comm_timing"]) == ("completed", "host-clock", "ddp-comm-hook")
    old, new = data.steps.sort_values("step").to_dict("records")
    assert all(math.isnan(old[k]) for k in phases)
    assert {k: new[k] for k in phases if k != "bubble_time_s"} == pytest.approx(
        {k: v for k, v in phases.items() if k != "bubble_time_s"})
    assert math.isnan(new["bubble_time_s"]) and new["data_time_s"] == pytest.approx(0.008)
