"""Run every benchmark, print each figure with its target and MET/MISSED, rewrite bench/RESULTS.md.

``make bench`` runs ``.venv/bin/python bench/run_all.py``. Benchmarks (each in its own process,
one after the other, output streamed as it comes): cli_latency, analysis, overhead, phases_overhead, scaling_cpu,
script_shim, api_cost, async_checkpoint, rank_start, predict_accuracy (needs the local Slurm cluster; says so and skips
without one).
bench/gpu_check.sh needs an NVIDIA GPU and is not run here; the GPU section and the notes section
of RESULTS.md (between the ``gpu-check`` / ``notes`` markers) are kept as they are when the file
is rewritten.

Options: ``--only NAME`` (repeatable), ``--results PATH`` (default bench/RESULTS.md),
``--strict`` (exit 1 when a target is missed; by default only a crashed benchmark fails).
``CK_BENCH_QUICK=1`` runs every benchmark in its smoke mode (for the tests; figures meaningless).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO, cpu_model, load, quick

BENCH = REPO / "bench"
GPU_BEGIN, GPU_END = "<!-- gpu-check -->", "<!-- /gpu-check -->"
NOTES_BEGIN, NOTES_END = "<!-- notes -->", "<!-- /notes -->"
NOTES_DEFAULT = f"""{NOTES_BEGIN}
## Notes (kept when the file is rewritten: profiles of missed targets, caveats)

(none yet)
{NOTES_END}"""
GPU_DEFAULT = f"""{GPU_BEGIN}
## GPU check (bench/gpu_check.sh)

