"""CLI flags and spec files -> a :class:`~cyclone_kit.config.job.JobSpec` (the command-line edge of submit/run/sweep).

The flags every job command shares, and :func:`spec_from_args`: the spec file (or the embedded
default, or ``SCRIPT.py`` / ``-m MODULE``), then ``--set``, then the explicit flags. Checking the
spec against a profile, the script and the container is the next modules' work, called in turn
by :func:`cyclone_kit.config.request.job_from_args`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from cyclone_kit.config.job import (
    DIST_ENV_CHOICES,
    JobSpec,
    ScriptConfig,
    apply_overrides,
    job_name_for,
    set_fields,
    spec_from_dict,
)
from cyclone_kit.config.toolbox import read_toml, reject_empty_strings
from cyclone_kit.core.errors import ValidationError

DEFAULT_SPEC = Path(__file__).resolve().parent.parent / "jobs" / "default.toml"

#: CLI flag (argparse dest) -> spec key.
FLAG_KEYS = {
    "profile": "resources.profile",
    "partition": "resources.partition",
    "nodes": "resources.nodes",
    "gpus_per_node": "resources.gpus_per_node",
    "ntasks_per_node": "resources.ntasks_per_node",
    "cpus_per_task": "resources.cpus_per_task",
    "time": "resources.time",
    "account": "resources.account",
    "launcher": "resources.launcher",
    "spare_nodes": "resources.spare_nodes",
    "min_nodes": "resources.min_nodes",
    "name": "name",
    "container": "container.image",
}


def add_job_arguments(parser: argparse.ArgumentParser, *, with_resources: bool = True) -> None:
    """Add SPEC, --set and the resource flags shared by submit, run and sweep."""
    parser.add_argument("spec", nargs="?", metavar="SPEC|SCRIPT.py",
                        help="job spec TOML (default: the embedded ResNet-50 benchmark job), or your own training "
                             "script (SCRIPT.py [options] -- ARGS: every rank runs it with the torchrun variables set)")
    parser.add_argument("-m", dest="module", metavar="MODULE",
                        help="run your training module (as python -m MODULE) instead of a script file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override any spec field, e.g. --set train.lr=0.2 (repeatable)")
    if with_resources:
        parser.add_argument("--profile", help="cluster profile name or .toml path (default: the spec's, else cyclone)")
        parser.add_argument("--partition", help="Slurm partition (default: the spec's, else the profile's default)")
        parser.add_argument("--nodes", type=int, help="number of nodes")
        parser.add_argument("--gpus-per-node", type=int, help="GPUs per node (default: all of the node's)")
        parser.add_argument("--ntasks-per-node", "--nproc-per-node", dest="ntasks_per_node", type=int,
                            help="tasks per node (srun: one per GPU); with --launcher torchrun on CPU nodes: "
                                 "workers per node (torchrun's --nproc-per-node)")
        parser.add_argument("--cpus-per-task", type=int, help="CPU cores per task")
        parser.add_argument("--time", help="wall time: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS")
        parser.add_argument("--account", help="Slurm account (project), e.g. p163")
        parser.add_argument("--launcher", help="srun (one task per GPU), torchrun (one task per node) or horovod")
        parser.add_argument("--spare-nodes", type=int, metavar="K",
                            help="allocate K nodes beside --nodes: a lost or hung node's step restarts on a spare, "
                                 "in the same job, from the newest checkpoint (default: the profile's, else 0)")
        parser.add_argument("--min-nodes", type=int, metavar="M",
                            help="with no spare left, restart the step on as few as M healthy nodes (the world "
                                 "shrinks) rather than requeue the job (default: never below --nodes)")
    parser.add_argument("--name", help="job name (letters, digits, . _ + -)")
    parser.add_argument("--container", metavar="IMAGE",
                        help="run the ranks inside this container image (the runtime: the profile's [container] "
                             "runtime, or --set container.runtime=charliecloud|apptainer|pyxis); the run directory, "
                             "working folder and this virtual environment are bound in at the same paths")
    add_script_arguments(parser)
    add_data_check_argument(parser)


def add_script_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--chdir`` and ``--live-code`` (a script job's working directory and code)."""
    parser.add_argument("--chdir", metavar="DIR",
                        help="a script job's working directory (default: this folder, as sbatch does); "
                             "its relative paths (./data, ./checkpoints) start there")
    parser.add_argument("--live-code", action="store_true",
                        help="run the script file itself on every segment, not the run directory's snapshot "
                             "of it and its modules taken now")
    parser.add_argument("--dist-env", choices=DIST_ENV_CHOICES,
                        help="torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK ...) for a script's ranks: auto "
                             "(default) gives them to a world of two or more, none to a world of one, as python "
                             "SCRIPT; torchrun gives them to a world of one too, as torchrun --nproc 1")


