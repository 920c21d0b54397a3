"""Helpers shared by the CPU benchmarks: machine facts, the bench spec, running both sides, reading results.

Both sides of every comparison are started as fresh processes and measured the same way:

* **throughput**: windows of ``log_every`` steps on rank 0, ``global batch x steps / window wall
  time``, median of the windows after the first (the runtime's end-record ``samples_per_s``;
  :mod:`bench.plain_ddp` computes the very same figure);
* **scheduling**: every rank runs in its own session, as the cyclone_kit launcher and torchrun
  start them (``start_new_session=True``). On kernels with autogroup scheduling (Linux's default
  for desktops and this machine: /proc/sys/kernel/sched_autogroup_enabled = 1) CPU time is shared
  fairly between sessions, so under contention two ranks sharing one session get about half the
  CPU of two ranks in two sessions: a reference started without this ran 2-3x slower here.
* **process start to first step**: from ``time.time()`` just before the launch command is started
  to the wall-clock time the first training step starts (the runtime: first step record's ``time``
  minus its window's ``step_time_s x steps``, i.e. the window start taken just before the loop;
  the plain script: ``loop_start_unix``).
* **interleaving** (:func:`run_interleaved`): both sides of a pair start at once and take turns
  every 0.5 s (SIGSTOP/SIGCONT of each side's process tree); throughput and start-up count only
  the time a side was running, so slow drifts of a shared host hit both alike.

* **allocator**: every process of both sides runs with the same ``GLIBC_TUNABLES`` (the value
  cyclone_kit gives its ranks, cyclone_kit/malloc.py). With glibc's defaults each step
  page-faulted ~19,000 pages back in (TinyCNN, batch 256), which cost ~30% of the step and moved
  identical runs by +-10%: comparing a tuned side with an untuned one would measure glibc, not
  the runtime.

``CK_BENCH_QUICK=1`` shrinks every benchmark to a smoke run (1 pair, few steps) for the tests: one rank a side
where the figure allows it (overhead, phases_overhead, script_shim, rank_start, api_cost; ``--nproc 2`` restores
it); scaling_cpu keeps its 1- and 2-rank runs, so the benchmarks' 2-rank path of both launchers still runs (issue 27:
each rank imports torch, ~6 CPU-s on a slow 2-core host).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PLAIN = REPO / "bench" / "plain_ddp.py"
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from cyclone_kit.core.malloc import GLIBC_TUNABLES  # noqa: E402  (the repo is put on the path just above)


def quick() -> bool:
    """True in the tests' smoke mode (``CK_BENCH_QUICK=1``)."""
    return os.environ.get("CK_BENCH_QUICK", "") not in ("", "0")


def add_nproc(parser: Any, what: str = "ranks per side") -> None:
    """The ``--nproc`` option of a benchmark that compares launches: 2 ranks, 1 in quick mode (a smoke run of the
    benchmark's code; issue 27: each rank imports torch)."""
    parser.add_argument("--nproc", type=int, default=1 if quick() else 2,
                        help=f"{what} (quick mode: 1, a smoke run of this benchmark's code)")


def cpu_model() -> str:
    """The CPU model from /proc/cpuinfo (else the platform's string)."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load() -> str:
    """The 1/5/15-minute load averages as text."""
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def machine_line() -> str:
    """One line: CPUs, model, load average."""
    return f"{os.cpu_count()} CPUs ({cpu_model()}), load average {load()}"


def bench_env(threads: int = 1) -> dict[str, str]:
    """The environment of every benchmark child: fixed threads, repo on the path, no GPUs."""
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "CUDA_VISIBLE_DEVICES": "",
                "GLIBC_TUNABLES": GLIBC_TUNABLES,
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))})
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


#: The runtime side's ``train.synthetic_samples``. Its in-memory pool is min(samples, 64 MiB of images) per rank
#: (5,461 images at 32 px); the smoke runs (4 steps of 32) draw 1,024 at most, which saves ~0.45 CPU-s a 2-rank
#: launch (the pool's noise and page faults; issue 27).
SYNTHETIC_SAMPLES = 1024 if quick() else 50000


@dataclass(frozen=True)
class Workload:
    """What both sides train: model, per-rank batch, steps, log window, image size, synthetic samples (runtime)."""

    model: str = "tiny_cnn"
    batch: int = 256
    steps: int = 40
    log_every: int = 5
    image_size: int = 32
    samples: int = SYNTHETIC_SAMPLES

    def spec_toml(self, name: str) -> str:
        """A cyclone_kit job spec for this workload (no validation pass, no periodic checkpoints)."""
        return f"""name = "{name}"

[train]
model = "{self.model}"
dataset = "synthetic"
image_size = {self.image_size}
num_classes = 10
synthetic_samples = {self.samples}
steps = {self.steps}
batch_size = {self.batch}
lr = 0.1
lr_scaling = "none"
warmup_steps = 0
precision = "fp32"
log_every = {self.log_every}
val_every_epochs = 0
seed = 0

[resources]
profile = "local"

