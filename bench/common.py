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

* **CPU cost per sample** (a cross-check, less moved by other load than wall time): the user +
  system CPU time of every rank process, sampled from /proc every 50 ms by :class:`CpuSampler`
  and interpolated at the end of the first (warm-up) window and the end of the last, divided by
  the samples trained in between. It shows extra work (Python, copies, extra collectives), not
  time spent waiting; under heavy contention it still moves by +-15-20% from run to run
  (caches and memory bandwidth shared with other jobs).

* **allocator**: every process of both sides runs with the same ``GLIBC_TUNABLES`` (the value
  cyclone_kit gives its ranks, cyclone_kit/malloc.py). With glibc's defaults each step
  page-faulted ~19,000 pages back in (TinyCNN, batch 256), which cost ~30% of the step and moved
  identical runs by +-10%: comparing a tuned side with an untuned one would measure glibc, not
  the runtime.

``CK_BENCH_QUICK=1`` shrinks every benchmark to a smoke run (1 pair, few steps) for the tests.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PLAIN = REPO / "bench" / "plain_ddp.py"
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from cyclone_kit.malloc import GLIBC_TUNABLES  # noqa: E402  (the repo is put on the path just above)


def quick() -> bool:
    """True in the tests' smoke mode (``CK_BENCH_QUICK=1``)."""
    return os.environ.get("CK_BENCH_QUICK", "") not in ("", "0")


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


