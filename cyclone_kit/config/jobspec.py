"""Turn CLI flags and spec files into a resolved job (the shared front half of submit/run/sweep)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from cyclone_kit.config.job import DIST_ENV_CHOICES, JobSpec, apply_overrides, set_fields, spec_from_dict, spec_to_dict
from cyclone_kit.config.profile import load_profile
from cyclone_kit.config.toolbox import read_toml, reject_empty_strings
from cyclone_kit.config.validate import ResolvedJob, resolve
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


def spec_dict_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The spec file (or embedded default), then --set, then explicit flags (pure but for the read).

    ``SCRIPT.py`` or ``-m MODULE`` take the embedded default's resources (but its partition) and
    checkpoint sections with a ``[script]`` table instead of its ``[train]``, named after the script.
    """
    script = script_table_from_args(args)
    if script is not None:
        from cyclone_kit.config.job import ScriptConfig
        from cyclone_kit.config.script import job_name_for

        default = read_toml(DEFAULT_SPEC)
        data = {"name": job_name_for(ScriptConfig(path=script.get("path", ""), module=script.get("module", ""))),
                # the profile's default partition, not the embedded benchmark's
                "resources": {k: v for k, v in default.get("resources", {}).items() if k != "partition"},
                "checkpoint": default.get("checkpoint", {}),
                "script": script}
    else:
        spec_path = Path(args.spec) if args.spec else DEFAULT_SPEC
        data = read_toml(spec_path)
        if args.spec and "sweep" in data:
            command = "sweep" if getattr(args, "command", None) != "sweep" else "submit"
            raise ValidationError(f"{args.spec} is a sweep spec (it has a [sweep] table), not a job spec",
                                  hint=f"run it with `cyclone-kit {command} {args.spec}`")
        # a script's own argument list may hold an empty string; every other empty value is refused
        script_table = data.get("script") if isinstance(data.get("script"), dict) else None
        reject_empty_strings({**data, "script": {k: v for k, v in script_table.items() if k != "args"}}
                             if script_table is not None else data, args.spec or str(DEFAULT_SPEC))
        if isinstance(data.get("script"), dict):
            data = {**data, "script": _script_paths_from(data["script"], spec_path.parent)}
    data = _script_flags(data, args)
    flags = [(key, getattr(args, dest)) for dest, key in FLAG_KEYS.items() if getattr(args, dest, None) is not None]
    return set_fields(apply_overrides(data, args.overrides), flags)


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


def checked_spec(spec: JobSpec) -> tuple[JobSpec, Any]:
    """``spec`` with its script checked (exists, compiles) and hashed; (spec, CheckedScript or None)."""
    if spec.script is None:
        return spec, None
    from cyclone_kit.config.script import check_script

    checked = check_script(spec.script, Path.cwd())
    return dataclasses.replace(spec, script=checked.config), checked


def check_backend(spec: JobSpec, backend: str) -> None:
    """Refuse a backend that cannot run a user's script (submitit runs the built-in trainer's callable),
    or a container (the submitit backend never wraps its ranks; the local one cannot run Pyxis, which needs srun)."""
    from cyclone_kit.launchers.containers import RUNTIMES

    box = spec.container
    if box is not None and (backend == "submitit" or (backend == "local" and not RUNTIMES[box.runtime].local)):
        raise ValidationError(f"a container job ({box.runtime} image {box.image}) with the {backend} backend, which "
                              f"cannot run {box.runtime}",
                              hint="use --backend slurm (default), or drop --container"
                              + (" (the local backend runs charliecloud and apptainer images)" if backend == "local" else ""))
    if spec.script is not None and backend == "submitit":
        raise ValidationError(f"the submitit backend runs the built-in trainer, not {spec.script.label}",
                              hint="use --backend slurm (default) or --backend local for a script")


def check_restart_backend(job: ResolvedJob, backend: str) -> None:
    """Refuse spare nodes or a shrink floor on a backend without the step watcher that uses them.

    Only the slurm backend's batch script restarts a step inside the job (``--spare-nodes``,
    ``--min-nodes``, or the profile's ``spare_nodes``); the local and submitit backends would
    silently ignore them.

    Raises:
        ValidationError: ``job`` restarts in the job and ``backend`` is not slurm.
    """
    if backend == "slurm" or not job.restarts_in_job:
        return
    asked, drop = [], []
    if job.spare_nodes and job.spec.resources.spare_nodes is None:
        asked.append(f"profile {job.profile.name!r} spare_nodes={job.spare_nodes}")
        drop.append("pass --spare-nodes 0")
    elif job.spare_nodes:
        asked.append(f"--spare-nodes={job.spare_nodes}")
        drop.append("drop --spare-nodes (resources.spare_nodes)")
    if 0 < job.min_nodes < job.nodes:
        asked.append(f"--min-nodes={job.min_nodes}")
        drop.append("drop --min-nodes (resources.min_nodes)")
    refuse_restart_flags(asked, drop, f"the {backend} backend", "use --backend slurm (default), or")


