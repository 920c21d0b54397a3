"""Shared test helpers: the repo root and a CLI runner in a real subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent


def run_cli(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: float = 120,
            input: str | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m cyclone_kit ARGS`` as a user would; returns the completed process."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "cyclone_kit", *args], cwd=cwd or REPO, env=full_env,
                          capture_output=True, text=True, timeout=timeout, input=input)


@pytest.fixture
def cli():
    """The :func:`run_cli` helper as a fixture."""
    return run_cli


# ------------------------------------------------------------------------ required tiers
#: tier -> (the variable that makes it required, words its skip reasons contain). The Slurm tier's
#: own fixture fails by itself under CK_REQUIRE_SLURM=1 (tests/slurm/conftest.py).
#: Words are matched case-insensitively ("horovod.torch not importable" is the Horovod tier too).
REQUIRED_TIERS = {
    "horovod": ("CK_REQUIRE_HOROVOD", ("horovod",)),
    "data": ("CK_REQUIRE_DATA", ("dataset-fashion-mnist",)),
    "dev extras (lightning, accelerate)": ("CK_REQUIRE_EXTRAS", ("lightning", "accelerate", ".[dev]")),
}


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A skip of a tier that must run here (CK_REQUIRE_<TIER>=1, set by `make test` as root) fails."""
    outcome = yield
    report = outcome.get_result()
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report)
    for tier, (variable, words) in REQUIRED_TIERS.items():
        if os.environ.get(variable) == "1" and any(word in reason.lower() for word in words):
            report.outcome = "failed"
            report.longrepr = f"the {tier} tier must run here ({variable}=1) but was skipped: {reason}"


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """End with what was skipped and why, one line per reason with its count."""
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        terminalreporter.write_line("skipped: nothing")
        return
    counts: dict[str, int] = {}
    for report in skipped:
        reason = _skip_reason(report)
        counts[reason] = counts.get(reason, 0) + 1
    terminalreporter.section(f"skipped: {len(skipped)} tests, by reason")
    for reason, count in sorted(counts.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{count:4d}  {reason}")


# --------------------------------------------------------------------------- step phases (issue 23)
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
