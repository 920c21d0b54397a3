"""CPU scaling and start-up: 2 ranks x 1 thread vs 1 rank x 1 thread, cyclone_kit launcher vs torchrun.

Ours: ``python -m cyclone_kit run SPEC --nproc {1,2} --threads 1`` (the local launcher and the
runtime). Reference: ``torchrun --standalone --nproc-per-node {1,2} bench/plain_ddp.py`` (a plain
DDP script). Same workload and measurement on both sides (see bench/common.py); the runs of a
repeat go ours-1, ours-2, torchrun-1, torchrun-2 and the next repeat in reverse order.

Figures:
* efficiency = samples/s(2 ranks) / (2 x samples/s(1 rank)), per repeat, median.
  Target: ours >= torchrun's (within nothing: the medians are compared as they are).
* process start to first step, 2 ranks: from starting the command to the first training step
  starting on rank 0. Target: ours <= the torchrun + plain script figure + 0.5 s. Also printed,
  for information: the plain script started directly as one ``python`` process (no launcher).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    RunResult,
    Workload,
    emit_json,
    load,
    machine_line,
    median,
    quick,
    run_ours,
    run_plain,
    verdict,
)

START_SLACK_S = 0.5


def main(argv: list[str] | None = None) -> int:
    """Run the repeats, print efficiencies and start-up times with their verdicts; exit 1 when missed."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=1 if quick() else 4)
    p.add_argument("--model", default="tiny_cnn")
    p.add_argument("--batch", type=int, default=32 if quick() else 256)
    p.add_argument("--steps", type=int, default=4 if quick() else 30)
    p.add_argument("--log-every", type=int, default=2 if quick() else 5)
    args = p.parse_args(argv)
    work = Workload(model=args.model, batch=args.batch, steps=args.steps, log_every=args.log_every)

    print(f"scaling_cpu: {work.model}, batch {work.batch}/rank, {work.steps} steps, 1 thread per rank, gloo, CPU; "
          f"{args.repeats} repeat(s)")
    print(f"machine: {machine_line()}")
    eff: dict[str, list[float]] = {"ours": [], "torchrun": []}
    cpu_eff: dict[str, list[float]] = {"ours": [], "torchrun": []}
    start: dict[str, list[float]] = {"ours": [], "torchrun": [], "python": [], "ours1": []}
    with tempfile.TemporaryDirectory(prefix="ck-bench-scaling-") as tmp:
        tmpd = Path(tmp)
        for i in range(args.repeats):
            jobs = [("ours", 1), ("ours", 2), ("torchrun", 1), ("torchrun", 2)]
            if not quick():  # the informational direct start; left out of the smoke runs to save time
                jobs.append(("python", 1))
            if i % 2:
                jobs.reverse()
            got: dict[tuple[str, int], RunResult] = {}
            for side, n in jobs:
                tag = f"sc-{side}{n}-{i}"
                r = (run_ours(work, n, tmpd, tag) if side == "ours"
                     else run_plain(work, n, tmpd, tag, torchrun=side == "torchrun"))
                got[(side, n)] = r
                print(f"  repeat {i + 1} {r.side:<24} {n} rank(s): {r.samples_per_s:8.1f} samples/s  "
                      f"start->first step {r.start_to_first_step_s:5.2f} s  wall {r.wall_s:5.1f} s  load {r.load}")
            for side in ("ours", "torchrun"):
                eff[side].append(got[(side, 2)].samples_per_s / (2 * got[(side, 1)].samples_per_s))
                one, two = got[(side, 1)].cpu_ms_per_sample, got[(side, 2)].cpu_ms_per_sample
                if one and two:
                    cpu_eff[side].append(one / two)
                start[side].append(got[(side, 2)].start_to_first_step_s)
            start["ours1"].append(got[("ours", 1)].start_to_first_step_s)
            if ("python", 1) in got:
                start["python"].append(got[("python", 1)].start_to_first_step_s)

    e_ours, e_tr = median(eff["ours"]), median(eff["torchrun"])
    s_ours, s_tr = median(start["ours"]), median(start["torchrun"])
    s_py = median(start["python"]) if start["python"] else None
    eff_met = e_ours >= e_tr
    start_met = s_ours <= s_tr + START_SLACK_S
    print(f"efficiency 2 ranks vs 1 (cyclone_kit): {e_ours:.3f}  (per repeat: {', '.join(f'{x:.3f}' for x in eff['ours'])})")
    print(f"efficiency 2 ranks vs 1 (torchrun):    {e_tr:.3f}  (per repeat: {', '.join(f'{x:.3f}' for x in eff['torchrun'])})")
    print(f"  target: ours >= torchrun's  ratio {e_ours / e_tr:.3f}  {verdict(eff_met)}")
    c_ours = median(cpu_eff["ours"]) if cpu_eff["ours"] else None
    c_tr = median(cpu_eff["torchrun"]) if cpu_eff["torchrun"] else None
    if c_ours is not None and c_tr is not None:
        print(f"  cross-check, CPU efficiency (CPU time per sample, 1 rank / 2 ranks; less moved by other load than wall time): "
              f"cyclone_kit {c_ours:.3f}, torchrun {c_tr:.3f}")
    print(f"start -> first step, 2 ranks: cyclone_kit {s_ours:.2f} s, torchrun + plain script {s_tr:.2f} s "
          f"(difference {s_ours - s_tr:+.2f} s)")
    print(f"  target: ours <= torchrun's + {START_SLACK_S} s  {verdict(start_met)}")
    if s_py is not None:
        s_ours1 = median(start["ours1"])
        print(f"  for information, 1 process: plain script started directly with python {s_py:.2f} s, "
              f"cyclone_kit 1 rank through the launcher {s_ours1:.2f} s ({s_ours1 - s_py:+.2f} s)")
    emit_json({"bench": "scaling_cpu", "efficiency_ours": e_ours, "efficiency_torchrun": e_tr,
               "efficiency_met": eff_met, "cpu_efficiency_ours": c_ours, "cpu_efficiency_torchrun": c_tr,
               "start_ours_s": s_ours, "start_torchrun_s": s_tr, "start_python_s": s_py,
               "start_ours_1rank_s": median(start["ours1"]),
               "start_met": start_met, "start_slack_s": START_SLACK_S, "load": load(),
               "workload": f"{work.model} b{work.batch}/rank {work.steps} steps, 1 thread/rank"})
    return 0 if eff_met and start_met else 1


if __name__ == "__main__":
    sys.exit(main())
