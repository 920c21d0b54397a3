"""The srun emulator: N real rank processes on this machine, each with a Slurm-like environment.

Every rank gets the variables ``srun`` would give it (:mod:`cyclone_kit.backends.local_env`),
so the runtime takes the very bootstrap path it takes under Slurm.

Each rank runs in its own process group, writing ``logs/rank-N.out`` / ``.err`` in the run
directory. When a rank fails, the others are stopped within seconds (SIGTERM to each
process group, SIGKILL after a grace period), the first failure is reported first (rank,
host, exit code or signal, last lines of its stderr, its error record when it wrote one) and
written to ``failure.json``; Ctrl-C or SIGTERM to the launcher stops every rank the same way
(torchrun's ChildFailedError / ``@record`` idea).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from cyclone_kit.backends.local_env import (
    available_cores,
    clean_environment,
    free_port,
    launcher_variables,
    new_job_id,
    threads_per_rank,
)
from cyclone_kit.core import prefork
from cyclone_kit.launchers import LOCAL
from cyclone_kit.rundir import failures
from cyclone_kit.rundir.entry import TRAINER_MODULE, trainer_words
from cyclone_kit.rundir.failures import read_error_record, signal_name
from cyclone_kit.rundir.layout import FAILURE_FILE, LAUNCH_FILE, RunDir

if TYPE_CHECKING:
    pass

__all__ = ["FAILURE_FILE", "LAUNCH_FILE", "LaunchResult", "RankExit", "format_failure", "launch", "signal_name"]

#: Seconds between SIGTERM and SIGKILL when stopping ranks after one failed (they may wait on a dead peer).
GRACE_S = 5.0
#: Seconds between SIGTERM and SIGKILL when the run is stopped (Ctrl-C, SIGTERM, ``timeout_s``): the ranks
#: agree on a step and write their stop checkpoint meanwhile (Slurm's default KillWait).
STOP_GRACE_S = 30.0
STDERR_TAIL_LINES = 20


#: Signals the launcher passes on to every rank, as srun does for ``--signal``.
FORWARDED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


# --------------------------------------------------------------------------- results
@dataclass(frozen=True)
class RankExit:
    """How one rank ended.

    Attributes:
        rank: global rank.
        host: the pretend node it ran on.
        pid: its process id (also its process-group id).
        returncode: exit status; negative: killed by that signal; None: still unknown.
        elapsed_s: seconds from launch to its exit.
        stopped: True when the launcher itself stopped it (after another rank's failure or Ctrl-C).
    """

    rank: int
    host: str
    pid: int
    returncode: int | None
    elapsed_s: float
    stopped: bool = False

    @property
    def failed(self) -> bool:
        """True when it ended by itself with a non-zero status."""
        return not self.stopped and self.returncode not in (0, None)

    @property
    def how(self) -> str:
        """``exit code 1`` or ``killed by SIGKILL``."""
        sig = signal_name(self.returncode)
        return f"killed by {sig}" if sig else f"exit code {self.returncode}"


@dataclass(frozen=True)
class LaunchResult:
    """What a local launch produced.

    Attributes:
        job_id: the fake SLURM_JOB_ID the ranks saw.
        run_dir: the run directory.
        exits: every rank's :class:`RankExit`, in rank order.
        first_failure: the root cause (the first rank that failed by itself), or None.
        interrupted: the launcher was interrupted (Ctrl-C / SIGTERM) and stopped the ranks.
        wall_time_s: seconds from the first start to the last exit.
        stop_s: seconds from the first failure (or interrupt) until every rank was gone.
        record_error: why ``failure.json`` could not be written (a full disk), else None.
        stderr_tails: per rank, the last lines it wrote to stderr in this launch (kept by the
            launcher, so they are known even when the log file could not take them).
    """

    job_id: str
    run_dir: Path
    exits: tuple[RankExit, ...]
    first_failure: RankExit | None
    interrupted: bool
    wall_time_s: float
    stop_s: float | None = None
    record_error: str | None = None
    stderr_tails: tuple[tuple[str, ...], ...] = ()

    @property
    def ok(self) -> bool:
        """True when every rank exited 0."""
        return self.first_failure is None and not self.interrupted

    @property
    def returncode(self) -> int:
        """0, 130 after an interrupt, 2 when the first failed rank refused its input (exit code 2:
        a one-line CycloneError, e.g. a refused resume), else 1."""
        if self.ok:
            return 0
        if self.interrupted and self.first_failure is None:
            return 130
        return 2 if self.first_failure is not None and self.first_failure.returncode == 2 else 1


def root_cause_line(failure: RankExit, error: Mapping[str, Any] | None = None) -> str:
    """One line naming the first failure: rank, host, exit code or signal, error type (pure)."""
    line = f"rank {failure.rank} on host {failure.host} (pid {failure.pid}) {failure.how} after {failure.elapsed_s:.1f} s"
    if error and (error.get("type") or error.get("message")):
        message = " ".join(str(error.get("message", "")).split())
        kind = error.get("type", "Error")
        line += f": {kind}: {message[:300]}" if kind else f": {message[:300]}"
    return line


def error_from_tail(lines: Sequence[str]) -> dict[str, Any] | None:
    """The last ``error: ...`` line a rank printed, as an error record's type and message (pure).

    For a rank that could not write its error record (a full disk): its one-line error still names the cause.
    """
    for line in reversed(lines):
        if line.startswith("error: "):
            message = re.sub(r"^\[rank \d+\] ", "", line[len("error: "):])
            return {"type": "", "message": message}
    return None


def tail_lines(path: Path, n: int = STDERR_TAIL_LINES, max_bytes: int = 64_000) -> list[str]:
    """The last ``n`` lines of a text file ([] when it is missing)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return []
    return data.decode("utf-8", errors="replace").splitlines()[-n:]


def failure_record(result: LaunchResult) -> dict[str, Any]:
    """The ``failure.json`` document for a failed or interrupted launch (schema: :mod:`cyclone_kit.rundir.failures`)."""
    first = result.first_failure
    ranks = [
        {"rank": e.rank, "host": e.host, "pid": e.pid, "exit_code": e.returncode, "signal": signal_name(e.returncode),
         "elapsed_s": round(e.elapsed_s, 3), "stopped_by_launcher": e.stopped}
        for e in result.exits
    ]
    common: dict[str, Any] = {"written_by": "local", "job_id": result.job_id, "ranks": ranks,
                              "stop_s": None if result.stop_s is None else round(result.stop_s, 3)}
    stall = failures.read_failure(result.run_dir)
    if stall is not None and stall.get("cause") == "stalled" and stall.get("job_id") == result.job_id:
        # The ranks' progress watchdogs found who stopped making progress: their record stays the root cause.
        stuck = {r: e for r, e in enumerate(stall.get("ranks") or []) if isinstance(e, dict)}
        return {**stall, "ranks": [{**stuck.get(e["rank"], {}), **e} for e in ranks], "stop_s": common["stop_s"]}
    if first is None:
        summary = "interrupted: the launcher was stopped (Ctrl-C, SIGTERM or --timeout) and stopped every rank"
        return failures.failure_doc(cause="interrupted", root_cause=summary, **common)
    error = read_error_record(result.run_dir, first.rank)
    if error is None and first.rank < len(result.stderr_tails):  # it could not write one: its last error line
        error = error_from_tail(result.stderr_tails[first.rank])
    rd = RunDir(result.run_dir)
    return failures.failure_doc(
        cause="rank_failed", root_cause=root_cause_line(first, error), first=error, rank=first.rank,
        host=first.host, pid=first.pid, exit_code=first.returncode, elapsed_s=round(first.elapsed_s, 3),
        stderr_log=str(rd.rank_log(first.rank, "err").relative_to(rd.path)),
        stderr_tail=(list(result.stderr_tails[first.rank]) if first.rank < len(result.stderr_tails)
                     else tail_lines(rd.rank_log(first.rank, "err"))), error_record=error, **common,
    )


def format_failure(result: LaunchResult) -> str:
    """The human report of a failed launch, root cause first (several lines)."""
    doc = failure_record(result)
    lines = [f"error: {doc['summary']}"]
    if doc.get("stderr_tail"):
        err_log = Path(result.run_dir) / doc["stderr_log"]
        lines.append(f"--- last lines of {err_log} ---")
        lines += [f"  {line}" for line in doc["stderr_tail"]]
        lines.append("---")
    others = [e for e in result.exits if e is not result.first_failure]
    for e in others:
        lines.append(f"rank {e.rank} on {e.host}: {e.how}" + (" (stopped by the launcher)" if e.stopped else ""))
    if result.stop_s is not None:
        lines.append(f"all ranks gone {result.stop_s:.1f} s after the first failure")
    if result.record_error:
        lines.append(f"failure record not written: {result.record_error}")
    else:
        lines.append(f"failure record: {RunDir(result.run_dir).failure}")
    return "\n".join(lines)


def record_submission(rd: RunDir, job_id: str, backend: str) -> None:
    """Record a finished local launch in its run directory; on a full disk, say so on stderr instead."""
    try:
        rd.write_submission(job_id, backend)
    except OSError as e:
        sys.stderr.write(f"cyclone_kit: warning: could not record job {job_id}: {_why(rd.path, e)}\n")


def _why(path: Path, e: OSError) -> str:
    """``PATH: reason`` for a failed write (a DiskFullError names the path itself)."""
    text = str(e.strerror or e)
    return text if str(path) in text else f"{path}: {text}"


# --------------------------------------------------------------------------- the launcher
class _Interrupted(Exception):
    """SIGTERM/SIGINT reached the launcher."""


def launch(
    run_dir: Path | str,
    nproc: int,
    nodes: int = 1,
    *,
    threads: int | None = None,
    command: Sequence[str] | None = None,
    job_name: str = "cyclone",
    grace_s: float = GRACE_S,
    stop_grace_s: float = STOP_GRACE_S,
    timeout_s: float | None = None,
    echo: IO[str] | None = None,
    environ: Mapping[str, str] | None = None,
    extra_env: Mapping[str, str] | None = None,
    on_start: Callable[[list[subprocess.Popen[bytes]]], None] | None = None,
    cwd: Path | str | None = None,
) -> LaunchResult:
    """Start ``nproc`` ranks over ``nodes`` pretend nodes of this host and wait for them.

    Args:
        run_dir: the run directory (holds ``spec.json``; gets ``logs/``, ``launch.json`` and, on
            failure, ``failure.json``).
        nproc: total ranks.
        nodes: pretend nodes (``nproc`` must be a multiple).
        threads: torch threads per rank (default: the cores shared evenly, at least 1).
        command: what each rank runs (default: ``python -m cyclone_kit.runtime --run-dir DIR``).
        job_name: SLURM_JOB_NAME.
        grace_s: seconds between SIGTERM and SIGKILL when stopping ranks after a rank failed.
        stop_grace_s: the same when the run is stopped (an interrupt, ``timeout_s``): time for the stop checkpoint.
        timeout_s: stop every rank after this many seconds (treated as an interrupt).
        echo: a stream that receives rank 0's stdout as it is written (None: silent).
        environ: the base environment (default ``os.environ``; an enclosing launcher's
            variables are removed).
        extra_env: variables set for every rank on top (e.g. ``CUDA_VISIBLE_DEVICES=""`` for CPU only).
        on_start: called with the rank processes once all are started.
        cwd: the ranks' working directory (default: this process's; a script job's ``script.chdir``).

    Returns:
        The :class:`LaunchResult`; ``failure.json`` is written when it is not ok.
    """
    run_dir = Path(run_dir).absolute()
    rd = RunDir(run_dir)
    logs = rd.logs
    logs.mkdir(parents=True, exist_ok=True)
    threads = threads or threads_per_rank(nproc, available_cores())
    job_id = new_job_id()
    base = os.environ if environ is None else environ
    workdir = str(cwd) if cwd else os.getcwd()
    ours = launcher_variables(nproc, nodes, job_id=job_id, master_port=free_port(), threads=threads, run_dir=run_dir,
                              job_name=job_name, submit_dir=workdir, base=base, extra_env=extra_env)
    below = clean_environment(base)
    envs = [{**below, **v} for v in ours]
    argv = list(command) if command else [sys.executable, *trainer_words(run_dir)]

    procs: list[subprocess.Popen[bytes]] = []
    files: list[IO[bytes]] = []
    pumps: list[_ErrPump] = []
    exits: dict[int, RankExit] = {}
    stopping: set[int] = set()
    events: queue.Queue[tuple[int, int, float]] = queue.Queue()
    started = time.monotonic()
    first_failure: RankExit | None = None
    interrupted = False
    stop_began: float | None = None

    def on_signal(signum: int, frame: object) -> None:
        raise _Interrupted(signal.Signals(signum).name)

    def forward(signum: int, frame: object) -> None:
        # Like srun: the requeue/checkpoint signals go to every rank, which stop cleanly on their own.
        for rank, proc in enumerate(procs):
            if rank not in exits:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal)
        for sig in FORWARDED_SIGNALS:
            previous[sig] = signal.signal(sig, forward)
    follower = _Follower(rd.rank_log(0), echo) if echo is not None else None
    try:
        try:
            for rank in range(len(envs)):
                files += [open(rd.rank_log(rank, "out"), "ab"), open(rd.rank_log(rank, "err"), "ab")]  # noqa: SIM115
            forked = _forked_ranks(argv, envs, files, cwd)
            for rank, env in enumerate(envs):
                out, err = files[2 * rank], files[2 * rank + 1]
                if forked is not None:
                    proc, pipe = forked[rank]
                else:
                    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.PIPE,
                                            env=env, start_new_session=True, cwd=cwd)
                    pipe = proc.stderr
                procs.append(proc)
                assert pipe is not None
                pumps.append(_ErrPump(pipe, err))
                threading.Thread(target=_reap, args=(rank, proc, events), daemon=True).start()
            try:
                _write_launch_record(run_dir, job_id, procs, ours, threads, argv, workdir, forked is not None)
            except OSError as e:  # a full disk: the ranks will say what failed; the launcher goes on
                sys.stderr.write(f"cyclone_kit: warning: could not write {rd.launch}: {e.strerror or e}\n")
            if on_start is not None:
                on_start(procs)
            deadline = None if timeout_s is None else started + timeout_s
            while len(exits) < len(procs):
                if follower is not None:
                    follower.pump()
                try:
                    rank, code, when = events.get(timeout=0.1)
                except queue.Empty:
                    if deadline is not None and time.monotonic() > deadline and not interrupted:
                        interrupted = True
                        stop_began = time.monotonic()
                        stopping.update(r for r in range(len(procs)) if r not in exits)
                        _terminate(procs, stopping, exits)
                    elif stop_began is not None and time.monotonic() - stop_began > (
                            stop_grace_s if interrupted else grace_s):
                        _kill(procs, exits)
                    continue
                exit_ = RankExit(rank, envs[rank]["SLURMD_NODENAME"], procs[rank].pid, code, when - started,
                                 stopped=rank in stopping)
                exits[rank] = exit_
                if exit_.failed and first_failure is None and not interrupted:
                    first_failure = exit_
                    stop_began = time.monotonic()
                    stopping.update(r for r in range(len(procs)) if r not in exits)
                    _terminate(procs, stopping, exits)
        except (_Interrupted, KeyboardInterrupt):
            interrupted = True
            stop_began = stop_began or time.monotonic()
            # Ignore further Ctrl-C while the ranks are being stopped: a second one must not orphan them.
            for sig in (signal.SIGINT, signal.SIGTERM):
                if sig in previous:
                    signal.signal(sig, signal.SIG_IGN)
            stopping.update(r for r in range(len(procs)) if r not in exits)
            _terminate(procs, stopping, exits)
            _drain(procs, events, exits, envs, stopping, started, stop_grace_s)
    finally:
        # Whatever happened: no rank, and nothing a rank started in its group, outlives the launcher.
        for rank, proc in enumerate(procs):
            if rank not in exits:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                exits[rank] = RankExit(rank, envs[rank]["SLURMD_NODENAME"], proc.pid, proc.returncode,
                                       time.monotonic() - started, stopped=True)
        _kill_leftovers(procs)
        for pump in pumps:
            pump.join()
        if follower is not None:
            follower.pump()
            follower.close()
        for f in files:
            with contextlib.suppress(OSError):  # a full disk: the log lost its tail, the launcher knows it
                f.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    ended = time.monotonic()
    result = LaunchResult(
        job_id=job_id,
        run_dir=run_dir,
        exits=tuple(exits[r] for r in sorted(exits)),
        first_failure=first_failure,
        interrupted=interrupted,
        wall_time_s=ended - started,
        stop_s=None if stop_began is None else max(e.elapsed_s for e in exits.values()) - (stop_began - started),
        stderr_tails=tuple(tuple(p.tail()) for p in pumps),
    )
    _record_wall_time(run_dir, result.wall_time_s)
    if not result.ok:
        try:
            failures.write_failure(run_dir, failure_record(result))
        except OSError as e:  # a full disk: say so, and still report the root cause
            result = dataclasses.replace(result, record_error=_why(RunDir(run_dir).failure, e))
    return result


