"""Turn CLI flags and spec files into a resolved job (the shared front half of submit/run/sweep)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from cyclone_kit.config import (
    JobSpec,
    apply_overrides,
    load_profile,
    read_toml,
    reject_empty_strings,
    set_fields,
    spec_from_dict,
    spec_to_dict,
)
from cyclone_kit.errors import ValidationError
from cyclone_kit.validate import ResolvedJob, resolve

DEFAULT_SPEC = Path(__file__).parent / "jobs" / "default.toml"

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
    "name": "name",
}


def add_job_arguments(parser: argparse.ArgumentParser, *, with_resources: bool = True) -> None:
    """Add SPEC, --set and the resource flags shared by submit, run and sweep."""
    parser.add_argument("spec", nargs="?", help="job spec TOML (default: the embedded ResNet-50 benchmark job)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override any spec field, e.g. --set train.lr=0.2 (repeatable)")
    if with_resources:
        parser.add_argument("--profile", help="cluster profile name or .toml path (default: the spec's, else cyclone)")
        parser.add_argument("--partition", help="Slurm partition (default: the spec's, else the profile's default)")
        parser.add_argument("--nodes", type=int, help="number of nodes")
        parser.add_argument("--gpus-per-node", type=int, help="GPUs per node (default: all of the node's)")
        parser.add_argument("--ntasks-per-node", type=int, help="tasks per node (srun: one per GPU)")
        parser.add_argument("--cpus-per-task", type=int, help="CPU cores per task")
        parser.add_argument("--time", help="wall time: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS")
        parser.add_argument("--account", help="Slurm account (project), e.g. p163")
        parser.add_argument("--launcher", help="srun (one task per GPU), torchrun (one task per node) or horovod")
    parser.add_argument("--name", help="job name (letters, digits, . _ + -)")
    add_data_check_argument(parser)


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


def spec_dict_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The spec file (or embedded default), then --set, then explicit flags (pure but for the read)."""
    data = read_toml(Path(args.spec)) if args.spec else read_toml(DEFAULT_SPEC)
    if args.spec and "sweep" in data:
        command = "sweep" if getattr(args, "command", None) != "sweep" else "submit"
        raise ValidationError(f"{args.spec} is a sweep spec (it has a [sweep] table), not a job spec",
                              hint=f"run it with `cyclone-kit {command} {args.spec}`")
    reject_empty_strings(data, args.spec or str(DEFAULT_SPEC))
    flags = [(key, getattr(args, dest)) for dest, key in FLAG_KEYS.items() if getattr(args, dest, None) is not None]
    return set_fields(apply_overrides(data, args.overrides), flags)


def job_from_args(args: argparse.Namespace) -> ResolvedJob:
    """Build and validate the job the flags describe."""
    spec = spec_from_dict(spec_dict_from_args(args))
    job = resolve(spec, load_profile(spec.resources.profile))
    if not getattr(args, "no_data_check", False):
        check_data_dir(job.spec)
    return job


def resolved_spec(job: ResolvedJob) -> JobSpec:
    """The spec with every resource the profile decided written in (what the run records)."""
    res = dataclasses.replace(
        job.spec.resources,
        partition=job.partition.name,
        gpus_per_node=job.gpus_per_node,
        ntasks_per_node=job.ntasks_per_node,
        cpus_per_task=job.cpus_per_task,
        time=job.time,
        account=job.account,
    )
    return dataclasses.replace(job.spec, resources=res)


def spec_json(job: ResolvedJob) -> str:
    """The resolved spec as the run directory's ``spec.json`` text."""
    return json.dumps(spec_to_dict(resolved_spec(job)), indent=2, sort_keys=True) + "\n"
