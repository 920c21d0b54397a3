"""Smoke tests of the benchmarks: each runs in its quick mode and prints its figures and ratios.

Timing targets are NOT asserted here (the tests are not timed runs and the machine is shared), nor the
size of any figure (a fresh run's quick sync/none ratio had more than one digit before the point, likely
10 or more: a blocking save of the tiny CNN, fsync and all, against 10 steps of a few ms on a loaded
machine; a figure here is any signed number):
only that every benchmark runs end to end through the real launcher, runtime and torchrun, and
that ``run_all.py`` reports every figure with a verdict and rewrites the results file, keeping
its GPU section (bench/script_shim.py's own lines included: it runs once, here).
``CK_BENCH_QUICK=1`` makes every benchmark a smoke-sized run (1 pair, 4 steps; one rank a side but in
scaling_cpu, whose 1- and 2-rank runs keep the 2-rank path of both launchers in the suite).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.helpers.cli import REPO

pytestmark = pytest.mark.slow

QUICK_ENV = {**os.environ, "CK_BENCH_QUICK": "1", "PYTHONUNBUFFERED": "1"}
#: Hang guard (not a performance bound), >= 5x what it took on a busy 2-core machine (load ~8-10,
#: 2026-12-01): run_all.py quick 81 s. pytest's own limit is 30 s longer, so the subprocess timeout
#: fires first and the test reports the benchmark's output. (gpu_check.sh's CPU dry run is tested in
#: tests/integration/test_gpu_check.py, on a Python that has torch and nothing else.)
RUN_ALL_HANG_S = 600


@pytest.mark.timeout(RUN_ALL_HANG_S + 30)
def test_run_all_quick_prints_every_figure_with_a_verdict_and_keeps_the_gpu_section(tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text("# old\n\n<!-- gpu-check -->\nGPU FIGURES RECORDED BY HAND\n<!-- /gpu-check -->\n\nold table\n")
    proc = subprocess.run([sys.executable, "bench/run_all.py", "--results", str(results)], cwd=REPO, env=QUICK_ENV,
                          capture_output=True, text=True, timeout=RUN_ALL_HANG_S)
    out = proc.stdout
    # the whole output in the report of any failure below (pytest shows captured stdout then): a benchmark's own
    # lines come long before the summary that an assertion's message shows
    print(out, proc.stderr, sep="\n")
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-3000:]
    summary = out.split("=== summary", 1)[1]
    # every benchmark's figures, each with a verdict
    for pattern in (r"cli_latency\s+`--help` median", r"cli_latency\s+`submit --nodes 4 --dry-run`",
                    r"cli_latency\s+`profiles`", r"analysis\s+report on the synthetic study: wall time",
                    r"analysis\s+report: peak memory", r"overhead\s+ratio runtime / plain .*: -?\d+\.\d{3}",
                    r"phases_overhead\s+step-phase timing: throughput timed / CYCLONE_PHASES=0 .*: -?\d+\.\d{3}",
                    r"scaling_cpu\s+2-rank efficiency, cyclone_kit .*: -?\d+\.\d{3}",
                    r"scaling_cpu\s+2-rank efficiency, torchrun",
                    r"scaling_cpu\s+process start to first step, 2 ranks, cyclone_kit: \d+\.\d\d s",
                    r"async_checkpoint\s+step time, checkpoint every 5 steps in the background / none .*: -?\d+\.\d{3}",
                    r"rank_start\s+local launcher, 1 rank\(s\) and one step: CPU seconds, ranks forked .*: -?\d+\.\d{3}"):
        assert re.search(r"^\s+(MET|MISSED|INFO)\s+" + pattern, summary, re.M), (pattern, summary)
    assert "FAILED" not in summary
    # the benchmarks' own lines: both throughputs and the ratio
    assert re.search(r"cyclone_kit runtime: [\d.]+ samples/s", out)
    assert re.search(r"plain DDP loop:\s+[\d.]+ samples/s", out)
    assert re.search(r"ratio runtime/plain: -?\d+\.\d{3}", out)
    assert re.search(r"efficiency 2 ranks vs 1 \(torchrun\):\s+-?\d+\.\d{3}", out)
    assert re.search(r"start -> first step, 2 ranks: cyclone_kit [\d.]+ s, torchrun \+ plain script [\d.]+ s", out)
    # script_shim: examples/plain_ddp.py through `cyclone-kit run --nproc 1` and under torchrun, one pair
    assert re.search(r"pair 1: cyclone-kit run\s+[\d.]+ samples/s, start->first step\s+[\d.]+ s \| torchrun", out)
    assert re.search(r"throughput ratio cyclone-kit run / torchrun: -?\d+\.\d{3}", out)
    # async_checkpoint: the step-time ratios against no checkpoints, in one run
    assert re.search(r"ratio async/none: -?\d+\.\d{3} .*target <= 1.01\s+(MET|MISSED)", out)
    assert re.search(r"ratio sync/none:\s+-?\d+\.\d{3}", out)
    # rank_start: the local launcher's forked ranks against fresh ones, in one run
    assert re.search(r"ratio forked/fresh CPU -?\d+\.\d{3} \(target <= 0.75\) (MET|MISSED)", out)
    assert re.search(r"target: >= 0.99\s+(MET|MISSED)", out) and re.search(r"torchrun's \+ 0.3 s\s+(MET|MISSED)", out)
    # the results file: rewritten with date, machine and table; the GPU section kept as it was
    text = results.read_text()
    assert "old table" not in text and "QUICK MODE" in text
    assert re.search(r"- date: \d{4}-\d\d-\d\d \d\d:\d\d", text) and "- machine: " in text
    assert "load average" in text and "| overhead | ratio runtime / plain" in text
    assert "GPU FIGURES RECORDED BY HAND" in text


