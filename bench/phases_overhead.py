"""Cost of the step-phase timing: the runtime with it (the default) versus with it off, 2 ranks, gloo, CPU.

Both sides are ``python -m cyclone_kit run SPEC --nproc 2 --threads 1``; side B has
``CYCLONE_PHASES=0`` (no phase marks, no DDP comm hook: DDP's built-in C++ all-reduce). Same
workload, seed and measurement as bench/overhead.py, and the same interleaving: both sides start
at once and take turns every 0.5 s (SIGSTOP/SIGCONT), so the load of a shared host hits both
alike (bench/common.py ``run_interleaved``, ``other="untimed"``).

Workload: TinyCNN at 32x32 px, batch 256 per rank (~100 ms of compute per step on one core): a
timing cost of 1 ms a step would be 1%. The timed side's phases (median over its steady-state
windows) are printed too, with how well they add up to the step time.

Target: throughput ratio timed / untimed >= 0.99 (the timing costs at most 1% of a step; median of
the per-pair ratios, with the mean and its 95% interval for the noise).

Also printed, because a loaded 2-core host cannot resolve 1% between whole runs: the timing's own
host work per step measured in this process (CPU time of 10,000 steps' marks, a window close every
5 steps, and one bucket's hook wrapper: the default hook's future with the timing ``then`` on top),
as a share of the timed side's median step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Workload, add_nproc, emit_json, load, machine_line, median, quick, run_interleaved, verdict

TARGET = 0.99
_T975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 11: 2.20}
PHASES = ("data_time_s", "compute_time_s", "comm_time_s", "comm_exposed_s", "other_time_s")


def timed_phases(runs: Path) -> dict[str, float]:
    """Median per-step phases (ms) of the steady-state windows of the timed run under ``runs``,
    and the median of (data + compute + exposed + other) / step time."""
    metrics = next(runs.iterdir()) / "metrics.jsonl"
    steps = [r for r in (json.loads(x) for x in metrics.read_text(encoding="utf-8").splitlines() if x.strip())
             if r["kind"] == "step"][1:]
    out = {k: 1000 * median([r[k] for r in steps]) for k in ("step_time_s", *PHASES)}
    out["sum_ratio"] = median([(r["data_time_s"] + r["compute_time_s"] + r["comm_exposed_s"] + r["other_time_s"])
                               / r["step_time_s"] for r in steps])
    return out


def host_cost_us(steps: int = 10_000, log_every: int = 5) -> float:
    """CPU microseconds per step of the timer's own work (marks, window closes, one bucket's hook wrapper)."""
    import time

    import torch

    from cyclone_kit.runtime import phases as ph

    timer = ph.PhaseTimer(ph.HostClock())
    timer.comm_timing = ph.DDP_HOOK
    record = timer._bucket

    def hook_wrapper() -> None:  # what attach_ddp's hook adds to the default all-reduce's future
        ready = timer.clock.mark()
        fut: torch.futures.Future[int] = torch.futures.Future()

        def done(f: torch.futures.Future[int]) -> int:
            record(ready, timer.clock.mark())
            return f.value()

        chained = fut.then(done)
        fut.set_result(1)
        chained.wait()

    t0 = time.process_time()
    timer.open()
    for i in range(1, steps + 1):
        timer.mark(ph.DATA)
        timer.mark(ph.COMPUTE)
        hook_wrapper()
        timer.backward_done()
        timer.step_done()
        if i % log_every == 0:
            timer.close()
            timer.open()
    return 1e6 * (time.process_time() - t0) / steps


def main(argv: list[str] | None = None) -> int:
    """Interleaved timed/untimed pairs; print both throughputs, the ratio, the phases and the verdict."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=1 if quick() else 8)
    add_nproc(p)
    p.add_argument("--model", default="tiny_cnn")
    p.add_argument("--batch", type=int, default=32 if quick() else 256)
    p.add_argument("--steps", type=int, default=4 if quick() else 40)
    p.add_argument("--log-every", type=int, default=2 if quick() else 5)
    p.add_argument("--slice", type=float, default=0.5, help="seconds each side runs before the other")
    args = p.parse_args(argv)
    work = Workload(model=args.model, batch=args.batch, steps=args.steps, log_every=args.log_every)

    print(f"phases_overhead: {work.model}, batch {work.batch}/rank, {work.steps} steps, {args.nproc} rank(s) x 1 thread, gloo, "
          f"CPU; {args.pairs} interleaved pair(s) timed vs CYCLONE_PHASES=0, {args.slice} s slices")
    print(f"machine: {machine_line()}")
    ratios, timed, untimed, breakdowns = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="ck-bench-phases-") as tmp:
        for i in range(args.pairs):
            r = run_interleaved(work, Path(tmp), f"ph{i}", nproc=args.nproc, slice_s=args.slice,
                                other="untimed")
            timed.append(r.ours)
            untimed.append(r.other)
            ratios.append(r.ours / r.other)
            ph = timed_phases(Path(tmp) / f"runs-ph{i}")
            breakdowns.append(ph)
            print(f"  pair {i + 1}: timed {r.ours:8.1f} samples/s  untimed {r.other:8.1f} samples/s  ratio "
                  f"{ratios[-1]:.3f}  | step {ph['step_time_s']:.1f} ms = data {ph['data_time_s']:.2f} + compute "
                  f"{ph['compute_time_s']:.1f} + exposed comm {ph['comm_exposed_s']:.1f} (of {ph['comm_time_s']:.1f}) "
                  f"+ other {ph['other_time_s']:.2f} (sum/step {ph['sum_ratio']:.4f})  load {load()}", flush=True)
    ratio = median(ratios)
    met = ratio >= TARGET
    mean = statistics.fmean(ratios)
    half = (_T975.get(len(ratios) - 1, 2.0) * statistics.stdev(ratios) / len(ratios) ** 0.5) if len(ratios) > 1 else 0
    print(f"timed (default):        {median(timed):.1f} samples/s (median of {len(timed)})")
    print(f"untimed (CYCLONE_PHASES=0): {median(untimed):.1f} samples/s")
    print(f"ratio timed/untimed: {ratio:.3f} (median of per-pair ratios; spread {min(ratios):.3f}-{max(ratios):.3f}); "
          f"timing cost {100 * (1 - ratio):.1f}% of a step  target >= {TARGET}  {verdict(met)}")
    print(f"  mean {mean:.3f}, 95% interval {mean - half:.3f}-{mean + half:.3f}")
    cost = host_cost_us(1_000 if quick() else 10_000)
    step_ms = median([b["step_time_s"] for b in breakdowns])
    print(f"timing's own host work: {cost:.1f} us per step (CPU time, in-process; one bucket) = "
          f"{100 * cost / (1000 * step_ms):.3f}% of the timed side's median step ({step_ms:.1f} ms here)")
    emit_json({"bench": "phases_overhead", "timed_samples_per_s": median(timed),
               "untimed_samples_per_s": median(untimed), "ratio": ratio, "ratios": ratios, "mean": mean,
               "ci95": [mean - half, mean + half], "target": TARGET, "met": met, "load": load(),
               "phases_ms": {k: median([b[k] for b in breakdowns]) for k in breakdowns[0]},
               "host_cost_us": cost, "host_cost_share": cost / (1000 * step_ms),
               "nproc": args.nproc,
               "workload": f"{work.model} b{work.batch}/rank {work.steps} steps, {args.nproc}x1 thread, interleaved"})
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