def refuse_restart_flags(asked: list[str], drop: list[str], where: str, fix: str) -> None:
    """The refusal of in-job restart settings that ``where`` would ignore (pure).

    Args:
        asked: the settings asked for, as the user wrote them (``--spare-nodes=1``).
        drop: how to take each back.
        where: what would ignore them; fix: the hint's first choice, ending in "or".

    Raises:
        ValidationError: always.
    """
    raise ValidationError(
        f"{' and '.join(asked)}: in-job restarts (spare nodes, a shrink floor) need the slurm backend's step "
        f"watcher; {where} would ignore them",
        hint=f"{fix} {' and '.join(drop)}",
    )


def fill_args(job: ResolvedJob) -> ResolvedJob:
    """The job with the placeholders in its script's args filled from its layout (pure)."""
    spec = job.spec
    if spec.script is None:
        return job
    from cyclone_kit.config.job import fill_script_args

    per_device = spec.script.batch_size
    values = {"per_device_batch_size": per_device, "global_batch_size": per_device * job.world_size,
              "world_size": job.world_size, "num_nodes": job.nodes}
    script = dataclasses.replace(spec.script, args=fill_script_args(spec.script.args, values))
    return dataclasses.replace(job, spec=dataclasses.replace(spec, script=script))


def job_from_args(args: argparse.Namespace, backend: str | None = None) -> ResolvedJob:
    """Build and validate the job the flags describe (a script must exist and compile; a container's
    image, runtime and binds exist: :func:`check_container`); with ``backend``, one it can run (:func:`check_backend`)."""
    spec, _ = checked_spec(spec_from_dict(spec_dict_from_args(args)))
    job = fill_args(resolve(spec, load_profile(spec.resources.profile)))
    if not getattr(args, "no_data_check", False):
        check_data_dir(job.spec)
    if backend is not None:
        check_backend(job.spec, backend)
    return check_container(job, Path(getattr(args, "runs_dir", None) or "runs"))


def check_container(job: ResolvedJob, runs_dir: Path) -> ResolvedJob:
    """``job`` with its container's ``pythonpath`` filled in from this venv (``host_venv``), checked on this
    login node (:func:`~cyclone_kit.config.container.container_problems`); ``job`` itself without a container.

    Raises:
        ValidationError: the runtime is not installed, the image or a bind does not exist, or the image lacks
            a mount point, before any run directory is written.
    """
    from cyclone_kit.config.container import container_paths, container_problems, with_host_paths

    if job.spec.container is None:
        return job
    box = with_host_paths(job.spec.container)
    spec = dataclasses.replace(job.spec, container=box)
    container_problems(box, container_paths(spec, runs_dir.absolute() / "run"), job.partition.name)
    return dataclasses.replace(job, spec=spec)


def script_files(spec: JobSpec) -> dict[str, bytes]:
    """The run directory's copy of the job's script and its snapshot (``{}`` for the built-in trainer)."""
    if spec.script is None:
        return {}
    from cyclone_kit.config.script import check_script

    checked = check_script(spec.script, Path.cwd())
    if checked.config.sha256 != spec.script.sha256:
        raise ValidationError(f"script {checked.source_path} changed while the job was being prepared",
                              hint="submit again")
    return checked.files()


def resolved_spec(job: ResolvedJob) -> JobSpec:
    """The spec with every resource the profile decided written in (what the run records)."""
    res = dataclasses.replace(
        job.spec.resources,
        partition=job.partition.name,
        gpus_per_node=job.gpus_per_node,
        # torchrun on CPU nodes: the workers per node (its --nproc-per-node), as the flag meant
        ntasks_per_node=job.launcher.recorded_tasks_per_node(job.ntasks_per_node, job.procs_per_node,
                                                             job.gpus_per_node),
        cpus_per_task=job.cpus_per_task,
        time=job.time,
        account=job.account,
        spare_nodes=job.spare_nodes,
        min_nodes=job.min_nodes,
    )
    return dataclasses.replace(job.spec, resources=res)


def spec_json(job: ResolvedJob) -> str:
    """The resolved spec as the run directory's ``spec.json`` text."""
    return json.dumps(spec_to_dict(resolved_spec(job)), indent=2, sort_keys=True) + "\n"