**Not run on a GPU yet.** No machine with an NVIDIA GPU has been available to this project so far.
The script's CPU dry run (`bash bench/gpu_check.sh --cpu-dry-run`: same code, tiny model,
4 steps, gloo instead of NCCL) runs in the test suite. When it has run on a GPU, paste what it
printed here (this section is kept when `make bench` rewrites the file).
{GPU_END}"""


@dataclass
class Figure:
    """One reported figure: what, the value as text, the target as text, the verdict."""

    bench: str
    name: str
    value: str
    target: str
    verdict: str  # MET / MISSED / INFO


def commands(is_quick: bool) -> dict[str, list[str]]:
    """The argv of each benchmark (smoke-sized in quick mode)."""
    py = sys.executable
    if is_quick:
        cli = [py, "-c", f"import sys; sys.path.insert(0, {str(BENCH)!r}); import cli_latency as c; "
               "c.REPEATS = 1; sys.exit(c.main())"]
        analysis = [py, str(BENCH / "analysis.py"), "--runs", "4", "--steps", "200", "--repeat", "1"]
    else:
        cli = [py, str(BENCH / "cli_latency.py")]
        analysis = [py, str(BENCH / "analysis.py")]
    return {"cli_latency": cli, "analysis": analysis, "overhead": [py, str(BENCH / "overhead.py")],
            "phases_overhead": [py, str(BENCH / "phases_overhead.py")],
            "scaling_cpu": [py, str(BENCH / "scaling_cpu.py")], "script_shim": [py, str(BENCH / "script_shim.py")],
            "api_cost": [py, str(BENCH / "api_cost.py")], "async_checkpoint": [py, str(BENCH / "async_checkpoint.py")],
            "rank_start": [py, str(BENCH / "rank_start.py")], "predict_accuracy": [py, str(BENCH / "predict_accuracy.py")]}


def run_bench(name: str, argv: list[str], timeout: float) -> tuple[int, str, float]:
    """Run one benchmark, echoing its output line by line; returns (exit code, output, seconds)."""
    print(f"\n=== {name}: {' '.join(Path(a).name if a.startswith('/') else a for a in argv[1:])}", flush=True)
    start = time.perf_counter()
    lines: list[str] = []
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if not line.startswith("BENCH_JSON "):
            print(line, end="", flush=True)
        if time.monotonic() > deadline:
            proc.kill()
            lines.append(f"run_all: {name} killed after {timeout:.0f} s\n")
            break
    code = proc.wait()
    return code, "".join(lines), time.perf_counter() - start


def _json(output: str) -> dict:
    for line in reversed(output.splitlines()):
        if line.startswith("BENCH_JSON "):
            return json.loads(line[len("BENCH_JSON "):])
    return {}


def _v(met: bool) -> str:
    return "MET" if met else "MISSED"


def parse(name: str, output: str) -> list[Figure]:
    """The figures a benchmark printed (empty when it printed none: a crash)."""
    figs: list[Figure] = []
    if name == "cli_latency":
        for m in re.finditer(r"^\s+(.+?)\s+median\s+(\d+) ms\s+target < (\d+) ms.*?heavy imports: (.+?)\s+(MET|MISSED)",
                             output, re.M):
            figs.append(Figure(name, f"`{m[1].strip()}` median wall time (heavy imports: {m[4]})", f"{m[2]} ms",
                               f"< {m[3]} ms, no torch/pandas/matplotlib", m[5]))
    elif name == "analysis":
        t = re.search(r"target time\s+< (\S+ s): (MET|NOT MET).*\(([\d.]+ s) wall\)", output)
        mem = re.search(r"target memory < (\S+ GB): (MET|NOT MET) \((\d+ MiB)\)", output)
        cpu = re.search(r"^report \(CLI.*?([\d.]+) s CPU", output, re.M)
        if t:
            figs.append(Figure(name, "report on the synthetic study: wall time", t[3] + (f" ({cpu[1]} s CPU)" if cpu else ""),
                               f"< {t[1]}", "MET" if t[2] == "MET" else "MISSED"))
        if mem:
            figs.append(Figure(name, "report: peak memory (max RSS)", mem[3], f"< {mem[1]}",
                               "MET" if mem[2] == "MET" else "MISSED"))
    elif name == "overhead":
        j = _json(output)
        if j:
            figs.append(Figure(name, f"runtime throughput ({j.get('nproc', 2)} rank(s) x 1 thread, gloo)",
                               f"{j['ours_samples_per_s']:.1f} samples/s", "", "INFO"))
            figs.append(Figure(name, "plain DDP loop throughput (same workload)",
                               f"{j['plain_samples_per_s']:.1f} samples/s", "", "INFO"))
            figs.append(Figure(name, f"ratio runtime / plain ({j['workload']}; per pair: "
                               f"{', '.join(f'{r:.3f}' for r in j['ratios'])})",
                               f"{j['ratio']:.3f}", f">= {j['target']}", _v(j["met"])))
            if j.get("ci95"):
                lo, hi = j["ci95"]
                figs.append(Figure(name, "ratio: mean of the pairs and its 95% interval (the noise floor)",
                                   f"{j['mean']:.3f} ({lo:.3f}-{hi:.3f})", "", "INFO"))
    elif name == "phases_overhead":
        j = _json(output)
        if j:
            figs.append(Figure(name, f"step-phase timing: throughput timed / CYCLONE_PHASES=0 ({j['workload']}; per "
                               f"pair: {', '.join(f'{r:.3f}' for r in j['ratios'])})", f"{j['ratio']:.3f}",
                               f">= {j['target']} (cost <= 1% of a step)", _v(j["met"])))
            if j.get("host_cost_us") is not None:
                figs.append(Figure(name, "step-phase timing: its own host work per step (CPU time, in-process)",
                                   f"{j['host_cost_us']:.1f} us = {100 * j['host_cost_share']:.3f}% of the step",
                                   "<= 1% of a step", _v(j["host_cost_share"] <= 0.01)))
            ph = j.get("phases_ms") or {}
            if ph:
                figs.append(Figure(name, "the timed side's median step: data + compute + exposed comm (of total) + other",
                                   f"{ph['step_time_s']:.1f} ms = {ph['data_time_s']:.2f} + {ph['compute_time_s']:.1f} + "
                                   f"{ph['comm_exposed_s']:.1f} ({ph['comm_time_s']:.1f}) + {ph['other_time_s']:.2f} "
                                   f"ms (sum/step {ph['sum_ratio']:.4f})", "", "INFO"))
    elif name == "scaling_cpu":
        j = _json(output)
        if j:
            figs.append(Figure(name, "2-rank efficiency, cyclone_kit launcher + runtime",
                               f"{j['efficiency_ours']:.3f}", f">= torchrun's ({j['efficiency_torchrun']:.3f})",
                               _v(j["efficiency_met"])))
            figs.append(Figure(name, "2-rank efficiency, torchrun + plain script",
                               f"{j['efficiency_torchrun']:.3f}", "(reference)", "INFO"))
            if j.get("efficiencies_ours"):
                figs.append(Figure(name, "2-rank efficiency per repeat (interleaved pairs), cyclone_kit / torchrun",
                                   ", ".join(f"{a:.3f}/{b:.3f}" for a, b in zip(j["efficiencies_ours"],
                                                                              j["efficiencies_torchrun"], strict=True)),
                                   "", "INFO"))
            figs.append(Figure(name, "process start to first step, 2 ranks, cyclone_kit",
                               f"{j['start_ours_s']:.2f} s",
                               f"<= torchrun's + {j['start_slack_s']} s ({j['start_torchrun_s']:.2f} s)",
                               _v(j["start_met"])))
            if j.get("start_python_s") is not None:
                figs.append(Figure(name, "process start to first step, 1 process: cyclone_kit 1 rank (launcher) "
                                   "vs the plain script started with python",
                                   f"{j['start_ours_1rank_s']:.2f} s vs {j['start_python_s']:.2f} s",
                                   "(information)", "INFO"))
    elif name == "script_shim":
        j = _json(output)
        if j:
            figs.append(Figure(name, f"examples/plain_ddp.py throughput, cyclone-kit run / torchrun, {j.get('nproc', 2)} rank(s) "
                               f"({j['workload']}; "
                               f"per pair: {', '.join(f'{r:.3f}' for r in j['ratios'])})",
                               f"{j['ratio']:.3f}", ">= 0.99", _v(j["ratio_met"])))
            figs.append(Figure(name, "examples/plain_ddp.py process start to first step, cyclone-kit run",
                               f"{j['start_ours_s']:.2f} s",
                               f"<= torchrun's + {j['start_slack_s']} s ({j['start_torchrun_s']:.2f} s)",
                               _v(j["start_met"])))
    elif name == "api_cost":
        j = _json(output)
        if j:
            r0 = j["rank0"]
            figs.append(Figure(name, f"public API per-step cost in examples/ddp_ck.py ({j.get('nproc', 2)} rank(s); "
                               f"rank 0: median "
                               f"{r0['api_us_median']:.0f} us, mean {r0['api_us_mean']:.0f} us of a "
                               f"{r0['step_ms_median']:.1f} ms step)", f"{100 * j['ratio']:.3f} %",
                               f"<= {100 * j['target']:.0f} % of the step", _v(j["met"])))
    elif name == "async_checkpoint":
        j = _json(output)
        if j:
            steps = ", ".join(f"{m} {j['step_ms'][m]:.1f}" for m in ("none", "async", "sync"))
            figs.append(Figure(name, f"step time, checkpoint every 5 steps in the background / none ({j['workload']}, "
                               f"{j['checkpoint_mib']:.0f} MiB a checkpoint; step ms: {steps}; per round: "
                               f"{', '.join(f'{r:.3f}' for r in j['ratios_async'])})", f"{j['ratio_async']:.3f}",
                               f"<= {j['target']}", _v(j["met"])))
            figs.append(Figure(name, "step time, checkpoint every 5 steps written before training goes on / none "
                               f"(copy to host memory {j['snapshot_ms']:.1f} ms a checkpoint; {j['waits']} of "
                               f"{j['saves_async']} background saves waited for the previous write)",
                               f"{j['ratio_sync']:.3f}", "(reference)", "INFO"))
            if j.get("cpu_async") is not None:
                figs.append(Figure(name, "the same ratios on the training thread alone: time inside the saves, async "
                                   "/ sync; its CPU time per step, async / sync", f"{j['path_async']:.4f} / "
                                   f"{j['path_sync']:.3f}; {j['cpu_async']:.3f} / {j['cpu_sync']:.3f}", "", "INFO"))
    elif name == "rank_start":
        j = _json(output)
        if j:
            figs.append(Figure(name, f"local launcher, {j['nproc']} rank(s) and one step: CPU seconds, ranks forked from one "
                               f"process that imported torch / fresh processes (CYCLONE_PREFORK=0; medians of {j['pairs']} "
                               f"pairs: {j['cpu_forked_s']:.2f} / {j['cpu_fresh_s']:.2f} CPU-s; wall {j['wall_forked_s']:.2f}"
                               f" / {j['wall_fresh_s']:.2f} s)", f"{j['ratio']:.3f}", f"<= {j['target']}", _v(j["met"])))
    elif name == "predict_accuracy":
        j = _json(output)
        skipped = next((x for x in output.splitlines() if x.startswith("predict_accuracy:") and "skipped" in x), None)
        if not j and skipped:  # quick mode, or no Slurm cluster here: said so, not a crash
            figs.append(Figure(name, "predicted vs measured 2-rank efficiency, local Slurm cluster",
                               skipped.split(":", 1)[1].strip(), "", "INFO"))
        if j:
            per = ", ".join(f"{r['mode']} {r['error_points']:+.1f}" for r in j["results"])
            figs.append(Figure(name, f"predicted vs measured 2-rank efficiency, local Slurm cluster (points: {per})",
                               f"worst {j['worst_abs_error_points']:.1f} points", "<= 10 points", _v(j["met"])))
    return figs


def write_results(path: Path, figs: list[Figure], outputs: dict[str, tuple[int, str, float]], started: str,
                  load_before: str, load_after: str, total_s: float, is_quick: bool) -> None:
    """Rewrite RESULTS.md: date, machine, the figure table, each benchmark's output; keep the GPU section."""
    gpu, notes = GPU_DEFAULT, NOTES_DEFAULT
    if path.exists():
        old = path.read_text(encoding="utf-8")
        m = re.search(re.escape(GPU_BEGIN) + r".*?" + re.escape(GPU_END), old, re.S)
        gpu = m[0] if m else gpu
        m = re.search(re.escape(NOTES_BEGIN) + r".*?" + re.escape(NOTES_END), old, re.S)
        notes = m[0] if m else notes
    out = [
        "# Benchmark results",
        "",
        "Rewritten by `make bench` (`bench/run_all.py`); see bench/README.md for what each benchmark measures.",
        "Each ratio is measured against its reference in the same invocation; the machine is shared, so",
        "read every figure next to the load average.",
        "",
        f"- date: {started} (UTC), total {total_s:.0f} s" + (" — QUICK MODE (smoke sizes; figures meaningless)"
                                                            if is_quick else ""),
        f"- machine: {os.cpu_count()} CPUs, {cpu_model()}; Python {sys.version.split()[0]}",
        f"- load average (1/5/15 min): {load_before} before, {load_after} after",
        "",
        "| benchmark | figure | value | target | verdict |",
        "|---|---|---|---|---|",
    ]
    for f in figs:
        out.append(f"| {f.bench} | {f.name} | {f.value} | {f.target} | {f.verdict} |")
    for name, (code, text, _secs) in outputs.items():
        if not parse(name, text):
            out.append(f"| {name} | (no figures: exit code {code}) | | | FAILED |")
    out += ["", notes, "", gpu, "", "## Raw output", ""]
    for name, (code, text, secs) in outputs.items():
        shown = "\n".join(x for x in text.splitlines() if not x.startswith("BENCH_JSON "))
        out += [f"### {name} (exit {code}, {secs:.0f} s)", "", "```", shown.rstrip(), "```", ""]
    path.write_text("\n".join(out) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    """Run the selected benchmarks, print the summary, rewrite the results file."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", action="append",
                   choices=["cli_latency", "analysis", "overhead", "phases_overhead", "scaling_cpu", "script_shim",
                            "api_cost", "async_checkpoint", "rank_start", "predict_accuracy"])
    p.add_argument("--results", type=Path, default=BENCH / "RESULTS.md")
    p.add_argument("--strict", action="store_true", help="exit 1 when any target is missed")
    args = p.parse_args(argv)
    is_quick = quick()
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    load_before = load()
    t0 = time.perf_counter()
    print(f"run_all: {os.cpu_count()} CPUs ({cpu_model()}), load average {load_before}"
          + (" [CK_BENCH_QUICK=1: smoke sizes]" if is_quick else ""))
    outputs: dict[str, tuple[int, str, float]] = {}
    for name, cmd in commands(is_quick).items():
        if args.only and name not in args.only:
            continue
        outputs[name] = run_bench(name, cmd, timeout=900)
    figs = [f for name, (_, text, _) in outputs.items() for f in parse(name, text)]
    crashed = [name for name, (_, text, _) in outputs.items() if not parse(name, text)]
    total = time.perf_counter() - t0
    load_after = load()

    print(f"\n=== summary ({total:.0f} s; load average {load_before} before, {load_after} after)")
    for f in figs:
        print(f"  {f.verdict:<6} {f.bench:<12} {f.name}: {f.value}" + (f"  (target {f.target})" if f.target else ""))
    for name in crashed:
        print(f"  FAILED {name}: printed no figures (exit {outputs[name][0]}); see its output above")
    write_results(args.results, figs, outputs, started, load_before, load_after, total, is_quick)
    print(f"results written to {args.results}")
    missed = [f for f in figs if f.verdict == "MISSED"]
    if crashed:
        return 2
    return 1 if (missed and args.strict) else 0


if __name__ == "__main__":
    sys.exit(main())
