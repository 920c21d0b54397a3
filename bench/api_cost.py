"""The public API's per-step cost: time inside the ``ck.*`` calls of examples/ddp_ck.py, against its step time.

examples/ddp_ck.py is examples/plain_ddp.py plus the ``ck.*`` calls, so what the API costs a
training step is exactly the time spent inside those calls. This benchmark measures that time
directly, on every step, instead of as the small difference of two noisy throughputs: it runs
ddp_ck.py unchanged on 2 ranks (the local launcher, gloo, 1 thread per rank), with
``cyclone_kit.api.log_step`` and ``stop_requested`` wrapped in ``time.perf_counter`` timers, and
the step time taken as the interval between consecutive ``ck.log_step`` calls. The per-step
figures count the loss's accumulation, the window's record every ``log_every`` steps (the one
host sync of the loss) and the stop agreement's asynchronous all-reduce about every
``checkpoint.poll_s``; the one-off calls (``init``, ``load_checkpoint``, ``finish``) are printed
apart. (The module ``__getattr__`` that resolves ``ck.log_step``, ~0.1 us, is outside the timers.)

Workload (default): ddp_ck.py's MLP at width 1024 (3.2M parameters), 32x32x3 inputs, batch 256 per
rank: tens of milliseconds a step on one core (forward, backward, a 12 MB gradient all-reduce), so a
per-step API cost of 1% would be a few hundred microseconds. The mean per-step figure includes the
stop agreement's wait for the other rank's previous all-reduce when a rank runs ahead (skew that
DDP's next all-reduce would absorb otherwise), which is why it sits above the median.

Target: (time in per-step ck calls) / (step time) <= 0.01, over the steps after the first window
(summed over the steps, i.e. the amortised cost), on rank 0 (the rank that writes) and rank 1.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO, add_nproc, emit_json, load, machine_line, quick, verdict

TARGET = 0.01
DDP_CK = REPO / "examples" / "ddp_ck.py"


def rank_main(out: Path, script_args: list[str]) -> int:
    """Run examples/ddp_ck.py in this process with the per-step ck calls timed; write the timings."""
    from cyclone_kit import api

    per_step: dict[int, float] = {}
    by_call: dict[str, list[float]] = {"log_step": [], "stop_requested": []}
    step_ends: list[tuple[int, float]] = []
    once: dict[str, float] = {}
    state = {"step": 0}

    def timed(name: str, per: bool) -> Callable[..., Any]:
        inner = getattr(api, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                t1 = time.perf_counter()
                if name == "log_step":
                    state["step"] = args[0] if args else kwargs["step"]
                    step_ends.append((state["step"], t0))
                if per:
                    per_step[state["step"]] = per_step.get(state["step"], 0.0) + (t1 - t0)
                    by_call[name].append(t1 - t0)
                else:
                    once[name] = once.get(name, 0.0) + (t1 - t0)
        return call

    for name in ("log_step", "stop_requested"):
        setattr(api, name, timed(name, per=True))
    for name in ("init", "load_checkpoint", "save_checkpoint", "finish"):
        setattr(api, name, timed(name, per=False))
    sys.argv = [str(DDP_CK), *script_args]
    try:
        runpy.run_path(str(DDP_CK), run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    rank = int(os.environ.get("SLURM_PROCID", "0"))
    out.joinpath(f"rank-{rank}.json").write_text(json.dumps({"per_step": per_step, "step_ends": step_ends,
                                                             "once": once, "by_call": by_call}))
    return 0


def summarise(data: dict, skip: int) -> dict[str, float]:
    """Per-step API time and step time (from consecutive log_step entries) after the first ``skip`` steps."""
    ends = data["step_ends"]
    steps = [(ends[i][0], ends[i][1] - ends[i - 1][1]) for i in range(1, len(ends)) if ends[i][0] > skip]
    api = [data["per_step"].get(str(step), 0.0) for step, _ in steps]
    wall = [dt for _, dt in steps]
    calls = {f"{name}_us_mean": 1e6 * statistics.mean(v[skip:] or v) for name, v in data["by_call"].items() if v}
    return {**calls, "steps": len(steps), "api_us_median": 1e6 * statistics.median(api),
            "api_us_mean": 1e6 * statistics.mean(api), "api_us_max": 1e6 * max(api),
            "step_ms_median": 1e3 * statistics.median(wall), "ratio": sum(api) / sum(wall)}


def main(argv: list[str] | None = None) -> int:
    """Launch the ranks (2; quick mode 1) of the timed ddp_ck.py, print the figures and the verdict; exit 1 when missed."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank-out", type=Path, help=argparse.SUPPRESS)  # the per-rank mode (set by this script)
    p.add_argument("--batch", type=int, default=32 if quick() else 256)
    p.add_argument("--steps", type=int, default=30 if quick() else 120)
    p.add_argument("--width", type=int, default=64 if quick() else 1024, help="hidden units of ddp_ck.py's model")
    p.add_argument("--log-every", type=int, default=10)
    add_nproc(p, "ranks")
    args, rest = p.parse_known_args(argv)
    if args.rank_out is not None:
        return rank_main(args.rank_out, [a for a in rest if a != "--"])

    from cyclone_kit.backends.srun_emulator import launch

    print(f"api_cost: examples/ddp_ck.py (width {args.width}), batch {args.batch}/rank, {args.steps} steps, "
          f"log_every {args.log_every}, "
          f"{args.nproc} ranks x 1 thread, gloo, CPU")
    print(f"machine: {machine_line()}")
    with tempfile.TemporaryDirectory(prefix="ck-bench-api-") as tmp:
        run_dir, out = Path(tmp) / "run", Path(tmp) / "out"
        run_dir.mkdir()
        out.mkdir()
        (run_dir / "spec.json").write_text(json.dumps({"train": {"log_every": args.log_every}}))
        command = [sys.executable, str(Path(__file__).resolve()), "--rank-out", str(out), "--",
                   "--steps", str(args.steps), "--batch-size", str(args.batch), "--width", str(args.width)]
        result = launch(run_dir, args.nproc, threads=1, command=command, timeout_s=1800,
                        extra_env={"CUDA_VISIBLE_DEVICES": ""})
        if not result.ok:
            err = (run_dir / "logs" / "rank-0.err").read_text()[-3000:]
            print(f"error: the ranks failed: {result.first_failure}\n{err}")
            return 1
        ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(args.nproc)]
    figures = {}
    for r, data in enumerate(ranks):
        s = summarise(data, skip=args.log_every)
        figures[f"rank{r}"] = s
        once = ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in sorted(data["once"].items()))
        print(f"rank {r}: {s['steps']} steps of {s['step_ms_median']:.1f} ms (median); per-step ck calls "
              f"median {s['api_us_median']:.1f} us, mean {s['api_us_mean']:.1f} us, max {s['api_us_max']:.0f} us "
              f"-> {100 * s['ratio']:.3f} % of the step time (mean log_step {s['log_step_us_mean']:.0f} us, "
              f"stop_requested {s['stop_requested_us_mean']:.0f} us); once: {once}")
    worst = max(f["ratio"] for f in figures.values())
    met = worst <= TARGET
    print(f"API per-step cost: {100 * worst:.3f} % of the step (target <= {100 * TARGET:.0f} %): {verdict(met)}  "
          f"[load {load()}]")
    emit_json({"bench": "api_cost", "ratio": worst, "target": TARGET, "met": met, "nproc": args.nproc, **figures})
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
