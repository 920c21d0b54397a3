"""A pytest plugin: the CPU seconds each test file cost, printed at the end of the run (issue 27).

Wall times (``--durations``) say how long a test took on this machine at this load; they grow when
another tier runs beside it. CPU seconds do not: they are the work the suite asks of the machine, so
they say where a 2-core machine's time goes and which test is worth making cheaper. Counted: this
pytest process and every process it waited for (the ranks it started, the CLI it ran, their children
in turn), from ``getrusage``. Not counted: processes nobody waited for, and what Slurm's daemons run
(a Slurm job's ranks): the Slurm tier's own figure is its pytest side only.

Loaded by scripts/run-tests.sh with ``-p tests.helpers.cpu_time``; ``CK_CPU_TOP`` (default 25) is how
many files are listed.
"""

from __future__ import annotations

import os
import resource
import time
from collections import defaultdict

import pytest

_costs: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])


def _cpu_s() -> float:
    """User + system CPU seconds of this process and its waited-for descendants."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    cpu0, wall0 = _cpu_s(), time.monotonic()
    yield
    cost = _costs[item.nodeid.split("::", 1)[0]]
    cost[0] += _cpu_s() - cpu0
    cost[1] += time.monotonic() - wall0
    cost[2] += 1


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _costs:
        return
    top = int(os.environ.get("CK_CPU_TOP", "25"))
    total_cpu = sum(c[0] for c in _costs.values())
    total_wall = sum(c[1] for c in _costs.values())
    terminalreporter.section(f"CPU seconds per test file (top {top}; pytest and the processes it waited for)")
    terminalreporter.write_line(f"{'cpu s':>8} {'wall s':>8} {'cores':>5} {'tests':>5}  file")
    for path, (cpu, wall, n) in sorted(_costs.items(), key=lambda kv: -kv[1][0])[:top]:
        terminalreporter.write_line(f"{cpu:8.1f} {wall:8.1f} {cpu / wall if wall else 0:5.2f} {n:5d}  {path}")
    terminalreporter.write_line(f"{total_cpu:8.1f} {total_wall:8.1f} "
                                f"{total_cpu / total_wall if total_wall else 0:5.2f} {len(_costs):5d}  all files")