def add_data_check_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--no-data-check`` (train.data_dir is checked on this machine unless given)."""
    parser.add_argument("--no-data-check", action="store_true",
                        help="do not check that train.data_dir exists here (for a path only the compute nodes see)")


def is_script_path(spec_arg: str | None) -> bool:
    """Whether the positional argument names a Python script rather than a TOML spec (pure)."""
    return bool(spec_arg) and str(spec_arg).endswith((".py", ".pyw"))


def script_table_from_args(args: argparse.Namespace) -> dict[str, Any] | None:
    """The ``[script]`` table the command line asks for (``SCRIPT.py`` or ``-m``, ``-- ARGS``), or None."""
    module = getattr(args, "module", None)
    script_args = list(getattr(args, "script_args", None) or [])
    if module and args.spec:
        raise ValidationError(f"both {args.spec!r} and -m {module}",
                              hint="give either SCRIPT.py, -m MODULE or a job spec TOML")
    if module:
        return {"module": module, "args": script_args}
    if is_script_path(args.spec):
        return {"path": str(args.spec), "args": script_args}  # made absolute by the check (from the cwd)
    if script_args:
        raise ValidationError(f"arguments after -- ({' '.join(script_args)}) but no script to give them to",
                              hint="write SCRIPT.py or -m MODULE before --")
    return None


def spec_from_args(args: argparse.Namespace) -> JobSpec:
    """The job spec the command line describes (:func:`spec_dict_from_args`, built and validated; pure but for the read)."""
    data = spec_dict_from_args(args)
    return spec_from_dict(data)


def spec_dict_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The spec file (or embedded default), then --set, then explicit flags (pure but for the read).

    ``SCRIPT.py`` or ``-m MODULE`` take the embedded default's resources (but its partition) and
    checkpoint sections with a ``[script]`` table instead of its ``[train]``, named after the script
    unless ``--name`` or ``--set name=`` names the job.
    """
    script = script_table_from_args(args)
    if script is not None:
        default = read_toml(DEFAULT_SPEC)
        # the profile's default partition, not the embedded benchmark's
        data = {"resources": {k: v for k, v in default.get("resources", {}).items() if k != "partition"},
                "checkpoint": default.get("checkpoint", {}),
                "script": script}
    else:
        spec_path = Path(args.spec) if args.spec else DEFAULT_SPEC
        data = read_toml(spec_path)
        if args.spec and "sweep" in data:
            command = "sweep" if getattr(args, "command", None) != "sweep" else "submit"
            raise ValidationError(f"{args.spec} is a sweep spec (it has a [sweep] table), not a job spec",
                                  hint=f"run it with `cyclone-kit {command} {args.spec}`")
        if isinstance(data.get("script"), dict):
            data = {**data, "script": _script_paths_from(data["script"], spec_path.parent)}
    data = _script_flags(data, args)
    if script is None:  # the file's values (--chdir is checked apart): a script's argument list may hold an
        # empty string; every other empty value is refused
        script_table = data.get("script") if isinstance(data.get("script"), dict) else None
        reject_empty_strings({**data, "script": {k: v for k, v in script_table.items() if k != "args"}}
                             if script_table is not None else data, args.spec or str(DEFAULT_SPEC))
    flags = [(key, getattr(args, dest)) for dest, key in FLAG_KEYS.items() if getattr(args, dest, None) is not None]
    data = set_fields(apply_overrides(data, args.overrides), flags)
    if script is not None and "name" not in data:  # named after the script's file or module
        data = {"name": job_name_for(ScriptConfig(path=script.get("path", ""), module=script.get("module", ""))),
                **data}
    return data


def _script_paths_from(table: dict[str, Any], base_dir: Path) -> dict[str, Any]:
    """A TOML ``[script]`` table with its relative ``path`` and ``chdir`` made absolute from the spec file's folder."""
    out = dict(table)
    for key in ("path", "chdir"):
        value = table.get(key)
        if isinstance(value, str) and value and not Path(value).expanduser().is_absolute():
            out[key] = str((base_dir / Path(value).expanduser()).absolute())
    return out


def _script_flags(data: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """``--chdir`` (absolute from this folder), ``--live-code`` and ``--dist-env`` written into the ``[script]`` table."""
    table = script_flag_values(args, isinstance(data.get("script"), dict))
    return {**data, "script": {**data["script"], **table}} if table else data


def script_flag_values(args: argparse.Namespace, has_script: bool) -> dict[str, Any]:
    """The ``[script]`` keys ``--chdir`` (made absolute from this folder), ``--live-code`` and ``--dist-env`` set; {} for none.

    Raises:
        ValidationError: a flag given for a job without a script, or an empty ``--chdir``.
    """
    chdir, live = getattr(args, "chdir", None), getattr(args, "live_code", False)
    dist_env = getattr(args, "dist_env", None)
    if chdir is None and not live and dist_env is None:
        return {}
    if not has_script:
        flag = "--chdir" if chdir is not None else "--live-code" if live else "--dist-env"
        raise ValidationError(f"{flag} is for a script job, and this job runs the built-in trainer",
                              hint="give SCRIPT.py (or -m MODULE, or a spec with a [script] table), or drop " + flag)
    table: dict[str, Any] = {}
    if chdir is not None:
        if not chdir or "\n" in chdir:
            raise ValidationError(f"--chdir {chdir!r} is not a folder", hint="e.g. --chdir $HOME/project")
        table["chdir"] = str(Path(chdir).expanduser().absolute())
    if live:
        table["live"] = True
    if dist_env is not None:
        table["dist_env"] = dist_env
    return table
