"""Checks on the step phases of metrics records (issue 23), shared by the tests of every strategy and of ck.instrument."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

#: How far the phases' sum may be from the step time (the issue's bar: 5%).
SUM_TOLERANCE = 0.05


def phases_sum(rec: Mapping[str, Any]) -> float:
    """data + compute + exposed communication + other (+ a pipeline's bubble) of one step record."""
    parts = ("data_time_s", "compute_time_s", "comm_exposed_s", "other_time_s", "bubble_time_s")
    return sum(float(rec[k]) for k in parts if rec.get(k) is not None)


def assert_phases_add_up(steps: Sequence[Mapping[str, Any]], *, communication: bool,
                         tolerance: float = SUM_TOLERANCE) -> None:
    """Every step record's phases are measured, non-negative and sum to its step time within ``tolerance``;
    with ``communication`` the gradient communication was seen (exposed <= total), else it is 0."""
    assert steps, "no step records"
    for rec in steps:
        for key in ("data_time_s", "compute_time_s", "comm_time_s", "comm_exposed_s", "other_time_s"):
            assert rec[key] is not None and rec[key] >= 0, (key, rec)
        total = phases_sum(rec)
        assert abs(total - rec["step_time_s"]) <= tolerance * rec["step_time_s"], (total, rec)
        assert rec["comm_exposed_s"] <= rec["comm_time_s"] + 1e-9, rec
        if communication:
            assert rec["comm_time_s"] > 0, rec
        else:
            assert rec["comm_time_s"] == rec["comm_exposed_s"] == 0, rec
