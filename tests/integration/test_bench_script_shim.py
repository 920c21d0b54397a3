"""Smoke test of bench/script_shim.py in quick mode: examples/plain_ddp.py through `cyclone-kit run
--nproc 2` and under torchrun, one interleaved pair, both figures printed with a verdict.

The timing targets are not asserted (a shared machine, a smoke-sized run): only that the benchmark
runs end to end through the real launcher, shim and torchrun and reports what it measured."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.helpers.cli import REPO

pytestmark = pytest.mark.slow


@pytest.mark.timeout(240)
def test_script_shim_bench_quick_reports_ratio_and_start_up() -> None:
    env = {**os.environ, "CK_BENCH_QUICK": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "bench/script_shim.py"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=230)
    out = proc.stdout
    assert proc.returncode in (0, 1), out[-3000:] + proc.stderr[-3000:]  # 1: a target missed in a smoke run
    assert re.search(r"pair 1: cyclone-kit run\s+[\d.]+ samples/s, start->first step\s+[\d.]+ s \| torchrun", out)
    assert re.search(r"throughput ratio cyclone-kit run / torchrun: \d+\.\d{3}", out)
    assert re.search(r"target: >= 0.99\s+(MET|MISSED)", out) and re.search(r"torchrun's \+ 0.3 s\s+(MET|MISSED)", out)
    figures = json.loads(next(line for line in out.splitlines() if line.startswith("BENCH_JSON "))[11:])
    assert figures["bench"] == "script_shim" and figures["ratio"] > 0 and figures["start_ours_s"] > 0
