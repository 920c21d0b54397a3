"""Benchmark: ``report`` on a synthetic study of 64 runs x 5,000 step records.

Prints the wall time and peak memory (max RSS of the child process) of
``python -m cyclone_kit report STUDY -o OUT`` against the targets (< 5 s, < 1 GB), and a ratio
against a reference measured in the same run on the same files: plain
``pandas.read_json(path, lines=True)`` of every metrics file (no segments, no error handling,
no table, no plots). Each measurement runs in its own fresh Python process.

Usage: ``python bench/analysis.py [--runs 64] [--steps 5000] [--repeat 3] [--keep DIR]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TIME_TARGET_S = 5.0
MEMORY_TARGET_BYTES = 1 << 30

# Each child prints one JSON line: its own time for the work and its peak RSS.
CHILD_PRELUDE = """
import json, resource, sys, time
sys.path.insert(0, {repo!r})
start = time.perf_counter()
"""
CHILD_REPORT = CHILD_PRELUDE + """
from cyclone_kit.cli.app import main
code = main(["report", {study!r}, "-o", {out!r}])
assert code == 0, code
"""
CHILD_INGEST = CHILD_PRELUDE + """
from cyclone_kit.analysis import load_runs, scaling_table
data = load_runs([{study!r}])
table = scaling_table(data.runs)
assert len(data.steps) == {expected_steps}, len(data.steps)
"""
CHILD_REFERENCE = CHILD_PRELUDE + """
import pathlib
import pandas as pd
frames = [pd.read_json(p, lines=True) for p in sorted(pathlib.Path({study!r}).rglob("metrics.jsonl"))]
table = pd.concat(frames, ignore_index=True)
assert (table["kind"] == "step").sum() == {expected_steps}
"""
CHILD_EPILOGUE = """
elapsed = time.perf_counter() - start
usage = resource.getrusage(resource.RUSAGE_SELF)
rss = usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)
print(json.dumps({"seconds": elapsed, "cpu_seconds": usage.ru_utime + usage.ru_stime, "max_rss_bytes": rss}))
"""


def make_study(root: Path, runs: int, steps: int) -> Path:
    """Write a strong-scaling study of ``runs`` runs (8 world sizes x repeats) with ``steps`` steps each."""
    from cyclone_kit.analysis.synthetic import SyntheticRun, metrics_text, run_records

    study = root / "bench-strong"
    points = []
    world_sizes = [1, 2, 4, 8, 16, 32, 64, 128]
    for index in range(runs):
        n = world_sizes[index % len(world_sizes)]
        repeat = index // len(world_sizes)
        name = f"n{n:03d}-r{repeat}"
        throughput = 300.0 * n / (1 + 0.03 * (n - 1)) * (1 + 0.01 * repeat)
        run = SyntheticRun(n, throughput, per_device_batch_size=max(256 // n, 1),
                           num_nodes=max(n // 4, 1), steps=steps)
        run_dir = study / name
        run_dir.mkdir(parents=True)
        (run_dir / "metrics.jsonl").write_text(metrics_text(run_records(run, run_id=name)), encoding="utf-8")
        points.append({"name": name, "world_size": n, "nodes": run.num_nodes, "ntasks_per_node": min(n, 4),
                       "per_device_batch_size": run.per_device_batch_size, "repeat": repeat, "run_dir": name})
    sweep = {"schema": 1, "kind": "sweep", "study": "bench-strong", "mode": "strong", "base_spec": {}, "points": points}
    (study / "sweep.json").write_text(json.dumps(sweep), encoding="utf-8")
    return study


def measure(code: str) -> dict[str, float]:
    """Run ``code`` in a fresh interpreter; its in-process time, total wall time and peak RSS."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code + CHILD_EPILOGUE], capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"benchmark child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["wall_seconds"] = wall
    return result


def best_of(code: str, repeat: int) -> dict[str, float]:
    """The fastest of ``repeat`` runs (peak memory: the largest seen)."""
    results = [measure(code) for _ in range(repeat)]
    best = min(results, key=lambda r: r["wall_seconds"])
    best["max_rss_bytes"] = max(r["max_rss_bytes"] for r in results)
    return best


def main(argv: list[str] | None = None) -> int:
    """Build the study, measure report / ingest / reference, print figures and verdicts."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=3, help="measurements per case; the fastest is kept")
    parser.add_argument("--keep", type=Path, help="build the study here and keep it")
    args = parser.parse_args(argv)

    root = args.keep or Path(tempfile.mkdtemp(prefix="ck-bench-"))
    try:
        if root.exists() and args.keep:
            shutil.rmtree(root)
        root.mkdir(parents=True, exist_ok=True)
        study = make_study(root, args.runs, args.steps)
        size = sum(p.stat().st_size for p in study.rglob("metrics.jsonl"))
        lines = args.runs * (args.steps + 3)
        print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} (wall times include contention)")
        print(f"study: {args.runs} runs x {args.steps} step records = {lines:,} lines, {size / 2**20:.1f} MiB")
        fmt = {"repo": str(REPO), "study": str(study), "out": str(root / "out"),
               "expected_steps": args.runs * args.steps}
        report = best_of(CHILD_REPORT.format(**fmt), args.repeat)
        ingest = best_of(CHILD_INGEST.format(**fmt), args.repeat)
        reference = best_of(CHILD_REFERENCE.format(**fmt), args.repeat)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)

    def row(name: str, r: dict[str, float]) -> str:
        return (f"{name:<44} {r['wall_seconds']:6.2f} s wall {r['seconds']:6.2f} s in-process "
                f"{r['cpu_seconds']:6.2f} s CPU {r['max_rss_bytes'] / 2**20:7.1f} MiB peak RSS")

    print(row("report (CLI, incl. interpreter + imports)", report))
    print(row("ingest + scaling table (load_runs)", ingest))
    print(row("reference: pandas.read_json(lines=True)", reference))
    print(f"ratio ingest / reference (in-process time): {ingest['seconds'] / reference['seconds']:.2f}x")
    print(f"ratio report / reference (wall time):       {report['wall_seconds'] / reference['wall_seconds']:.2f}x")
    print(f"ratio ingest / reference (peak memory):     {ingest['max_rss_bytes'] / reference['max_rss_bytes']:.2f}x")
    time_ok = report["wall_seconds"] < TIME_TARGET_S
    memory_ok = report["max_rss_bytes"] < MEMORY_TARGET_BYTES
    verdict = "MET" if time_ok else "NOT MET"
    if not time_ok and report["cpu_seconds"] < TIME_TARGET_S and os.getloadavg()[0] > (os.cpu_count() or 1):
        verdict += (f" on wall time; the machine is oversubscribed (load {os.getloadavg()[0]:.1f} on "
                    f"{os.cpu_count()} CPUs) and the report used {report['cpu_seconds']:.2f} s of CPU")
    print(f"target time   < {TIME_TARGET_S:.0f} s: {verdict} ({report['wall_seconds']:.2f} s wall)")
    print(f"target memory < 1 GB: {'MET' if memory_ok else 'NOT MET'} ({report['max_rss_bytes'] / 2**20:.0f} MiB)")
    return 0 if time_ok and memory_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
