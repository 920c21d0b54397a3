"""Rank start-up of the local launcher: ranks forked from one process that imported torch
(``cyclone_kit.core.prefork``, the default) against fresh processes (``CYCLONE_PREFORK=0``), same run.

Each side is ``cyclone-kit run jobs/smoke.toml --nproc N --cpu`` for one training step without
validation, so almost all it costs is starting: the launcher, the ranks' imports (``torch``,
``torch._dynamo``, torchvision, the trainer), the rendezvous and one step. The sides alternate
(fresh, forked, fresh, ...), one at a time. Printed per side: the median CPU seconds of the whole
launch (the launcher and every process it waited for: ``RUSAGE_CHILDREN``), the median wall time,
and the ratios forked / fresh. Target: forked / fresh CPU <= 0.75 at N = 2 (one rank's imports, of the
launcher's and two ranks' starts, is saved: the imports are most of a rank's start).

``CK_BENCH_QUICK=1``: 1 pair at N = 1 (figures meaningless, for the tests: a smoke run of both paths). Exit 1 when
the target is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO, add_nproc, quick

TARGET = 0.75
HANG_S = 600


def launch(nproc: int, forked: bool, runs: Path) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one launch; its launch.json must say how its ranks started."""
    env = {**os.environ, "CYCLONE_PREFORK": "1" if forked else "0", "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, "-m", "cyclone_kit", "run", str(REPO / "jobs" / "smoke.toml"), "--nproc", str(nproc),
            "--cpu", "--quiet", "--runs-dir", str(runs), "--set", "train.steps=1", "--set", "train.val_every_epochs=0",
            "--set", "checkpoint.every_steps=0"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=runs, env=env, capture_output=True, text=True, timeout=HANG_S)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"rank_start: the launch failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    newest = max(runs.iterdir(), key=lambda p: p.stat().st_mtime)
    said = json.loads((newest / "launch.json").read_text())["forked"]
    if said is not forked:
        raise SystemExit(f"rank_start: asked forked={forked}, launch.json says {said}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall


def main(argv: list[str] | None = None) -> int:
    """Measure both sides alternately, print the figures and the verdict."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=1 if quick() else 5)
    add_nproc(p, "ranks of each launch")
    args = p.parse_args(argv)
    pairs, nproc = args.pairs, args.nproc
    fresh: list[tuple[float, float]] = []
    forked: list[tuple[float, float]] = []
    with tempfile.TemporaryDirectory(prefix="ck-rank-start-") as tmp:
        runs = Path(tmp)
        for i in range(pairs):
            fresh.append(launch(nproc, False, runs))
            forked.append(launch(nproc, True, runs))
            print(f"  pair {i + 1}: fresh {fresh[-1][0]:6.2f} CPU-s {fresh[-1][1]:6.2f} s wall | "
                  f"forked {forked[-1][0]:6.2f} CPU-s {forked[-1][1]:6.2f} s wall", flush=True)
    cpu_fresh, wall_fresh = (statistics.median(x[k] for x in fresh) for k in (0, 1))
    cpu_forked, wall_forked = (statistics.median(x[k] for x in forked) for k in (0, 1))
    ratio, wall_ratio = cpu_forked / cpu_fresh, wall_forked / wall_fresh
    met = ratio <= TARGET
    print(f"rank_start: {nproc} ranks, 1 step: fresh processes {cpu_fresh:.2f} CPU-s, {wall_fresh:.2f} s wall "
          f"(reference, same run); forked {cpu_forked:.2f} CPU-s, {wall_forked:.2f} s wall")
    print(f"ratio forked/fresh CPU {ratio:.3f} (target <= {TARGET}) {'MET' if met else 'MISSED'}; "
          f"wall {wall_ratio:.3f}")
    print("BENCH_JSON " + json.dumps({"nproc": nproc, "pairs": pairs, "cpu_fresh_s": cpu_fresh,
                                      "cpu_forked_s": cpu_forked, "wall_fresh_s": wall_fresh,
                                      "wall_forked_s": wall_forked, "ratio": ratio, "wall_ratio": wall_ratio,
                                      "target": TARGET, "met": met}))
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
