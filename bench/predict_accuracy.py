"""How well ``cyclone-kit predict`` foresees the 2-rank efficiency, on the real local Slurm cluster.

1. ``cyclone-kit doctor --profile local --partition cpu --nodes 2`` measures the network (its
   all-reduce sweep, fitted into network.json);
2. a strong study (bench/jobs/predict_strong.toml) and a weak one (bench/jobs/predict_weak.toml) of
   the built-in engine run at 1 rank (c1) and 2 ranks (c1 + c2, one per node), one thread each,
   ``--repeats`` times each (one point at a time: the test cluster's nodes share this machine's cores);
3. ``predict`` calibrates on each study's 1-rank run and the doctor's figures alone and predicts the
   2-rank efficiency, which is set against the measured one.

Figures: per study and repeat, predicted and measured efficiency at N = 2 and the error in
percentage points; the ratio |error| / 10 points (target <= 1: within 10 points, the issue's
target). The reference (the measured efficiency) is measured in the same run. Needs the local
cluster (``scripts/local-slurm.sh start``); says so and exits 0 without one.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO, emit_json, machine_line, median, quick, verdict

TARGET_POINTS = 10.0
STUDIES = {"strong": REPO / "bench" / "jobs" / "predict_strong.toml", "weak": REPO / "bench" / "jobs" / "predict_weak.toml"}


def cli(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """Run ``python -m cyclone_kit ARGS`` from the repository."""
    return subprocess.run([sys.executable, "-m", "cyclone_kit", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, check=False)


def wait_for_study(study: Path, deadline_s: float) -> None:
    """Wait until every point of the study has its end record (or the deadline passes)."""
    end = time.monotonic() + deadline_s
    points = [p for p in study.iterdir() if (p / "spec.json").is_file()]
    while time.monotonic() < end:
        done = 0
        for p in points:
            metrics = p / "metrics.jsonl"
            if metrics.is_file() and '"kind":"end"' in metrics.read_text():
                done += 1
        if done == len(points):
            return
        time.sleep(2)
    raise TimeoutError(f"{study}: not every point ended within {deadline_s:.0f} s")


def run_study(spec: Path, runs: Path, steps: int) -> Path:
    """Submit one study to the local cluster and wait for it; returns its directory."""
    before = set(runs.glob("*"))
    result = cli("sweep", str(spec), "--backend", "slurm", "--runs-dir", str(runs), "--set", f"train.steps={steps}")
    if result.returncode:
        raise RuntimeError(f"sweep failed: {result.stderr.strip() or result.stdout.strip()}")
    (study,) = set(runs.glob("*")) - before
    wait_for_study(study, 1800)
    return study


def main(argv: list[str] | None = None) -> int:
    """Run doctor, the studies and the predictions; print every figure."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--network", default=None, help="reuse a doctor run's network.json instead of running doctor")
    args = p.parse_args(argv)
    if quick():
        print("predict_accuracy: quick mode: skipped (a doctor run and four real studies take minutes)")
        return 0
    if shutil.which("sbatch") is None or subprocess.run(["sinfo"], capture_output=True, check=False).returncode:
        print("predict_accuracy: no Slurm cluster here (scripts/local-slurm.sh start): skipped")
        return 0
    print(f"predict_accuracy: built-in engine, 1 vs 2 ranks (one per node, 1 thread), {args.steps} steps, "
          f"{args.repeats} repeat(s) per study")
    print(f"machine: {machine_line()}")
    runs = Path(tempfile.mkdtemp(prefix="ck-predict-bench-"))
    network = args.network
    if network is None:
        doctor = cli("doctor", "--profile", "local", "--partition", "cpu", "--nodes", "2", "--runs-dir", str(runs),
                     "--json")
        checks = json.loads(doctor.stdout or "[]")
        figures = next((c for c in checks if c["check"] == "network_figures"), None)
        if not figures or not figures.get("data"):
            print(f"doctor measured no network figures: {doctor.stdout[-500:]} {doctor.stderr[-500:]}")
            return 1
        network = str(next(runs.glob("ck-doctor-*")) / "network.json")
        print(f"doctor: {figures['detail']}")
    results = []
    for mode, spec in STUDIES.items():
        for repeat in range(1, args.repeats + 1):
            study = run_study(spec, runs, args.steps)
            out = cli("predict", str(study), "--nodes", "1,2", "--network", network, "--json")
            if out.returncode:  # e.g. a point stopped by a signal from outside: said, and the next repeat runs
                print(f"  {mode} repeat {repeat}: no prediction: {out.stderr.strip()}")
                continue
            doc = json.loads(out.stdout)
            predicted = next(p["efficiency"] for p in doc["points"] if p["world_size"] == 2)
            measured = doc["measured_efficiency"]["2"]
            error = 100 * (predicted - measured)
            results.append({"mode": mode, "repeat": repeat, "predicted": predicted, "measured": measured,
                            "error_points": error, "study": str(study)})
            print(f"  {mode} repeat {repeat}: N = 2 efficiency predicted {100 * predicted:.1f} %, measured "
                  f"{100 * measured:.1f} %: error {error:+.1f} points  ({study.name})")
    if not results:
        print("no study gave a prediction")
        return 1
    worst = max(abs(r["error_points"]) for r in results)
    typical = median([abs(r["error_points"]) for r in results])
    ratio = worst / TARGET_POINTS
    print(f"prediction error at N = 2: median |error| {typical:.1f} points, worst {worst:.1f} points")
    print(f"ratio worst |error| / {TARGET_POINTS:g} points: {ratio:.2f}  target <= 1  {verdict(ratio <= 1)}")
    emit_json({"results": results, "median_abs_error_points": typical, "worst_abs_error_points": worst,
               "ratio": ratio, "met": ratio <= 1, "network": network})
    return 0


if __name__ == "__main__":
    sys.exit(main())