def _forked_ranks(argv: Sequence[str], envs: Sequence[Mapping[str, str]], files: Sequence[IO[bytes]],
                  cwd: Path | str | None) -> list[tuple[Any, IO[bytes]]] | None:
    """The trainer's ranks forked from one process that imported torch once (:mod:`cyclone_kit.core.prefork`),
    each with its stderr pipe; None where that is not possible (the caller starts fresh processes)."""
    if not prefork.enabled(envs[0]) or list(argv[1:3]) != ["-m", TRAINER_MODULE]:
        return None
    pipes = [os.pipe() for _ in envs]
    starts = [prefork.RankStart(args=tuple(argv[3:]), env=env, module=TRAINER_MODULE,
                                cwd=None if cwd is None else str(cwd), stdout=files[2 * rank].fileno(),
                                stderr=pipes[rank][1]) for rank, env in enumerate(envs)]
    try:
        forked = prefork.spawn(starts, python=argv[0], cwd=os.getcwd() if cwd is None else str(cwd))
    finally:
        for _, write_end in pipes:
            os.close(write_end)
    if forked is None:
        for read_end, _ in pipes:
            os.close(read_end)
        return None
    return [(proc, os.fdopen(read_end, "rb")) for proc, (read_end, _) in zip(forked, pipes, strict=True)]


