"""``status --runs-dir`` of 1 and of 100 runs on the real (local) Slurm cluster: wall time and Slurm calls.

Each run directory records a task of one held array job (100 tasks, PENDING in squeue), as a
sweep's points would. The reference is ``status`` of a runs directory holding a single such run,
measured in the same invocation. Target: 100 runs take at most 1.5x the time of 1 run (Slurm is
asked once per call for all of them: one squeue, one sacct at most), and every run is shown.
Counting wrappers for squeue and sacct, first on PATH, report the calls. Prints every figure and
MET/MISSED; exit 1 when missed, 2 when no Slurm cluster answers.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from cyclone_kit.rundir.layout import RunDir  # noqa: E402

MANY = 100
REPEATS = 5
TARGET_RATIO = 1.5


def make_runs(root: Path, ids: list[str]) -> Path:
    """A runs directory with one run per job id (spec.json, job_id, backend slurm)."""
    for i, job_id in enumerate(ids):
        RunDir.create(root, f"point{i:03d}", json.dumps({"name": f"point{i:03d}"}) + "\n").write_submission(
            job_id, "slurm")
    return root


def wrappers(bin_dir: Path, log: Path) -> dict[str, str]:
    """squeue/sacct wrappers that append their name to ``log``; the environment that puts them first."""
    bin_dir.mkdir()
    for name in ("squeue", "sacct"):
        real = shutil.which(name)
        (bin_dir / name).write_text(f'#!/bin/sh\necho {name} >> "{log}"\nexec "{real}" "$@"\n')
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(REPO)}


def timed_status(runs: Path, env: dict[str, str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "cyclone_kit", "status", "--runs-dir", str(runs)], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    return time.perf_counter() - t0, done.stdout


def main() -> int:
    if shutil.which("squeue") is None or subprocess.run(["scontrol", "ping"], capture_output=True,
                                                        check=False).returncode != 0:
        print("no Slurm cluster answers (start one: sudo scripts/local-slurm.sh start)")
        return 2
    held = subprocess.run(["sbatch", "--parsable", "--hold", f"--array=0-{MANY - 1}", "--job-name=ck-bench-status",
                           "--output=/dev/null", "--time=00:05:00", "--wrap=true"], capture_output=True, text=True,
                          check=True)
    array_id = held.stdout.strip().split(";")[0]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            one = make_runs(root / "one", [f"{array_id}_0"])
            many = make_runs(root / "many", [f"{array_id}_{i}" for i in range(MANY)])
            log = root / "calls.log"
            env = wrappers(root / "bin", log)
            times: dict[str, list[float]] = {"1 run": [], f"{MANY} runs": []}
            shown = 0
            for _ in range(REPEATS):  # interleaved, so a drift of the shared host hits both
                times["1 run"].append(timed_status(one, env)[0])
                log.write_text("")
                elapsed, out = timed_status(many, env)
                times[f"{MANY} runs"].append(elapsed)
                calls = log.read_text().split()
                shown = sum(1 for i in range(MANY) if f"{array_id}_{i} " in out)
            one_s, many_s = (statistics.median(v) for v in times.values())
            ratio = many_s / one_s
            print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; median of {REPEATS}")
            print(f"status, 1 run:      {one_s:.3f} s")
            print(f"status, {MANY} runs:   {many_s:.3f} s  ({shown} of {MANY} shown; Slurm calls: "
                  f"{calls.count('squeue')} squeue, {calls.count('sacct')} sacct)")
            ok = ratio <= TARGET_RATIO and shown == MANY and calls.count("squeue") == 1
            print(f"ratio {ratio:.2f} (target <= {TARGET_RATIO}): {'MET' if ok else 'MISSED'}")
            return 0 if ok else 1
    finally:
        subprocess.run(["scancel", array_id], check=False)


if __name__ == "__main__":
    sys.exit(main())