@dataclass(frozen=True)
class Workload:
    """What both sides train: model, per-rank batch, steps, log window, image size."""

    model: str = "tiny_cnn"
    batch: int = 256
    steps: int = 40
    log_every: int = 5
    image_size: int = 32

    def spec_toml(self, name: str) -> str:
        """A cyclone_kit job spec for this workload (no validation pass, no periodic checkpoints)."""
        return f"""name = "{name}"

[train]
model = "{self.model}"
dataset = "synthetic"
image_size = {self.image_size}
num_classes = 10
synthetic_samples = 50000
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


@dataclass
class RunResult:
    """One measured run."""

    side: str
    nproc: int
    samples_per_s: float
    start_to_first_step_s: float
    wall_s: float
    load: str = field(default_factory=load)
    windows: list[float] = field(default_factory=list)
    cpu_ms_per_sample: float | None = None

    @property
    def best_window(self) -> float:
        """The fastest window after the first: the least disturbed by other load (a cross-check)."""
        steady = self.windows[1:] if len(self.windows) > 1 else self.windows
        return max(steady) if steady else self.samples_per_s


def _utc_to_unix(text: str) -> float:
    return datetime.datetime.fromisoformat(text).timestamp()


class CpuSampler:
    """Samples the CPU time (user + system, all threads) of a changing set of processes every 50 ms."""

    def __init__(self, pids: Callable[[], list[int]], interval: float = 0.05) -> None:
        self.pids, self.interval = pids, interval
        self.samples: dict[int, list[tuple[float, float]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._tick = os.sysconf("SC_CLK_TCK")

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            for pid in self.pids():
                try:
                    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                except (OSError, IndexError):
                    continue
                cpu = (int(fields[11]) + int(fields[12])) / self._tick  # utime + stime
                self.samples.setdefault(pid, []).append((time.time(), cpu))
            self._stop.wait(self.interval)

    def cpu_between(self, t0: float, t1: float) -> float | None:
        """CPU seconds all sampled processes used between wall-clock times t0 and t1 (interpolated)."""
        total = 0.0
        found = False
        for series in self.samples.values():
            a, b = _interp(series, t0), _interp(series, t1)
            if a is not None and b is not None:
                total += b - a
                found = True
        return total if found else None


def _interp(series: list[tuple[float, float]], t: float) -> float | None:
    for (ta, ca), (tb, cb) in itertools.pairwise(series):
        if ta <= t <= tb:
            return ca if tb == ta else ca + (cb - ca) * (t - ta) / (tb - ta)
    return None


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


def _run(argv: list[str], env: dict[str, str], timeout: float, cwd: Path,
         sampler: CpuSampler | None = None) -> subprocess.CompletedProcess[str]:
    with subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as p:
        if sampler is not None:
            sampler.pids = lambda: children(p.pid)
            with sampler:
                stdout, stderr = p.communicate(timeout=timeout)
        else:
            stdout, stderr = p.communicate(timeout=timeout)
    proc = subprocess.CompletedProcess(argv, p.returncode, stdout, stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return proc


def run_ours(work: Workload, nproc: int, tmp: Path, tag: str, timeout: float = 600) -> RunResult:
    """The cyclone_kit local launcher: ``python -m cyclone_kit run SPEC --nproc N --threads 1``."""
    spec = tmp / f"{tag}.toml"
    spec.write_text(work.spec_toml(tag), encoding="utf-8")
    runs = tmp / "runs"
    argv = [sys.executable, "-m", "cyclone_kit", "run", str(spec), "--nproc", str(nproc), "--threads", "1",
            "--runs-dir", str(runs), "--quiet", "--cpu"]
    sampler = CpuSampler(list)
    t0 = time.time()
    proc = _run(argv, bench_env(), timeout, REPO, sampler)
    wall = time.time() - t0
    line = next((x for x in proc.stdout.splitlines() if x.startswith("run dir: ")), None)
    if line is None:
        raise RuntimeError(f"no 'run dir:' line in the launcher's output:\n{proc.stdout[-2000:]}")
    run_dir = Path(line.split(": ", 1)[1].strip())
    rate, loop_start, windows = read_runtime_metrics(run_dir)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return RunResult("cyclone_kit", nproc, rate, loop_start - t0, wall, windows=windows,
                     cpu_ms_per_sample=_cpu_ms(sampler, steady_bounds_runtime(run_dir)))


def _cpu_ms(sampler: CpuSampler, bounds: tuple[float, float, int] | None) -> float | None:
    if bounds is None or bounds[2] <= 0:
        return None
    cpu = sampler.cpu_between(bounds[0], bounds[1])
    return None if cpu is None else 1000 * cpu / bounds[2]


def run_plain(work: Workload, nproc: int, tmp: Path, tag: str, *, torchrun: bool, timeout: float = 600) -> RunResult:
    """bench/plain_ddp.py with ``nproc`` ranks: under ``torchrun``, or as processes started here."""
    out = tmp / f"{tag}.json"
    env = bench_env()
    script = [str(PLAIN), *work.plain_args(), "--out", str(out)]
    t0 = time.time()
    sampler = CpuSampler(list)
    if torchrun:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *script]
        _run(argv, env, timeout, REPO, sampler)  # samples torchrun's children: the ranks
    else:
        port = _free_port()
        procs: list[subprocess.Popen[str]] = []
        sampler = CpuSampler(lambda: [p.pid for p in procs])
        with sampler:
            try:
                for rank in range(nproc):
                    renv = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
                    procs.append(subprocess.Popen([sys.executable, *script], env=renv, cwd=REPO,
                                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                                  start_new_session=True))
                for p in procs:
                    stdout, stderr = p.communicate(timeout=timeout)
                    if p.returncode != 0:
                        raise RuntimeError(f"plain_ddp.py exited {p.returncode}:\n{stdout[-2000:]}\n{stderr[-3000:]}")
            finally:
                for p in procs:  # a failed or hung rank must not outlive the benchmark
                    if p.poll() is None:
                        p.kill()
                        p.wait()
    wall = time.time() - t0
    result = json.loads(out.read_text(encoding="utf-8"))
    side = "torchrun + plain script" if torchrun else "plain DDP loop"
    ends = result.get("window_end_unix", [])
    cpu = None
    if len(ends) >= 2:
        cpu = _cpu_ms(sampler, (ends[0], ends[-1], (result["steps"] - work.log_every) * work.batch * nproc))
    return RunResult(side, nproc, float(result["samples_per_s"]), result["loop_start_unix"] - t0, wall,
                     windows=result["window_rates"], cpu_ms_per_sample=cpu)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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

    ``other`` is ``"plain"`` (bench/plain_ddp.py ranks started here) or ``"torchrun"`` (the same
    script under ``torchrun --standalone``). Each side's throughput is the samples of its
    steady-state windows divided by the time it was running inside them, so both see the same
    minutes of the machine, sliced finely: slow drifts of a shared host (identical runs here differ
    by up to 10% minutes apart) hit both alike, which separate runs in sequence cannot promise.
    """
    import signal as sg

    spec = tmp / f"{tag}.toml"
    spec.write_text(work.spec_toml(tag), encoding="utf-8")
    runs = tmp / f"runs-{tag}"
    out = tmp / f"{tag}.json"
    env = bench_env()
    script = [str(PLAIN), *work.plain_args(), "--out", str(out)]
    launched = {"ours": time.time()}
    ours = _popen([sys.executable, "-m", "cyclone_kit", "run", str(spec), "--nproc", str(nproc), "--threads", "1",
                   "--runs-dir", str(runs), "--quiet", "--cpu"], env)
    launched["other"] = time.time()
    if other == "torchrun":
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
            if p.returncode != 0:
                raise RuntimeError(f"interleaved run {tag}: a process exited {p.returncode}:\n{stdout[-1500:]}\n"
                                   f"{stderr[-2500:]}")
    run_dir = next(runs.iterdir())
    a0, a1, a_n = steady_bounds_runtime(run_dir) or (0.0, 0.0, 0)
    _, a_loop, _ = read_runtime_metrics(run_dir)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
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
