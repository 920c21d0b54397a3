"""The launch shim costs nothing: examples/plain_ddp.py through ``cyclone-kit run --nproc 2`` vs ``torchrun``.

Ours: ``python -m cyclone_kit run examples/plain_ddp.py --nproc 2 --threads 1 --cpu --quiet -- ARGS``
(the local launcher, then the launch shim on every rank, which sets the torchrun variables and runs
the script in the same process). Reference: ``torchrun --standalone --nproc-per-node 2
examples/plain_ddp.py ARGS``. The same unchanged script on both sides, one thread per rank, the same
allocator settings (bench_env), interleaved pairs as in bench/common.py: both sides start at once
and take turns every 0.5 s (SIGSTOP/SIGCONT of the whole process tree), and every figure counts
only the time its side was running.

Figures (medians over the pairs):
* throughput ratio = ours / torchrun, each the samples of the script's timed steps (after its
  warm-up steps) over the running time between the script's own timestamps. Target >= 0.99.
* process start to first step: from starting the command to rank 0 entering its training loop.
  Target: ours <= torchrun's + 0.3 s.
"""

from __future__ import annotations

import argparse
import re
import signal as sg
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    REPO,
    _active_time,
    _popen,
    _signal_all,
    _tree,
    add_nproc,
    bench_env,
    emit_json,
    load,
    machine_line,
    median,
    quick,
    teardown_line,
    verdict,
)

SCRIPT = REPO / "examples" / "plain_ddp.py"
START_SLACK_S = 0.3
RATIO_TARGET = 0.99
_TIMING = re.compile(r"plain_ddp: .* \(loop started ([\d.]+), timed ([\d.]+) to ([\d.]+) unix, (\d+) samples\)")


def _timing(text: str, side: str) -> tuple[float, float, float, int]:
    match = _TIMING.search(text)
    if not match:
        raise RuntimeError(f"{side}: no timing line from plain_ddp.py in:\n{text[-2000:]}")
    return float(match.group(1)), float(match.group(2)), float(match.group(3)), int(match.group(4))


def pair(tmp: Path, tag: str, script_args: list[str], nproc: int = 2, slice_s: float = 0.5,
         timeout: float = 900) -> dict[str, float]:
    """One interleaved pair; returns each side's throughput and start-up in running time."""
    env = bench_env()
    runs = tmp / f"runs-{tag}"
    argv = {
        "ours": [sys.executable, "-m", "cyclone_kit", "run", str(SCRIPT), "--nproc", str(nproc), "--threads", "1", "--cpu",
                 "--quiet", "--runs-dir", str(runs), "--", *script_args],
        "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                     str(SCRIPT), *script_args],
    }
    launched: dict[str, float] = {}
    procs: dict[str, subprocess.Popen[str]] = {}
    for side in ("ours", "torchrun"):
        launched[side] = time.time()
        procs[side] = _popen(argv[side], env)
    _signal_all([procs["torchrun"].pid], sg.SIGSTOP)
    _signal_all(_tree(procs["torchrun"].pid), sg.SIGSTOP)
    running: dict[str, list[tuple[float, float]]] = {"ours": [], "torchrun": [(launched["torchrun"], time.time())]}
    current, began = "ours", launched["ours"]
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
            time.sleep(slice_s)
            nxt = "torchrun" if current == "ours" else "ours"
            if procs[nxt].poll() is not None:
                continue
            _signal_all([procs[current].pid], sg.SIGSTOP)
            _signal_all(_tree(procs[current].pid), sg.SIGSTOP)
            running[current].append((began, time.time()))
            _signal_all(_tree(procs[nxt].pid), sg.SIGCONT)
            current, began = nxt, time.time()
        running[current].append((began, time.time()))
    finally:
        outputs = {}
        for side, p in procs.items():
            _signal_all(_tree(p.pid), sg.SIGCONT)
            if p.poll() is None and time.monotonic() >= deadline:
                _signal_all(_tree(p.pid), sg.SIGKILL)
            outputs[side] = p.communicate()
            if p.returncode != 0 and side == "torchrun" and _TIMING.search(outputs[side][0]):
                teardown_line(tag, p.returncode, outputs[side][1])  # its timing line is out: kept
            elif p.returncode != 0:
                raise RuntimeError(f"{tag} {side} exited {p.returncode}:\n{outputs[side][0][-1500:]}\n"
                                   f"{outputs[side][1][-2500:]}")
    run_dir = next(runs.iterdir())
    texts = {"ours": (run_dir / "logs" / "rank-0.out").read_text(), "torchrun": outputs["torchrun"][0]}
    out: dict[str, float] = {}
    for side, text in texts.items():
        loop_start, t0, t1, samples = _timing(text, side)
        out[side] = samples / _active_time(running[side], t0, t1)
        out[f"{side}_start_s"] = _active_time(running[side], launched[side], loop_start)
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the pairs, print the figures and verdicts; exit 1 when a target is missed."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=1 if quick() else 6)
    add_nproc(p)
    p.add_argument("--steps", type=int, default=6 if quick() else 60)
    p.add_argument("--warmup", type=int, default=2 if quick() else 10)
    p.add_argument("--batch-size", type=int, default=32 if quick() else 256)
    p.add_argument("--width", type=int, default=64 if quick() else 1024)
    args = p.parse_args(argv)
    script_args = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--batch-size", str(args.batch_size),
                   "--width", str(args.width)]
    print(f"script_shim: examples/plain_ddp.py {' '.join(script_args)}, {args.nproc} rank(s) x 1 thread, gloo, CPU; "
          f"{args.pairs} interleaved pair(s)")
    print(f"machine: {machine_line()}")
    ratios, starts = [], {"ours": [], "torchrun": []}
    with tempfile.TemporaryDirectory(prefix="ck-bench-shim-") as tmp:
        for i in range(args.pairs):
            r = pair(Path(tmp), f"p{i}", script_args, nproc=args.nproc)
            ratios.append(r["ours"] / r["torchrun"])
            starts["ours"].append(r["ours_start_s"])
            starts["torchrun"].append(r["torchrun_start_s"])
            print(f"  pair {i + 1}: cyclone-kit run {r['ours']:9.1f} samples/s, start->first step {r['ours_start_s']:5.2f} s"
                  f" | torchrun {r['torchrun']:9.1f} samples/s, start->first step {r['torchrun_start_s']:5.2f} s"
                  f" | ratio {ratios[-1]:.3f}  load {load()}", flush=True)
    ratio = median(ratios)
    s_ours, s_tr = median(starts["ours"]), median(starts["torchrun"])
    ratio_met, start_met = ratio >= RATIO_TARGET, s_ours <= s_tr + START_SLACK_S
    print(f"throughput ratio cyclone-kit run / torchrun: {ratio:.3f} (pairs: {', '.join(f'{x:.3f}' for x in ratios)})")
    print(f"  target: >= {RATIO_TARGET}  {verdict(ratio_met)}")
    print(f"start -> first step: cyclone-kit run {s_ours:.2f} s, torchrun {s_tr:.2f} s (difference {s_ours - s_tr:+.2f} s)")
    print(f"  target: ours <= torchrun's + {START_SLACK_S} s  {verdict(start_met)}")
    emit_json({"bench": "script_shim", "ratio": ratio, "ratios": ratios, "ratio_met": ratio_met,
               "start_ours_s": s_ours, "start_torchrun_s": s_tr, "start_met": start_met,
               "start_slack_s": START_SLACK_S, "load": load(), "nproc": args.nproc,
               "workload": " ".join(script_args)})
    return 0 if ratio_met and start_met else 1


if __name__ == "__main__":
    sys.exit(main())
