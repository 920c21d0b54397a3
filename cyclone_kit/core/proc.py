"""The one subprocess wrapper of cyclone_kit: every external command goes through :func:`run_command`.

It always has a timeout, never uses a shell, and turns every failure into a
:class:`~cyclone_kit.core.errors.CommandError` that carries argv, exit code, stdout and stderr
(ReFrame's ``run_command`` / ``SpawnedProcessError``).
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cyclone_kit.core.errors import CommandError, CommandNotFound

#: how many characters of stderr/stdout an error message quotes (the full text is on the error)
_QUOTE_CHARS = 300


@dataclass(frozen=True)
class CompletedCommand:
    """The result of a finished command.

    Attributes:
        argv: the command as run.
        returncode: its exit status (negative: killed by that signal).
        stdout: standard output, decoded as UTF-8 (undecodable bytes replaced).
        stderr: standard error, decoded the same way.
        duration_s: wall-clock seconds it ran.
    """

    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    duration_s: float

    @property
    def ok(self) -> bool:
        """True when the command exited 0."""
        return self.returncode == 0


def run_command(
    argv: Sequence[str],
    *,
    timeout: float = 30,
    check: bool = True,
    input: str | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> CompletedCommand:
    """Run ``argv`` (no shell) and return its :class:`CompletedCommand`.

    Args:
        argv: program and arguments; the program is looked up on PATH.
        timeout: seconds before the command and everything it started (its process group) are
            killed and :class:`CommandError` is raised, whatever ``check`` says.
        check: raise :class:`CommandError` when the exit status is not 0.
        input: text written to the command's stdin (stdin is empty otherwise).
        env: variables set on top of the current environment (not a replacement for it).
        cwd: working directory of the command.

    Raises:
        CommandNotFound: the program is not on PATH (or not executable).
        CommandError: non-zero exit (with ``check``), timeout, or the command could not start.
    """
    args = [os.fspath(a) for a in argv]
    full_env = None if env is None else {**os.environ, **env}
    _preflight(args, full_env, cwd)
    started = time.monotonic()
    try:
        proc = subprocess.Popen(
            args,
            stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=full_env,
            cwd=cwd,
            # Own process group, so a timeout can kill what the command started too.
            start_new_session=True,
        )
    except OSError as exc:
        raise CommandError(
            f"could not start {shlex.join(args)}: {exc}", hint="check the program's permissions", argv=args
        ) from exc
    out, err = _communicate(proc, args, input, timeout)
    result = CompletedCommand(
        argv=tuple(args),
        returncode=proc.returncode,
        stdout=_decode(out),
        stderr=_decode(err),
        duration_s=time.monotonic() - started,
    )
    if check and not result.ok:
        detail = _quote(result.stderr) or _quote(result.stdout) or "no output"
        raise CommandError(
            f"{shlex.join(args)} exited {result.returncode}: {detail}",
            hint=f"run `{shlex.join(args)}` by hand to see the full output",
            argv=args,
            returncode=result.returncode,
            stdout=result.stdout,
            stderr=result.stderr,
        )
    return result


def _preflight(args: list[str], env: Mapping[str, str] | None, cwd: str | os.PathLike[str] | None) -> None:
    """Refuse an empty command, a program not on PATH and a missing working directory, before starting."""
    if not args:
        raise CommandError("empty command", hint="pass the program and its arguments as a list", argv=args)
    program = args[0]
    if shutil.which(program, path=env.get("PATH") if env is not None else None) is None:
        raise CommandNotFound(
            f"command not found: {program}",
            hint=f"install {program} or put it on PATH (running {shlex.join(args)})",
            argv=args,
        )
    if cwd is not None and not Path(cwd).is_dir():
        raise CommandError(
            f"working directory {os.fspath(cwd)!r} does not exist for {shlex.join(args)}",
            hint="create the directory first",
            argv=args,
        )


def _communicate(proc: subprocess.Popen[bytes], args: list[str], input: str | None, timeout: float) -> tuple[bytes, bytes]:
    """stdout and stderr of ``proc``; on timeout its process group is killed and CommandError raised."""
    try:
        return proc.communicate(input=input.encode() if input is not None else None, timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        try:
            out, err = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:  # a grandchild left the group and holds the pipes
            proc.kill()
            proc.wait()
            out, err = b"", b""
        raise CommandError(
            f"{shlex.join(args)} timed out after {timeout:g} s",
            hint="the service it talks to may be down or overloaded; retry, or raise the timeout",
            argv=args,
            returncode=None,
            stdout=_decode(out),
            stderr=_decode(err),
        ) from None


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Kill the command's process group (it leads its own session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


def _decode(data: bytes | None) -> str:
    """Bytes to text, never failing."""
    return (data or b"").decode("utf-8", errors="replace")


def _quote(text: str) -> str:
    """The stripped text on one line, cut to a readable length."""
    flat = " ".join(text.split())
    return flat if len(flat) <= _QUOTE_CHARS else flat[: _QUOTE_CHARS - 3] + "..."
