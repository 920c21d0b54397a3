"""The user's own training script at the submission edge: find it, check it, hash it, copy it.

Before anything is submitted, :func:`check_script` makes sure the script exists and compiles
(``compile()`` on its source: the same check as ``py_compile``, without writing a ``.pyc`` next to
the user's file), and resolves a relative path against the directory it was given relative to
(the working directory for the command line, the spec file's directory for a TOML ``[script]``).
A ``-m MODULE`` is located with :func:`importlib.util.find_spec` and its source compiled the same
way. Every refusal is one :class:`~cyclone_kit.core.errors.ValidationError` line with a HINT.

The run directory keeps a copy of the script (:data:`COPY_DIR`) and ``spec.json`` its SHA-256, so
a report can say exactly which code ran; the ranks run the original file (its sibling imports keep
working) and the launch shim warns when it no longer matches the hash.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from pathlib import Path

from cyclone_kit.config.job import ScriptConfig
from cyclone_kit.core.errors import ValidationError
from cyclone_kit.rundir.layout import USER_SCRIPT_DIR as COPY_DIR  # the run directory's layout is RunDir's


@dataclasses.dataclass(frozen=True)
class CheckedScript:
    """A script that exists and compiles.

    Attributes:
        config: the ``[script]`` table with an absolute ``path`` and its ``sha256`` filled in.
        source_path: the file that runs (the script, or the module's source file).
        content: its bytes, for the run directory's copy.
    """

    config: ScriptConfig
    source_path: Path
    content: bytes

    @property
    def copy_name(self) -> str:
        """Where the copy goes inside the run directory (``script/<file name>``)."""
        return f"{COPY_DIR}/{self.source_path.name}"


def sha256_hex(content: bytes) -> str:
    """The SHA-256 of ``content`` as 64 hex digits (pure)."""
    return hashlib.sha256(content).hexdigest()


def compile_check(content: bytes, filename: str) -> None:
    """Compile ``content`` as Python (pure); a syntax error becomes one line naming file and line.

    Raises:
        ValidationError: the source does not compile.
    """
    try:
        compile(content, filename, "exec", dont_inherit=True)
    except SyntaxError as e:
        where = f"{filename}, line {e.lineno}" if e.lineno else filename
        raise ValidationError(f"{where}: {type(e).__name__}: {e.msg}",
                              hint="fix the script so that 'python -m py_compile SCRIPT' passes") from None
    except ValueError as e:  # e.g. source with NUL bytes
        raise ValidationError(f"{filename}: cannot be compiled ({e})", hint="is it a Python source file?") from None


def job_name_for(script: ScriptConfig) -> str:
    """A valid job name from the script's file or module name (``plain_ddp``; pure)."""
    stem = Path(script.path).stem if script.path else script.module.rsplit(".", 1)[-1]
    name = re.sub(r"[^A-Za-z0-9._+-]", "-", stem).lstrip(".-")[:64]
    return name or "script"


def check_script(script: ScriptConfig, base_dir: Path | str) -> CheckedScript:
    """Resolve ``script`` against ``base_dir``, check it exists and compiles, and hash it.

    Raises:
        ValidationError: no such file, a directory, unreadable, not UTF-8-decodable Python,
            does not compile, or the module cannot be found.
    """
    if script.module:
        source = _module_source(script.module)
    else:
        source = Path(script.path).expanduser()
        if not source.is_absolute():
            source = Path(base_dir) / source
        source = Path(_abspath(source))
        if not source.exists():
            looked = "" if str(source) == script.path else f" (looked for {source})"
            raise ValidationError(f"script {script.path!r} does not exist{looked}",
                                  hint="check the path (relative paths start at the working directory, or at "
                                       "the spec file's directory for a [script] table)")
        if source.is_dir():
            raise ValidationError(f"script {script.path!r} is a directory",
                                  hint="give the .py file, or -m PACKAGE for a package with __main__.py")
    try:
        content = source.read_bytes()
    except OSError as e:
        raise ValidationError(f"cannot read script {str(source)!r}: {e.strerror}",
                              hint="check the file's permissions") from None
    compile_check(content, str(source))
    config = dataclasses.replace(script, path="" if script.module else str(source), sha256=sha256_hex(content))
    return CheckedScript(config, source, content)


def _abspath(path: Path) -> str:
    import os

    return os.path.abspath(path)


def _module_source(module: str) -> Path:
    """The source file ``python -m MODULE`` would run (a package's ``__main__.py``)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError) as e:
        raise ValidationError(f"module {module!r} cannot be found ({type(e).__name__}: {e})",
                              hint="install it in this Python, or add its folder to PYTHONPATH") from None
    if spec is None:
        raise ValidationError(f"module {module!r} cannot be found",
                              hint="install it in this Python, or add its folder to PYTHONPATH")
    if spec.submodule_search_locations is not None:  # a package: python -m runs its __main__
        return _module_source(f"{module}.__main__")
    if not spec.origin or not spec.origin.endswith(".py"):
        raise ValidationError(f"module {module!r} has no Python source ({spec.origin})",
                              hint="give a module written in Python, or a .py path")
    return Path(spec.origin)