class _ErrPump:
    """Copies a rank's stderr pipe into its log file and keeps the last lines in memory: the
    launcher can report a rank's last words even when its log could not take them (a full disk)."""

    def __init__(self, pipe: IO[bytes], log: IO[bytes], keep_bytes: int = 64_000) -> None:
        self.pipe, self.log, self.keep = pipe, log, keep_bytes
        self.buffer = bytearray()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while chunk := os.read(self.pipe.fileno(), 65536):
            self.buffer += chunk
            del self.buffer[: max(len(self.buffer) - self.keep, 0)]
            with contextlib.suppress(OSError):
                os.write(self.log.fileno(), chunk)

    def join(self, timeout: float = 5.0) -> None:
        """Wait until every process holding the pipe has closed it (or ``timeout``)."""
        self.thread.join(timeout)
        with contextlib.suppress(OSError):
            self.pipe.close()

    def tail(self, n: int = STDERR_TAIL_LINES) -> list[str]:
        """The last ``n`` lines written (decoded, without line ends)."""
        lines = bytes(self.buffer).decode("utf-8", errors="replace").splitlines()
        return lines[-n:]


def _reap(rank: int, proc: subprocess.Popen[bytes], events: queue.Queue[tuple[int, int, float]]) -> None:
    """Wait for one rank and post (rank, status, time) the moment it exits (exact exit order)."""
    code = proc.wait()
    events.put((rank, code, time.monotonic()))


