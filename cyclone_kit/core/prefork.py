"""Rank processes forked from one Python that has already imported torch (a fork server, as
``multiprocessing``'s forkserver and Android's zygote do it).

Every rank of the built-in trainer pays ``import torch`` and ``torch._dynamo`` (the first optimizer
step imports it) and torchvision: about 4 CPU-seconds on a 2-core VM, per rank, per start. The local launcher asks
:func:`spawn` for its ranks instead: one process (the *zygote*) imports :data:`PRELOAD` once, forks
one child per rank and exits; each child becomes the rank (its own session, its own stdout/stderr,
environment and working directory) and runs ``python -m MODULE ARGS`` in place. The launcher marks
itself a child subreaper for the zygote's few seconds, so the ranks become its own children: it
waits for them, signals their process groups and reads their exit status as before
(:class:`Forked` answers what :class:`subprocess.Popen` does for that). A child runs its rank only
once the launcher holds its pid (a byte on a pipe); a launcher interrupted before that closes the
pipe, and the children exit without running anything.

What a fork changes against a fresh ``python``, and why the trainer does not see it: a library that
reads an environment variable when it is loaded, and what runs at interpreter start-up
(``sitecustomize``, ``.pth`` files), see the zygote's environment, which is rank 0's (every rank gets
the same one but for its rank variables); the trainer sets its threads itself
(``torch.set_num_threads``); the zygote starts no thread pool (importing torch starts none). Ranks
that can see a GPU are never forked (:func:`sees_no_gpu`): a CUDA driver initialised before a fork
is unusable after it. User scripts are never forked either: a script may set ``OMP_NUM_THREADS``
before its own ``import torch``. Where a fork is not possible (no ``fork``, a zygote that cannot
start or dies) :func:`spawn` returns None and the caller starts fresh processes;
``CYCLONE_PREFORK=0`` asks for fresh processes always.

Stdlib only: the zygote imports what it preloads by name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence

__all__ = ["ENV_VAR", "PRELOAD", "Forked", "RankStart", "enabled", "sees_no_gpu", "spawn"]

#: ``CYCLONE_PREFORK=0``: every rank a fresh ``python`` (the environment of the launching process).
ENV_VAR = "CYCLONE_PREFORK"
#: What the zygote imports before it forks: torch, what the first optimizer step imports, the models, the trainer
#: (one that cannot be imported is left to the rank, which then fails on it as a fresh process would). The trainer is
#: what its entry point imports and both engines with theirs (checkpoints, phases), not the ``engine`` package alone,
#: whose engines load lazily: each forked rank imported them anew, ~0.2 s of one core (issue 27). None of them reads
#: the environment or starts a thread when imported. Never ``cyclone_kit.runtime.__main__`` itself: the rank runs it
#: with ``-m``, and runpy warns on stderr when a ``__main__`` it is about to run is already imported.
PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torchvision", "cyclone_kit.config.job",
           "cyclone_kit.runtime.watchers.rankexit", "cyclone_kit.runtime.engine.dataparallel",
           "cyclone_kit.runtime.engine.pipeline")
#: Hang guard of the zygote's answer (not a performance bound): its imports take ~5 s on a busy 2-core node.
ANSWER_HANG_S = 600.0
_PR_SET_CHILD_SUBREAPER = 36
_SPAWN_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class RankStart:
    """One process to fork: ``python -m module *args`` (or ``python path *args`` with ``script``).

    Attributes:
        args: the words after the module (``sys.argv[1:]``).
        env: its whole environment.
        module: the module run as ``__main__``.
        script: a script path run as ``__main__`` instead of ``module``.
        cwd: its working directory (None: the zygote's).
        stdout: the file descriptor (of the calling process) its stdout goes to.
        stderr: the same for stderr.
        stdin: the same for stdin (None: ``/dev/null``).
        new_session: a session (and process group) of its own, as ``start_new_session=True``.
    """

    args: tuple[str, ...]
    env: Mapping[str, str]
    module: str | None = None
    script: str | None = None
    cwd: str | None = None
    stdout: int = 1
    stderr: int = 2
    stdin: int | None = None
    new_session: bool = True


class Forked:
    """A forked rank, seen as :class:`subprocess.Popen` sees a child: ``pid``, ``poll``, ``wait``,
    ``returncode`` (negative: killed by that signal), ``send_signal``/``terminate``/``kill``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.args = [f"<forked rank pid {pid}>"]
        self.stdin = self.stdout = self.stderr = None
        self._lock = threading.Lock()  # one waitpid at a time (Popen's rule): a reaper thread and poll()

    def _status(self, status: int) -> int:
        self.returncode = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        return self.returncode

    def poll(self) -> int | None:
        """The exit status when it has ended, else None (never blocks)."""
        if self.returncode is not None or not self._lock.acquire(blocking=False):
            return self.returncode  # a blocking wait() in another thread will set it
        try:
            if self.returncode is None:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid == self.pid:
                    self._status(status)
        except ChildProcessError:
            pass
        finally:
            self._lock.release()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for it to end; raises :class:`subprocess.TimeoutExpired` after ``timeout`` seconds."""
        if timeout is not None:
            deadline = time.monotonic() + timeout
            delay = 0.0005
            while self.poll() is None:
                if time.monotonic() >= deadline:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
            return self.returncode  # type: ignore[return-value]
        with self._lock:
            while self.returncode is None:
                try:
                    _, status = os.waitpid(self.pid, 0)
                except InterruptedError:
                    continue
                except ChildProcessError:  # reaped elsewhere (SIGCHLD ignored): as Popen, status unknown, 0
                    self.returncode = 0
                    break
                self._status(status)
            return self.returncode

    def send_signal(self, sig: int) -> None:
        """Signal the rank (nothing when it has ended)."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        """SIGTERM."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL."""
        self.send_signal(signal.SIGKILL)


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """True where ranks may be forked: ``fork`` exists (Linux), ``CYCLONE_PREFORK`` is not ``0`` (``no``,
    ``false``, ``off``), and the ranks see no GPU (:func:`sees_no_gpu`)."""
    env = os.environ if environ is None else environ
    value = env.get(ENV_VAR, "1").strip().lower()
    return (value not in ("0", "no", "false", "off") and hasattr(os, "fork") and sys.platform.startswith("linux")
            and sees_no_gpu(env))


def sees_no_gpu(environ: Mapping[str, str], dev: str = "/dev") -> bool:
    """True when a process with ``environ`` can see no GPU: ``CUDA_VISIBLE_DEVICES`` is empty (or ``-1``), or
    this machine has no GPU device file (NVIDIA's ``nvidia0``..., AMD's ``kfd``, WSL's ``dxg``).

    GPU ranks are never forked: a library that initialises the CUDA driver while torch is imported (a
    ``torch.cuda.is_available()`` at import time) leaves a forked child unable to use CUDA at all.
    """
    if environ.get("CUDA_VISIBLE_DEVICES", "x").strip() in ("", "-1"):
        return True
    try:
        names = os.listdir(dev)
    except OSError:
        return False
    return not any(n in ("kfd", "dxg") or (n.startswith("nvidia") and n[6:].isdigit()) for n in names)


def _subreaper(on: bool) -> bool:
    """Make this process the child subreaper of its descendants (Linux ``prctl``); False where refused."""
    import ctypes  # here: the launcher's import of this module stays light

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1 if on else 0, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def spawn(starts: Sequence[RankStart], *, python: str | None = None, env: Mapping[str, str] | None = None,
          cwd: str | None = None, preload: Sequence[str] = PRELOAD) -> list[Forked] | None:
    """Fork one process per :class:`RankStart` from a zygote that imported ``preload``; they become this
    process's children. None when that is not possible here (the caller then starts fresh processes).

    Args:
        starts: the processes, in order; their ``stdout``/``stderr``/``stdin`` descriptors are this process's.
        python: the interpreter of the zygote (default: this one).
        env: the zygote's environment (default: the first start's): what libraries read when loaded.
        cwd: the zygote's working directory (default: the first start's).
        preload: the modules it imports before it forks.
    """
    if not starts or not enabled(starts[0].env):
        return None
    own = {fd: os.dup(fd) for s in starts for fd in (s.stdout, s.stderr, s.stdin) if fd is not None and fd <= 2}
    try:
        return _spawn([dataclasses.replace(s, stdout=own.get(s.stdout, s.stdout), stderr=own.get(s.stderr, s.stderr),
                                           stdin=own.get(s.stdin, s.stdin) if s.stdin is not None else None)
                       for s in starts], python, env, cwd, preload)
    finally:
        for fd in own.values():  # this process's 0, 1, 2 passed on as descriptors the zygote does not use itself
            os.close(fd)


def _spawn(starts: Sequence[RankStart], python: str | None, env: Mapping[str, str] | None, cwd: str | None,
           preload: Sequence[str]) -> list[Forked] | None:
    # One spawn at a time in a process: the subreaper mark is the process's, and a second spawn's end must not
    # take it away while another zygote's children are still to be handed over.
    with _SPAWN_LOCK:
        return _spawn_locked(starts, python, env, cwd, preload)


def _spawn_locked(starts: Sequence[RankStart], python: str | None, env: Mapping[str, str] | None, cwd: str | None,
                  preload: Sequence[str]) -> list[Forked] | None:
    go_read, go_write = os.pipe()  # a rank runs only once this process knows its pid (one byte each)
    fds = sorted({go_read, *(fd for s in starts for fd in (s.stdout, s.stderr, s.stdin) if fd is not None)})
    request = {
        "preload": list(preload),
        "go": go_read,
        "ranks": [{"module": s.module, "script": s.script, "args": list(s.args), "env": dict(s.env), "cwd": s.cwd,
                   "stdout": s.stdout, "stderr": s.stderr, "stdin": s.stdin, "new_session": s.new_session}
                  for s in starts],
    }
    if not _subreaper(True):
        os.close(go_read)
        os.close(go_write)
        return None
    zygote = None
    pids = None
    try:
        zygote = subprocess.Popen([python or sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(env or starts[0].env),
                                  cwd=cwd or starts[0].cwd, pass_fds=fds, start_new_session=True)
        out, err = zygote.communicate(json.dumps(request).encode(), timeout=ANSWER_HANG_S)
        pids = json.loads(out.decode() or "null") if zygote.returncode == 0 else None
        if isinstance(pids, list) and len(pids) == len(starts):
            os.write(go_write, b"g" * len(pids))
    except (OSError, ValueError, subprocess.TimeoutExpired):
        pids, err = None, b""
    finally:
        # Without its byte (an interrupt, a bad answer), a forked child reads end-of-file here and exits at once:
        # no rank runs that this process does not know of.
        os.close(go_write)
        os.close(go_read)
        if zygote is not None and zygote.poll() is None:
            zygote.kill()
            zygote.wait()
        _subreaper(False)
    if not isinstance(pids, list) or len(pids) != len(starts):
        if err.strip():
            sys.stderr.write(f"cyclone_kit: fork server unavailable, fresh processes instead: "
                             f"{err.decode(errors='replace').strip().splitlines()[-1]}\n")
        return None
    return [Forked(int(pid)) for pid in pids]


# --------------------------------------------------------------------------- the zygote (python -m this module)
def _serve() -> None:
    """Read the request on stdin, import its preloads, fork its ranks, print their pids, exit."""
    request = json.loads(sys.stdin.buffer.read().decode())
    import importlib

    for name in request["preload"]:
        with contextlib.suppress(Exception):  # best effort: a rank that needs it fails on it as a fresh one would
            importlib.import_module(name)
    pids = []
    close = sorted({fd for r in request["ranks"] for fd in (r["stdout"], r["stderr"], r["stdin"]) if fd is not None})
    for rank in request["ranks"]:
        rank["close"] = [fd for fd in close if fd > 2 and fd != request["go"]]
        rank["go"] = request["go"]
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _become(rank)  # raises SystemExit: the rank's interpreter ends as a fresh one would
        pids.append(pid)
    sys.stdout.write(json.dumps(pids))
    sys.stdout.flush()
    os._exit(0)  # no atexit handler of the zygote's imports runs in it


def _become(rank: Mapping[str, object]) -> None:
    """In the forked child: take the rank's descriptors, session, directory and environment, and run it."""
    if rank["new_session"]:
        os.setsid()
    null = os.open(os.devnull, os.O_RDONLY) if rank["stdin"] is None else None
    for target, fd in ((0, rank["stdin"] if null is None else null), (1, rank["stdout"]), (2, rank["stderr"])):
        os.dup2(int(fd), target)  # type: ignore[call-overload]
    if null is not None:
        os.close(null)
    for fd in rank["close"]:  # type: ignore[attr-defined]
        with contextlib.suppress(OSError):  # every rank's descriptors but its own three, now 0, 1 and 2
            os.close(int(fd))
    # The zygote's pipes are closed now (0, 1 and 2 were replaced), so the caller reads its answer to the end;
    # the rank waits for its byte, which the caller sends once it holds the pids (end-of-file: it never will).
    go = int(rank["go"])  # type: ignore[call-overload]
    while True:
        try:
            byte = os.read(go, 1)
            break
        except InterruptedError:
            continue
    os.close(go)
    if not byte:
        os._exit(1)
    environ = {str(k): str(v) for k, v in dict(rank["env"]).items()}  # type: ignore[call-overload]
    os.environ.clear()
    os.environ.update(environ)
    if rank["cwd"]:
        os.chdir(str(rank["cwd"]))
    # New text streams on 0, 1, 2, as a fresh interpreter makes them (python -u: unbuffered, written through).
    unbuffered = bool(environ.get("PYTHONUNBUFFERED"))
    encoding = sys.stdout.encoding or "utf-8"
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(open(0, "rb", closefd=False), encoding=encoding)  # noqa: SIM115
    sys.stdout = sys.__stdout__ = _writer(1, encoding, "strict", unbuffered, line=os.isatty(1))
    sys.stderr = sys.__stderr__ = _writer(2, encoding, "backslashreplace", unbuffered, line=True)
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import runpy

    args = [str(a) for a in rank["args"]]  # type: ignore[attr-defined]
    if rank["script"]:
        script = str(rank["script"])
        sys.argv = [script, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")
    else:
        sys.argv = ["-m", *args]
        sys.path[0] = os.getcwd()
        runpy.run_module(str(rank["module"]), run_name="__main__", alter_sys=True)
    raise SystemExit(0)


def _writer(fd: int, encoding: str, errors: str, unbuffered: bool, *, line: bool) -> io.TextIOWrapper:
    raw = open(fd, "wb", buffering=0 if unbuffered else -1, closefd=False)  # noqa: SIM115 (the stream's life)
    return io.TextIOWrapper(raw, encoding=encoding, errors=errors, line_buffering=line, write_through=unbuffered)


if __name__ == "__main__":
    _serve()