[checkpoint]
every_steps = 0
resume = false
requeue = false
"""

    def plain_args(self) -> list[str]:
        """The same workload as arguments of bench/plain_ddp.py."""
        return ["--model", self.model, "--batch", str(self.batch), "--steps", str(self.steps),
                "--log-every", str(self.log_every), "--image-size", str(self.image_size)]


def _utc_to_unix(text: str) -> float:
    return datetime.datetime.fromisoformat(text).timestamp()


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc/PID/task/PID/children; empty when unavailable)."""
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []


def read_runtime_metrics(run_dir: Path) -> tuple[float, float, list[float]]:
    """(steady-state samples/s, loop start unix time, window rates) from RUN_DIR/metrics.jsonl."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
               if line.strip()]
    steps = [r for r in records if r["kind"] == "step"]
    end = [r for r in records if r["kind"] == "end"][-1]
    if end["status"] != "completed" or not steps:
        raise RuntimeError(f"run in {run_dir} did not complete: {end}")
    first = steps[0]
    loop_start = _utc_to_unix(first["time"]) - first["step_time_s"] * first["step"]
    return float(end["samples_per_s"]), loop_start, [float(r["samples_per_s"]) for r in steps]


def steady_bounds_runtime(run_dir: Path) -> tuple[float, float, int] | None:
    """(end of the first window, end of the last, samples in between) from the runtime's step records."""
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines() if x.strip()]
    start = next(r for r in records if r["kind"] == "start")
    steps = [r for r in records if r["kind"] == "step"]
    if len(steps) < 2:
        return None
    n = (steps[-1]["step"] - steps[0]["step"]) * start["global_batch_size"]
    return _utc_to_unix(steps[0]["time"]), _utc_to_unix(steps[-1]["time"]), n


def plain_start_s(work: Workload, tmp: Path, tag: str, timeout: float = 600) -> float:
    """Process start to first step of bench/plain_ddp.py run alone as one ``python`` process (seconds)."""
    out = tmp / f"{tag}.json"
    t0 = time.time()
    proc = subprocess.run([sys.executable, str(PLAIN), *work.plain_args(), "--out", str(out)], env=bench_env(),
                          cwd=REPO, capture_output=True, text=True, timeout=timeout, start_new_session=True)
    if proc.returncode != 0:
        raise RuntimeError(f"plain_ddp.py exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text(encoding="utf-8"))["loop_start_unix"] - t0


def _free_port() -> int:
    """The reference ranks' MASTER_PORT, picked as the local launcher picks its own (below the kernel's ephemeral
    range: the kernel's own pick could be handed to another process before rank 0 binds it)."""
    from cyclone_kit.core.ports import free_local_port

    return free_local_port()


def median(values: list[float]) -> float:
    """statistics.median, named here for the benchmarks' readability."""
    return float(statistics.median(values))


def verdict(met: bool) -> str:
    """``MET`` / ``MISSED``."""
    return "MET" if met else "MISSED"


def emit_json(figures: dict[str, Any]) -> None:
    """Print the machine-readable result line run_all.py collects (``BENCH_JSON {...}``)."""
    print("BENCH_JSON " + json.dumps(figures), flush=True)


# --------------------------------------------------------------------------- interleaved A/B
@dataclass
class Interleaved:
    """One interleaved A/B pair: each side's throughput over the time it was running, and its
    process start to first step counted in running time too."""

    ours: float
    other: float
    ours_start_s: float
    other_start_s: float
    windows: int
    slices: int


def teardown_line(tag: str, returncode: int, stderr: str) -> None:
    """Say that a reference process (plain torch: bench/plain_ddp.py, torchrun) exited ``returncode`` after it had
    written its figures, which are kept. Seen on this machine: torch's gloo teardown aborts a rank now and then
    after ``barrier(); destroy_process_group()`` ("terminate called without an active exception", exit -6 under
    torchrun, 1 from its agent); a benchmark must not fail on the reference's teardown, only on the product's."""
    last = next((line for line in reversed(stderr.splitlines()) if "terminate called" in line), "")
    print(f"  warning: {tag}: a reference process exited {returncode} after writing its figures"
          + (f" ({last.strip()})" if last else "") + "; its figures are kept", flush=True)


def _tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (from /proc children lists)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children(p))
    return out


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _active_time(slices: list[tuple[float, float]], t0: float, t1: float) -> float:
    """Seconds of the running ``slices`` that fall inside [t0, t1]."""
    return sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in slices)


