"""CLI latency on a login node: --help, submit --dry-run, profiles vs ``python -c pass``.

Targets: each command's median wall time under 0.25 s, and none of them imports torch,
pandas or matplotlib. Prints every figure, its target, the ratio to the bare interpreter
measured in the same run, and whether the target is met. Exit 1 when a target is missed.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGET_S = 0.25
REPEATS = 15
COMMANDS = {
    "--help": ["-m", "cyclone_kit", "--help"],
    "submit --nodes 4 --dry-run": ["-m", "cyclone_kit", "submit", "--nodes", "4", "--dry-run"],
    "profiles": ["-m", "cyclone_kit", "profiles"],
}
HEAVY = ("torch", "pandas", "matplotlib")


def median_time(argv: list[str]) -> float:
    """Median wall time of ``python ARGV`` over REPEATS runs (after one warm-up)."""
    subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, check=True)
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, check=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def heavy_imports(argv: list[str]) -> list[str]:
    """Heavy top-level packages imported by the command, from ``-X importtime``."""
    out = subprocess.run([sys.executable, "-X", "importtime", *argv], cwd=REPO, capture_output=True, text=True)
    names = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in out.stderr.splitlines() if "|" in line}
    return sorted(names & set(HEAVY))


def main() -> int:
    """Measure, print, and return 0 when every target is met."""
    base = median_time(["-c", "pass"])
    print(f"cli_latency: python -c pass median {base * 1000:.0f} ms (reference, same run)")
    ok = True
    for label, argv in COMMANDS.items():
        t = median_time(argv)
        heavy = heavy_imports(argv)
        met = t < TARGET_S and not heavy
        ok &= met
        print(f"  {label:<28} median {t * 1000:6.0f} ms  target < {TARGET_S * 1000:.0f} ms  "
              f"ratio vs bare python {t / base:4.1f}x  heavy imports: {', '.join(heavy) or 'none'}  "
              f"{'MET' if met else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