def _terminate(procs: Sequence[subprocess.Popen[bytes]], ranks: set[int], exits: Mapping[int, RankExit]) -> None:
    """SIGTERM the process group of every listed rank that is still running."""
    for rank in sorted(ranks):
        if rank not in exits:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(procs[rank].pid, signal.SIGTERM)


def _kill(procs: Sequence[subprocess.Popen[bytes]], exits: Mapping[int, RankExit]) -> None:
    """SIGKILL the process group of every rank still running."""
    for rank, proc in enumerate(procs):
        if rank not in exits:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)


def _drain(
    procs: Sequence[subprocess.Popen[bytes]],
    events: queue.Queue[tuple[int, int, float]],
    exits: dict[int, RankExit],
    envs: Sequence[Mapping[str, str]],
    stopping: set[int],
    started: float,
    grace_s: float,
) -> None:
    """Collect exits after an interrupt: SIGTERM was sent; SIGKILL once ``grace_s`` has passed."""
    deadline = time.monotonic() + grace_s
    killed = False
    while len(exits) < len(procs):
        try:
            rank, code, when = events.get(timeout=0.1)
        except queue.Empty:
            if not killed and time.monotonic() > deadline:
                _kill(procs, exits)
                killed = True
            continue
        exits[rank] = RankExit(rank, envs[rank]["SLURMD_NODENAME"], procs[rank].pid, code, when - started,
                               stopped=rank in stopping)


