"""Shared test helpers: the repo root and a CLI runner in a real subprocess."""

from __future__ import annotations

import os

import pytest

from tests.helpers.cli import run_cli


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
