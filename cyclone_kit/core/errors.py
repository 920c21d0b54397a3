"""The CycloneError tree: every expected failure carries a one-line message and a HINT.

The CLI turns any :class:`CycloneError` into ``error: <message> HINT: <hint>`` on stderr and
exit code 2; nothing else should reach the user as a traceback.
"""

from __future__ import annotations

import errno
from collections.abc import Sequence


class CycloneError(Exception):
    """Base of every error cyclone_kit raises on purpose.

    Args:
        message: what is wrong, naming the offending value.
        hint: the exact fix the user should apply.
    """

    exit_code = 2

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        text = self.message if not self.hint else f"{self.message} HINT: {self.hint}"
        # One line, always: newlines in user values must not split the error.
        return " ".join(text.split("\n"))


class ValidationError(CycloneError):
    """A spec, profile, flag or environment value is invalid."""


class ResumeRefused(ValidationError):
    """A run that should continue from a checkpoint found none it can load, and will not start over at step 0."""


class ParseError(CycloneError):
    """Scheduler or file output could not be parsed; the raw text is in the message."""


class SlurmError(CycloneError):
    """Slurm refused or failed an operation."""


class CommandError(CycloneError):
    """An external command failed; carries argv, exit code, stdout and stderr."""

    def __init__(
        self,
        message: str,
        hint: str = "",
        *,
        argv: Sequence[str] = (),
        returncode: int | None = None,
        stdout: str = "",
        stderr: str = "",
    ) -> None:
        super().__init__(message, hint)
        self.argv = list(argv)
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr


class CommandNotFound(CommandError):
    """An external command (sbatch, scontrol, ...) is not on PATH."""


class DiskFullError(CycloneError, OSError):
    """A file could not be written because its file system is full (or over quota); the message
    names the path, the space needed and the space free. Exit code 1: the run failed, the input was fine.

    Also an :class:`OSError` (``errno.ENOSPC``), so code that handles a failed write still does.
    """

    exit_code = 1

    def __init__(self, message: str, hint: str = "") -> None:
        CycloneError.__init__(self, message, hint)
        self.errno, self.strerror, self.filename = errno.ENOSPC, message, None


class TrainingDiverged(CycloneError):
    """The loss was not finite (NaN or infinite) for more consecutive steps than the run allows."""

    exit_code = 1


class RankFailure(CycloneError):
    """A rank of a distributed run died; the message is the root cause line."""


def did_you_mean(unknown: Sequence[str], valid: Sequence[str]) -> str:
    """``"did you mean train.lr (not train.lrr)? "`` for the first unknown key with a close valid one, else ``""``."""
    import difflib

    for key in unknown:
        close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
        if close:
            return f"did you mean {close[0]} (not {key})? "
    return ""
