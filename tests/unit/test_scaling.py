"""Scaling maths against hand-computed tables (strong and weak), repeats, incomplete runs, fits."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cyclone_kit.analysis.ingest import load_runs
from cyclone_kit.analysis.scaling import (
    SCALING_COLUMNS,
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
from cyclone_kit.analysis.synthetic import SyntheticRun, write_run, write_study


def runs_frame(rows: list[tuple], study: str = "s", declared: str | None = None) -> pd.DataFrame:
    """Runs table from (world_size, per_device_batch, samples_per_s, complete[, nodes]) tuples."""
    records = []
    for row in rows:
        n, batch, sps, complete = row[:4]
        records.append({
            "study": study, "strategy": "ddp", "declared_mode": declared, "world_size": n,
            "num_nodes": row[4] if len(row) > 4 else 1, "per_device_batch_size": batch,
            "global_batch_size": batch * n, "samples_per_s": sps, "complete": complete,
        })
    frame = pd.DataFrame(records)
    for column in ("world_size", "num_nodes", "per_device_batch_size", "global_batch_size"):
        frame[column] = frame[column].astype("Int64")
    return frame


# Strong study, global batch 256, N0 = 1. N=4 has three repeats (340, 350, 360) -> median 350.
# A failed N=8 run with a huge throughput must not count.
STRONG = runs_frame([
    (1, 256, 100.0, True),
    (2, 128, 190.0, True),
    (4, 64, 360.0, True),
    (4, 64, 340.0, True),
    (4, 64, 350.0, True),
    (8, 32, 600.0, True, 2),
    (8, 32, 9999.0, False, 2),
])
# Hand-computed: speedup = T/100; efficiency = S/N; Karp-Flatt e = (1/S - 1/N) / (1 - 1/N).
STRONG_EXPECTED = pd.DataFrame({
    "world_size": [1, 2, 4, 8],
    "num_nodes": [1, 1, 1, 2],
    "runs": [1, 1, 3, 1],
    "samples_per_s": [100.0, 190.0, 350.0, 600.0],
    "samples_per_s_min": [100.0, 190.0, 340.0, 600.0],
    "samples_per_s_max": [100.0, 190.0, 360.0, 600.0],
    "samples_per_s_per_device": [100.0, 95.0, 87.5, 75.0],
    "speedup": [1.0, 1.9, 3.5, 6.0],
    "efficiency": [1.0, 0.95, 0.875, 0.75],
    # (1/1.9 - 1/2) / (1/2) = 0.0526316; (1/3.5 - 1/4) / (3/4) = 0.0476190; (1/6 - 1/8) / (7/8) = 0.0476190
    "karp_flatt": [math.nan, 0.0526316, 0.0476190, 0.0476190],
})

# Weak study, per-device batch 64, N0 = 2 (no 1-GPU point); two repeats at N=8 (700, 740 -> 720).
WEAK = runs_frame([
    (2, 64, 190.0, True),
    (4, 64, 370.0, True),
    (8, 64, 700.0, True),
    (8, 64, 740.0, True),
], study="w")
# speedup = T/190: 1, 1.947368, 3.789474; efficiency = (T/N) / (190/2): 1, 92.5/95, 90/95;
# Karp-Flatt with p = N/2: (1/1.947368 - 1/2)/(1/2) = 0.027027; (1/3.789474 - 1/4)/(3/4) = 0.0185185
WEAK_EXPECTED = pd.DataFrame({
    "world_size": [2, 4, 8],
    "runs": [1, 1, 2],
    "samples_per_s": [190.0, 370.0, 720.0],
    "samples_per_s_per_device": [95.0, 92.5, 90.0],
    "speedup": [1.0, 1.9473684, 3.7894737],
    "efficiency": [1.0, 0.9736842, 0.9473684],
    "karp_flatt": [math.nan, 0.0270270, 0.0185185],
})


def check(table: pd.DataFrame, expected: pd.DataFrame) -> None:
    """Compare the expected columns with a tolerance of 1e-6 (NaN equals NaN)."""
    for column in expected.columns:
        np.testing.assert_allclose(
            table[column].to_numpy(dtype=float), expected[column].to_numpy(dtype=float),
            rtol=1e-6, atol=1e-7, err_msg=column,
        )


def test_strong_table_matches_hand_computed_values() -> None:
    table = scaling_table(STRONG)
    assert list(table.columns) == list(SCALING_COLUMNS)
    check(table, STRONG_EXPECTED)
    assert set(table["mode"]) == {"strong"}
    assert list(table["global_batch_size"]) == [256, 256, 256, 256]
    assert list(table["per_device_batch_size"]) == [256, 128, 64, 32]


def test_weak_table_matches_hand_computed_values_with_baseline_above_one() -> None:
    table = scaling_table(WEAK)
    check(table, WEAK_EXPECTED)
    assert set(table["mode"]) == {"weak"}
    assert math.isnan(table["karp_flatt"].iloc[0])


def test_median_over_an_even_number_of_repeats_is_the_mean_of_the_middle_two() -> None:
    table = scaling_table(WEAK)
    row = table[table["world_size"] == 8].iloc[0]
    assert (row["samples_per_s"], row["samples_per_s_min"], row["samples_per_s_max"]) == (720.0, 700.0, 740.0)


def test_incomplete_runs_are_excluded_even_when_they_are_the_only_point() -> None:
    runs = runs_frame([(1, 64, 100.0, True), (2, 64, 180.0, False)])
    table = scaling_table(runs)
    assert list(table["world_size"]) == [1]
    assert table["speedup"].iloc[0] == 1.0


def test_studies_and_strategies_have_their_own_baselines() -> None:
    both = pd.concat([STRONG, WEAK], ignore_index=True)
    table = scaling_table(both)
    assert list(table["study"]) == ["s"] * 4 + ["w"] * 3
    check(table[table["study"] == "w"].reset_index(drop=True), WEAK_EXPECTED)
    fsdp = STRONG.assign(strategy="fsdp", samples_per_s=STRONG["samples_per_s"] * 2)
    table = scaling_table(pd.concat([STRONG, fsdp], ignore_index=True))
    # Doubling every throughput leaves speed-up and efficiency unchanged.
    for strategy in ("ddp", "fsdp"):
        check(table[table["strategy"] == strategy].reset_index(drop=True), STRONG_EXPECTED[["speedup", "efficiency"]])


def test_empty_runs_give_an_empty_table_with_all_columns() -> None:
    table = scaling_table(runs_frame([(1, 64, 100.0, False)]))
    assert table.empty
    assert list(table.columns) == list(SCALING_COLUMNS)


@pytest.mark.parametrize(
    ("rows", "declared", "mode"),
    [
        ([(1, 256, 1.0, True), (2, 128, 1.0, True)], None, "strong"),  # constant global batch
        ([(1, 64, 1.0, True), (2, 64, 1.0, True)], None, "weak"),  # constant per-device batch
        ([(1, 64, 1.0, True), (2, 64, 1.0, True)], "strong", "strong"),  # the sweep record wins
        ([(1, 64, 1.0, True), (1, 64, 1.0, True)], None, "unknown"),  # one world size
        ([(1, 64, 1.0, True), (2, 48, 1.0, True)], None, "unknown"),  # neither constant
    ],
)
def test_mode_inference(rows: list[tuple], declared: str | None, mode: str) -> None:
    assert infer_mode(runs_frame(rows, declared=declared)) == mode


def test_karp_flatt_values() -> None:
    assert karp_flatt(1.9, 2) == pytest.approx(0.0526316, rel=1e-6)
    assert karp_flatt(4.0, 4) == 0.0  # perfect scaling: no serial fraction
    assert karp_flatt(1.0, 4) == pytest.approx(1.0)  # no speed-up at all: all serial
    assert math.isnan(karp_flatt(1.0, 1))


@settings(max_examples=50, deadline=None)
@given(s=st.floats(0.0, 1.0), p=st.integers(2, 4096))
def test_karp_flatt_of_an_amdahl_speedup_is_its_serial_fraction(s: float, p: int) -> None:
    assert karp_flatt(float(amdahl_speedup(p, s)), p) == pytest.approx(s, abs=1e-9)


def test_fit_amdahl_recovers_the_serial_fraction() -> None:
    p = np.array([1, 2, 4, 8, 16])
    assert fit_amdahl(p, amdahl_speedup(p, 0.05)) == pytest.approx(0.05, abs=1e-6)
    assert fit_amdahl(p, p.astype(float)) == pytest.approx(0.0, abs=1e-6)
    assert fit_amdahl(p, p * 1.2) == 0.0  # super-linear speed-up clamps to s = 0
    with pytest.raises(ValueError, match="p > 1"):
        fit_amdahl([1], [1.0])


def test_fit_gustafson_is_the_closed_form_least_squares() -> None:
    p = np.array([1.0, 2.0, 4.0, 8.0])
    assert fit_gustafson(p, gustafson_speedup(p, 0.1)) == pytest.approx(0.1)
    # p = 2, 4 with S = 1.8, 3.0: s = ((0.2)(1) + (1.0)(3)) / (1 + 9) = 0.32
    assert fit_gustafson([2, 4], [1.8, 3.0]) == pytest.approx(0.32)


def test_fit_scaling_laws_uses_amdahl_for_strong_and_gustafson_for_weak() -> None:
    fits = fit_scaling_laws(scaling_table(pd.concat([STRONG, WEAK], ignore_index=True)))
    by_study = {fit.study: fit for fit in fits}
    assert by_study["s"].law == "amdahl"
    assert by_study["w"].law == "gustafson"
    assert by_study["w"].base_world_size == 2
    # Gustafson on p = 2, 4 with S = 1.947368, 3.789474: s = (0.052632*1 + 0.210526*3) / 10
    assert by_study["w"].serial_fraction == pytest.approx((2 - 1.9473684 + 3 * (4 - 3.7894737)) / 10, rel=1e-5)
    # The strong points follow Amdahl with s close to 0.0476 (their Karp-Flatt values).
    assert by_study["s"].serial_fraction == pytest.approx(0.0476, abs=2e-3)
    assert by_study["s"].predict([1])[0] == pytest.approx(1.0)
    assert "Amdahl prediction" in by_study["s"].label


def test_no_fit_for_a_single_world_size() -> None:
    assert fit_scaling_laws(scaling_table(runs_frame([(4, 64, 100.0, True)]))) == []


def test_compare_to_baselines() -> None:
    table = scaling_table(STRONG)
    baselines = pd.DataFrame([{"name": "colab", "device": "T4", "samples_per_s": 50.0, "devices": 1},
                              {"name": "dgx", "device": "V100", "samples_per_s": 800.0, "devices": 8}])
    out = compare_to_baselines(table, baselines)
    colab = out[out["baseline"] == "colab"].set_index("world_size")
    assert colab.loc[8, "times"] == 12.0  # 600 / 50
    assert colab.loc[8, "times_per_device"] == 1.5  # 75 / 50
    dgx = out[out["baseline"] == "dgx"].set_index("world_size")
    assert dgx.loc[8, "times"] == 0.75  # 600 / 800
    assert dgx.loc[1, "times_per_device"] == 1.0  # 100 / (800 / 8)


# ---- end to end from files: requeue, truncation, corruption


def test_requeued_run_counts_once_with_its_completed_segment(tmp_path) -> None:
    study = write_study(tmp_path, "rq", "strong", [
        ("n1", SyntheticRun(1, 100.0, per_device_batch_size=64)),
        ("n2", SyntheticRun(2, 180.0, per_device_batch_size=32, statuses=("preempted", "completed"),
                            segment_samples_per_s=(120.0, 180.0))),
    ])
    data = load_runs([study])
    table = scaling_table(data.runs)
    row = table[table["world_size"] == 2].iloc[0]
    assert row["runs"] == 1
    assert row["samples_per_s"] == 180.0  # not the preempted segment's 120, nor a mean
    assert row["speedup"] == pytest.approx(1.8)
    assert data.runs.set_index("world_size").loc[2, "segments"] == 2


def test_truncated_and_corrupt_lines_are_counted_and_the_run_still_counts(tmp_path) -> None:
    run = tmp_path / "t" / "n1"
    write_run(tmp_path / "t" / "n1", SyntheticRun(1, 100.0))
    text = (run / "metrics.jsonl").read_text()
    lines = text.splitlines(keepends=True)
    # A garbage line in the middle, and a crash that cut the last line short.
    (run / "metrics.jsonl").write_text("".join(lines[:3]) + "{not json\n" + "".join(lines[3:]) + '{"kind": "st')
    with pytest.warns(UserWarning, match="2 corrupt line"):
        data = load_runs([tmp_path / "t"])
    row = data.runs.iloc[0]
    assert (row["corrupt_lines"], bool(row["truncated"]), bool(row["complete"])) == (2, True, True)
    assert scaling_table(data.runs)["samples_per_s"].tolist() == [100.0]


def test_step_timing_medians_and_data_share() -> None:
    runs = pd.DataFrame({"run_dir": ["a", "b", "c"], "study": "s", "strategy": "ddp", "world_size": [1, 2, 2],
                         "complete": [True, True, False]})
    steps = pd.DataFrame({
        "run_dir": pd.Categorical(["a", "a", "a", "b", "b", "c"]),
        "step_time_s": [0.1, 0.2, 0.3, 0.4, 0.4, 9.0],
        "data_time_s": [0.05, 0.05, 0.2, 0.1, 0.1, 9.0],
    })
    timing = step_timing(steps, runs).set_index("world_size")
    assert timing.loc[1, "step_time_s"] == pytest.approx(0.2)
    assert timing.loc[1, "data_time_s"] == pytest.approx(0.05)
    assert timing.loc[1, "data_share"] == pytest.approx(0.3 / 0.6)  # (0.05 + 0.05 + 0.2) / 0.6
    assert timing.loc[2, "step_records"] == 2  # the incomplete run c is left out
    assert timing.loc[2, "data_share"] == pytest.approx(0.25)
    assert step_timing(steps.iloc[0:0], runs).empty