def _kill_leftovers(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGKILL whatever is left in the ranks' process groups (e.g. data-loader workers)."""
    groups = {p.pid for p in procs}
    for pid, pgid in _process_groups():
        if pgid in groups and pid != os.getpid():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def _process_groups() -> list[tuple[int, int]]:
    """(pid, process group) of every process, from /proc ([] where /proc is missing)."""
    out = []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 2 and fields[0] != "Z":
            out.append((int(entry.name), int(fields[2])))
    return out


def _record_wall_time(run_dir: Path, wall_time_s: float) -> None:
    """Add the launch's wall time to ``launch.json`` once every rank has ended (``status``'s ELAPSED)."""
    rd = RunDir(run_dir)
    doc = rd.read_launch()
    if doc is None:  # no rank started
        return
    with contextlib.suppress(OSError):  # a full disk: status shows no wall time, the run's result stands
        rd.write_launch({**doc, "wall_time_s": round(wall_time_s, 3)})


def _write_launch_record(
    run_dir: Path,
    job_id: str,
    procs: Sequence[subprocess.Popen[bytes]],
    envs: Sequence[Mapping[str, str]],
    threads: int,
    argv: Sequence[str],
    cwd: str,
    forked: bool = False,
) -> None:
    """``launch.json``: the fake job id, the command, the working folder, whether the ranks were forked from one
    process that imported torch (:mod:`cyclone_kit.core.prefork`) and every rank's pid, host and the variables
    the launcher set on it (``envs``: :func:`~cyclone_kit.backends.local_env.launcher_variables`; for ``status``,
    for tests, and to hold against a dry run's plan)."""
    doc = {
        "schema": 1,
        "kind": "launch",
        "launcher": LOCAL.name,
        "job_id": job_id,
        "nodelist": envs[0]["SLURM_JOB_NODELIST"],
        "master": f"{envs[0]['MASTER_ADDR']}:{envs[0]['MASTER_PORT']}",
        "threads_per_rank": threads,
        "command": list(argv),
        "cwd": cwd,
        "forked": forked,
        "ranks": [{"rank": r, "pid": p.pid, "host": envs[r]["SLURMD_NODENAME"], "env": dict(envs[r])}
                  for r, p in enumerate(procs)],
    }
    RunDir(run_dir).write_launch(doc)


class _Follower:
    """Copies what a rank appends to its log onto a stream (rank 0's output on the terminal)."""

    def __init__(self, path: Path, stream: IO[str]) -> None:
        self.path = path
        self.stream = stream
        self.handle: IO[bytes] | None = None

    def pump(self) -> None:
        if self.handle is None:
            try:
                self.handle = open(self.path, "rb")  # noqa: SIM115 (closed in close())
            except OSError:
                return
        data = self.handle.read()
        if data:
            with contextlib.suppress(OSError, ValueError):
                self.stream.write(data.decode("utf-8", errors="replace"))
                self.stream.flush()

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()


