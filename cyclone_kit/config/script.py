"""The user's own training script at the submission edge: find it, check it, hash it, copy it.

Before anything is submitted, :func:`check_script` makes sure the script exists and compiles
(``compile()`` on its source: the same check as ``py_compile``, without writing a ``.pyc`` next to
the user's file), and resolves a relative path against the directory it was given relative to
(the working directory for the command line, the spec file's directory for a TOML ``[script]``).
A ``-m MODULE`` is located with :func:`importlib.util.find_spec` and its source compiled the same
way. Every refusal is one :class:`~cyclone_kit.core.errors.ValidationError` line with a HINT.

What runs is what was submitted: the run directory keeps a **snapshot** (:data:`COPY_DIR`) of the
script and of every file it can import from its folder (:func:`importable_files`: the ``*.py``
files beside it and its packages, the folders there with an ``__init__.py``, whole), and every
segment of the job, requeues included, runs that snapshot (``sys.path[0]`` is the snapshot's
folder, as it would be the script's folder for ``python SCRIPT``, while ``__file__`` and
``sys.argv[0]`` stay the script's own path: ``cyclone_kit.runtime.launch.run_script``). ``spec.json`` records the
script's SHA-256, which is the snapshot's. More than :data:`SNAPSHOT_MAX_FILES` files or
:data:`SNAPSHOT_MAX_BYTES` bytes is refused with a HINT (move the script into a folder of its
own, or ``--live-code``). With ``script.live`` (``--live-code``) only a copy for the record is
kept and the ranks run the file itself, as it is when each segment starts (the shim warns when it
no longer matches the hash). A ``-m MODULE`` always runs live (the copy is its source file).

The job's working directory (``script.chdir``) is resolved here too: the folder ``submit`` ran in
unless told otherwise (``--chdir DIR``, or ``chdir`` in ``[script]``, relative to the spec file).

:func:`checked_job` is the request's step for what the job reads from this machine: the built-in
trainer's ``train.data_dir`` exists here (:func:`check_data_dir`), a script exists, compiles and is
hashed (:func:`checked_spec`), and its args' placeholders are filled from the job's layout
(:func:`fill_args`). :func:`script_files` is the run directory's copy of the script, read again at
writing time (refused if it changed).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import typing
from pathlib import Path
from typing import TYPE_CHECKING

from cyclone_kit.config.job import SCRIPT_PLACEHOLDERS, JobSpec, ScriptConfig
from cyclone_kit.core.errors import ValidationError
from cyclone_kit.rundir.layout import USER_SCRIPT_DIR as COPY_DIR  # the run directory's layout is RunDir's

if TYPE_CHECKING:
    from cyclone_kit.config.validate import ResolvedJob


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
    snapshot: tuple[str, ...] = ()

    @property
    def copy_name(self) -> str:
        """Where the copy goes inside the run directory (``script/<file name>``)."""
        return f"{COPY_DIR}/{self.source_path.name}"

    def files(self) -> dict[str, bytes]:
        """The run directory's copy: the script, and the snapshot of its folder (``script/...`` -> bytes).

        Raises:
            ValidationError: a file of the snapshot cannot be read any more.
        """
        out = {}
        for rel in self.snapshot:
            path = self.source_path.parent / rel
            try:
                out[f"{COPY_DIR}/{rel}"] = path.read_bytes()
            except OSError as e:
                raise ValidationError(f"cannot read {str(path)!r} for the script's snapshot: {e.strerror}",
                                      hint="fix its permissions, or pass --live-code to run the files in place") from None
        out[self.copy_name] = self.content
        return out


#: The snapshot's bounds: a script folder with more Python files, or more bytes of them, is refused.
SNAPSHOT_MAX_FILES = 400
SNAPSHOT_MAX_BYTES = 32 * 1024 * 1024


def importable_files(folder: Path, *, max_files: int = SNAPSHOT_MAX_FILES,
                     max_bytes: int = SNAPSHOT_MAX_BYTES) -> list[str]:
    """What ``python SCRIPT`` in ``folder`` can import from there: relative paths, sorted.

    The ``*.py`` files in ``folder`` and, whole, every package there (a sub-folder with an
    ``__init__.py``: its ``*.py`` files at any depth). Hidden folders, ``__pycache__`` and
    virtual environments are left out, as are folders without ``__init__.py`` (namespace
    packages: rare beside a script, and the usual place of data and run directories).

    Raises:
        ValidationError: more than ``max_files`` files or ``max_bytes`` bytes.
    """
    found: list[str] = []
    total = 0

    def add(path: Path) -> None:
        nonlocal total
        found.append(path.relative_to(folder).as_posix())
        total += path.stat().st_size
        if len(found) > max_files or total > max_bytes:
            raise ValidationError(
                f"the script's folder {str(folder)!r} holds more than {max_files} Python files or "
                f"{max_bytes // (1024 * 1024)} MiB of them to snapshot into the run directory",
                hint="put the script and the modules it imports in a folder of their own, or pass --live-code "
                     "(set live = true in [script]) to run the files in place as they are when the job starts")

    try:
        entries = sorted(folder.iterdir())
    except OSError as e:
        raise ValidationError(f"cannot list the script's folder {str(folder)!r}: {e.strerror}",
                              hint="fix its permissions, or pass --live-code") from None
    for entry in entries:
        if entry.suffix == ".py" and entry.is_file():
            add(entry)
        elif _is_package(entry):
            for root, dirs, files in os.walk(entry):
                dirs[:] = sorted(d for d in dirs if not _skipped(Path(root) / d))
                for name in sorted(files):
                    if name.endswith(".py") and (Path(root) / name).is_file():
                        add(Path(root) / name)
    return found


def _skipped(folder: Path) -> bool:
    """Hidden folders, byte-code caches and virtual environments are not part of a snapshot."""
    return folder.name.startswith(".") or folder.name == "__pycache__" or (folder / "pyvenv.cfg").exists()


def _is_package(entry: Path) -> bool:
    return entry.is_dir() and not _skipped(entry) and (entry / "__init__.py").is_file()


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
    chdir = _working_directory(script.chdir, Path(base_dir))
    config = dataclasses.replace(script, path="" if script.module else str(source), sha256=sha256_hex(content),
                                 chdir=chdir)
    snapshot = () if script.module or script.live else tuple(
        rel for rel in importable_files(source.parent) if rel != source.name)
    return CheckedScript(config, source, content, snapshot)


def _working_directory(chdir: str, base_dir: Path) -> str:
    """The job's working directory: ``chdir`` (relative: to ``base_dir``), else ``base_dir``; absolute.

    Raises:
        ValidationError: it does not exist or is not a directory.
    """
    path = Path(chdir).expanduser() if chdir else base_dir
    path = Path(_abspath(base_dir / path))
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        raise ValidationError(f"the job's working directory {str(path)!r} {what}",
                              hint="give --chdir an existing folder (the job's relative paths start there), "
                                   "or leave it out to run in the folder you submit from")
    return str(path)


def _abspath(path: Path) -> str:
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


def checked_job(job: ResolvedJob, *, data_check: bool = True) -> ResolvedJob:
    """``job`` with what it reads from this machine checked: its ``train.data_dir`` (unless ``data_check``
    is False: ``--no-data-check``), its script (exists, compiles, hashed) and its script's args filled in.

    Raises:
        ValidationError: :func:`check_data_dir`'s, :func:`check_script`'s or :func:`fill_script_args`' refusals.
    """
    if data_check:
        check_data_dir(job.spec)
    spec, _ = checked_spec(job.spec)
    return fill_args(dataclasses.replace(job, spec=spec))


def check_data_dir(spec: JobSpec) -> None:
    """Refuse a ``train.data_dir`` that does not exist on this (login) node, before any queue wait.

    Only datasets read from disk are checked; callers skip the check for ``--no-data-check``.

    Raises:
        ValidationError: the directory is missing or is not a directory.
    """
    if spec.train.dataset == "synthetic" or not spec.train.data_dir:
        return
    path = Path(spec.train.data_dir).expanduser()
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist on this machine"
        raise ValidationError(
            f"train.data_dir {spec.train.data_dir!r} {what}",
            hint="fix the path (--set train.data_dir=/path/to/data), or pass --no-data-check "
                 "if only the compute nodes can see it",
        )


def checked_spec(spec: JobSpec) -> tuple[JobSpec, CheckedScript | None]:
    """``spec`` with its script checked (exists, compiles) and hashed; (spec, CheckedScript or None)."""
    if spec.script is None:
        return spec, None
    checked = check_script(spec.script, Path.cwd())
    return dataclasses.replace(spec, script=checked.config), checked


def fill_script_args(args: typing.Iterable[str], values: typing.Mapping[str, int]) -> tuple[str, ...]:
    """Replace ``{world_size}`` & co. (:data:`SCRIPT_PLACEHOLDERS`) in ``args`` (pure).

    Other braces are left alone (JSON in an argument stays intact).

    Raises:
        ValidationError: a placeholder is used but its value is unknown (0), e.g.
            ``{per_device_batch_size}`` without ``script.batch_size`` or a sweep.
    """
    def sub(match: re.Match[str]) -> str:
        key = match.group(1)
        value = values.get(key, 0)
        if not value:
            raise ValidationError(
                f"script argument uses {{{key}}} but this job does not know it",
                hint="set script.batch_size (the per-device batch), or run the script in a sweep",
            )
        return str(value)

    pattern = re.compile(r"\{(" + "|".join(SCRIPT_PLACEHOLDERS) + r")\}")
    return tuple(pattern.sub(sub, arg) for arg in args)


def fill_args(job: ResolvedJob) -> ResolvedJob:
    """The job with the placeholders in its script's args filled from its layout (pure)."""
    spec = job.spec
    if spec.script is None:
        return job
    per_device = spec.script.batch_size
    values = {"per_device_batch_size": per_device, "global_batch_size": per_device * job.world_size,
              "world_size": job.world_size, "num_nodes": job.nodes}
    script = dataclasses.replace(spec.script, args=fill_script_args(spec.script.args, values))
    return dataclasses.replace(job, spec=dataclasses.replace(spec, script=script))


def script_files(spec: JobSpec) -> dict[str, bytes]:
    """The run directory's copy of the job's script and its snapshot (``{}`` for the built-in trainer)."""
    if spec.script is None:
        return {}
    checked = check_script(spec.script, Path.cwd())
    if checked.config.sha256 != spec.script.sha256:
        raise ValidationError(f"script {checked.source_path} changed while the job was being prepared",
                              hint="submit again")
    return checked.files()