def _popen(argv: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(argv, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def run_interleaved(work: Workload, tmp: Path, tag: str, *, nproc: int = 2, other: str = "plain",
                    slice_s: float = 0.5, timeout: float = 600) -> Interleaved:
    """Run the cyclone_kit launcher and a reference with ``nproc`` ranks each at once, but never at
    the same time: every ``slice_s`` one side is frozen with SIGSTOP and the other thawed with SIGCONT.

    ``other`` is ``"plain"`` (bench/plain_ddp.py ranks started here), ``"torchrun"`` (the same
    script under ``torchrun --standalone``) or ``"untimed"`` (the same cyclone_kit command with the
    step-phase timing off, ``CYCLONE_PHASES=0``: the timing's own cost). Each side's throughput is the samples of its
    steady-state windows divided by the time it was running inside them, so both see the same
    minutes of the machine, sliced finely: slow drifts of a shared host (identical runs here differ
    by up to 10% minutes apart) hit both alike, which separate runs in sequence cannot promise.
    """
    import signal as sg

    spec = tmp / f"{tag}.toml"
    spec.write_text(work.spec_toml(tag), encoding="utf-8")
    runs = tmp / f"runs-{tag}"
    runs_b = tmp / f"runs-{tag}-untimed"
    out = tmp / f"{tag}.json"
    env = bench_env()
    script = [str(PLAIN), *work.plain_args(), "--out", str(out)]
    launched = {"ours": time.time()}
    ours = _popen([sys.executable, "-m", "cyclone_kit", "run", str(spec), "--nproc", str(nproc), "--threads", "1",
                   "--runs-dir", str(runs), "--quiet", "--cpu"], env)
    launched["other"] = time.time()
    if other == "untimed":
        refs = [_popen([sys.executable, "-m", "cyclone_kit", "run", str(spec), "--nproc", str(nproc), "--threads", "1",
                        "--runs-dir", str(runs_b), "--quiet", "--cpu"], {**env, "CYCLONE_PHASES": "0"})]
    elif other == "torchrun":
        refs = [_popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                        *script], env)]
    elif nproc == 1:
        refs = [_popen([sys.executable, *script], env)]
    else:
        port = _free_port()
        refs = [_popen([sys.executable, *script], {**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc),
                                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
                for r in range(nproc)]
    procs = {"ours": [ours], "other": refs}

    def pids(side: str) -> list[int]:
        return [pid for p in procs[side] for pid in _tree(p.pid)]

    def done(side: str) -> bool:
        return all(p.poll() is not None for p in procs[side])

    _signal_all([p.pid for p in refs], sg.SIGSTOP)  # the roots first: no new child while the tree is listed
    _signal_all(pids("other"), sg.SIGSTOP)
    running: dict[str, list[tuple[float, float]]] = {"ours": [], "other": [(launched["other"], time.time())]}
    deadline = time.monotonic() + timeout
    current, began = "ours", launched["ours"]
    try:
        while not (done("ours") and done("other")) and time.monotonic() < deadline:
            time.sleep(slice_s)
            nxt = "other" if current == "ours" else "ours"
            if done(nxt):
                continue  # the other side has finished: keep running this one
            _signal_all([p.pid for p in procs[current]], sg.SIGSTOP)
            _signal_all(pids(current), sg.SIGSTOP)
            running[current].append((began, time.time()))
            _signal_all(pids(nxt), sg.SIGCONT)
            current, began = nxt, time.time()
        running[current].append((began, time.time()))
    finally:
        for side in procs:
            _signal_all(pids(side), sg.SIGCONT)
        for p in procs["ours"] + procs["other"]:
            if p.poll() is None and time.monotonic() >= deadline:
                _signal_all(_tree(p.pid), sg.SIGKILL)
            stdout, stderr = p.communicate()
            if p.returncode != 0 and p in refs and other != "untimed" and out.exists():
                teardown_line(tag, p.returncode, stderr)  # the reference's figures are written: kept
            elif p.returncode != 0:
                raise RuntimeError(f"interleaved run {tag}: a process exited {p.returncode}:\n{stdout[-1500:]}\n"
                                   f"{stderr[-2500:]}")
    run_dir = next(runs.iterdir())
    a0, a1, a_n = steady_bounds_runtime(run_dir) or (0.0, 0.0, 0)
    _, a_loop, _ = read_runtime_metrics(run_dir)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    if other == "untimed":
        run_b = next(runs_b.iterdir())
        b0, b1, b_n = steady_bounds_runtime(run_b) or (0.0, 0.0, 0)
        _, b_loop, b_rates = read_runtime_metrics(run_b)
        shutil.rmtree(run_b / "checkpoints", ignore_errors=True)
        result = {"loop_start_unix": b_loop}
        ends = b_rates
    else:
        result = json.loads(out.read_text(encoding="utf-8"))
        ends = result["window_end_unix"]
        b0, b1 = ends[0], ends[-1]
        b_n = (result["steps"] - work.log_every) * work.batch * nproc
    t_a, t_b = _active_time(running["ours"], a0, a1), _active_time(running["other"], b0, b1)
    if not (a_n and t_a > 0 and t_b > 0):
        raise RuntimeError(f"interleaved run {tag}: no steady-state window to measure")
    return Interleaved(a_n / t_a, b_n / t_b,
                       _active_time(running["ours"], launched["ours"], a_loop),
                       _active_time(running["other"], launched["other"], result["loop_start_unix"]),
                       len(ends) - 1, len(running["ours"]) + len(running["other"]))
