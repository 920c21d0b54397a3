"""What a rank runs for a run directory: the one place the rank command line is built (pure).

Both halves read this contract: the login side puts it in the job (the sbatch ``entry``, the
local launcher's argv, ``horovodrun``'s command), the rank side re-runs it under its watchdog.

* the built-in trainer: ``python -m cyclone_kit.runtime --run-dir DIR``;
* a user's script: the launch shim, ``python -m cyclone_kit.runtime.launch --run-dir DIR
  [--horovod] (SCRIPT | -m MODULE) ARGS...`` (:mod:`cyclone_kit.runtime.launch`). SCRIPT is the
  run directory's snapshot of the script (``script/<name>``, taken at submission, with the
  modules beside it) unless the spec says ``script.live``: then the file itself, as it is when
  each segment starts.

Module paths that jobs rendered before the re-layout call (``cyclone_kit.launch``) stay as
aliases at the package root, since a requeued job re-runs its old script.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cyclone_kit.launchers import get_launcher
from cyclone_kit.rundir.layout import RunDir

TRAINER_MODULE = "cyclone_kit.runtime"
SHIM_MODULE = "cyclone_kit.runtime.launch"


def trainer_words(run_dir: Path | str) -> list[str]:
    """The built-in trainer's arguments after ``python``."""
    return ["-m", TRAINER_MODULE, "--run-dir", str(run_dir)]


def shim_words(run_dir: Path | str | None, target: Sequence[str], *, horovod: bool = False,
               flags: Sequence[str] = ()) -> list[str]:
    """The launch shim's arguments after ``python``: ``target`` is ``[SCRIPT, ARGS...]`` or ``[-m, MOD, ARGS...]``;
    ``flags`` are the launcher's (:attr:`~cyclone_kit.launchers.registry.Launcher.shim_flags`)."""
    words = ["-m", SHIM_MODULE]
    if run_dir is not None:
        words += ["--run-dir", str(run_dir)]
    if horovod:
        words.append("--horovod")
    return words + list(flags) + list(target)


def script_target(script: Any, run_dir: Path | str | None = None) -> list[str]:
    """``[SCRIPT, ARGS...]`` or ``[-m, MODULE, ARGS...]`` of a :class:`~cyclone_kit.config.job.ScriptConfig`.

    With ``run_dir``, a script file that is not ``live`` is its snapshot in the run directory.
    """
    if script.module:
        return ["-m", script.module, *script.args]
    path = script.path
    if run_dir is not None and not getattr(script, "live", False):
        path = str(RunDir(Path(run_dir)).user_script_copy(Path(script.path).name))
    return [path, *script.args]


def rank_words(spec: Any, run_dir: Path | str) -> list[str]:
    """What every rank of ``spec`` runs after ``python``: the shim for a script job, else the trainer."""
    script = getattr(spec, "script", None)
    if script is None:
        return trainer_words(run_dir)
    return shim_words(run_dir, script_target(script, run_dir), flags=get_launcher(spec.resources.launcher).shim_flags)


def rank_argv(spec: Any, run_dir: Path | str, *, python: str | None = None) -> list[str]:
    """The whole argv of a rank of ``spec`` (``python`` defaults to this interpreter)."""
    return [python or sys.executable, *rank_words(spec, run_dir)]
