"""CPU scaling and start-up: 2 ranks x 1 thread vs 1 rank x 1 thread, cyclone_kit launcher vs torchrun.

Ours: ``python -m cyclone_kit run SPEC --nproc {1,2} --threads 1`` (the local launcher and the
runtime). Reference: ``torchrun --standalone --nproc-per-node {1,2} bench/plain_ddp.py`` (a plain
DDP script). Same workload and measurement on both sides (see bench/common.py). A repeat runs
two interleaved pairs, ours-1 with torchrun-1 and ours-2 with torchrun-2: both sides of a pair
are started at once and take turns every 0.5 s (SIGSTOP/SIGCONT), so the host's slow drifts,
which moved sequential runs by up to 10%, hit both alike (``run_interleaved``).

Figures:
* efficiency = samples/s(2 ranks) / (2 x samples/s(1 rank)), per repeat, median.
  Target: ours >= torchrun's (within nothing: the medians are compared as they are).
* process start to first step, 2 ranks: from starting the command to the first training step
  starting on rank 0, counting only the time the side was running. Target: ours <= the torchrun +
  plain script figure + 0.5 s. Also printed, for information: the plain script started directly
  as one ``python`` process (no launcher, run alone).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    Interleaved,
    Workload,
    emit_json,
    load,
    machine_line,
    median,
    plain_start_s,
    quick,
    run_interleaved,
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
    start: dict[str, list[float]] = {"ours": [], "torchrun": [], "python": [], "ours1": []}
    with tempfile.TemporaryDirectory(prefix="ck-bench-scaling-") as tmp:
        tmpd = Path(tmp)
        for i in range(args.repeats):
            got: dict[int, Interleaved] = {}
            for n in ((1, 2) if i % 2 == 0 else (2, 1)):
                r = run_interleaved(work, tmpd, f"sc{n}-{i}", nproc=n, other="torchrun")
                got[n] = r
                print(f"  repeat {i + 1}, {n} rank(s): cyclone_kit {r.ours:8.1f} samples/s, start->first step "
                      f"{r.ours_start_s:5.2f} s | torchrun + plain script {r.other:8.1f} samples/s, start->first step "
                      f"{r.other_start_s:5.2f} s  load {load()}", flush=True)
            eff["ours"].append(got[2].ours / (2 * got[1].ours))
            eff["torchrun"].append(got[2].other / (2 * got[1].other))
            start["ours"].append(got[2].ours_start_s)
            start["torchrun"].append(got[2].other_start_s)
            start["ours1"].append(got[1].ours_start_s)
            if not quick():  # the informational direct start; left out of the smoke runs to save time
                start["python"].append(plain_start_s(work, tmpd, f"sc-python-{i}"))

    e_ours, e_tr = median(eff["ours"]), median(eff["torchrun"])
    s_ours, s_tr = median(start["ours"]), median(start["torchrun"])
    s_py = median(start["python"]) if start["python"] else None
    eff_met = e_ours >= e_tr
    start_met = s_ours <= s_tr + START_SLACK_S
    print(f"efficiency 2 ranks vs 1 (cyclone_kit): {e_ours:.3f}  (per repeat: {', '.join(f'{x:.3f}' for x in eff['ours'])})")
    print(f"efficiency 2 ranks vs 1 (torchrun):    {e_tr:.3f}  (per repeat: {', '.join(f'{x:.3f}' for x in eff['torchrun'])})")
    print(f"  target: ours >= torchrun's  ratio {e_ours / e_tr:.3f}  {verdict(eff_met)}")
    print(f"start -> first step, 2 ranks: cyclone_kit {s_ours:.2f} s, torchrun + plain script {s_tr:.2f} s "
          f"(difference {s_ours - s_tr:+.2f} s)")
    print(f"  target: ours <= torchrun's + {START_SLACK_S} s  {verdict(start_met)}")
    if s_py is not None:
        s_ours1 = median(start["ours1"])
        print(f"  for information, 1 process: plain script started directly with python {s_py:.2f} s, "
              f"cyclone_kit 1 rank through the launcher {s_ours1:.2f} s ({s_ours1 - s_py:+.2f} s)")
    emit_json({"bench": "scaling_cpu", "efficiency_ours": e_ours, "efficiency_torchrun": e_tr,
               "efficiency_met": eff_met, "efficiencies_ours": eff["ours"], "efficiencies_torchrun": eff["torchrun"],
               "start_ours_s": s_ours, "start_torchrun_s": s_tr, "start_python_s": s_py,
               "start_ours_1rank_s": median(start["ours1"]),
               "start_met": start_met, "start_slack_s": START_SLACK_S, "load": load(),
               "workload": f"{work.model} b{work.batch}/rank {work.steps} steps, 1 thread/rank"})
    return 0 if eff_met and start_met else 1


if __name__ == "__main__":
    sys.exit(main())
