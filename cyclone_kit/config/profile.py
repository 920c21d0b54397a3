"""Cluster profiles: typed, frozen descriptions of a cluster's partitions (``profiles/*.toml``).

Dicts exist only at the edge (the TOML file); :func:`profile_from_dict` builds a frozen
:class:`ClusterProfile` validated on construction.
"""

from __future__ import annotations

import dataclasses
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cyclone_kit.config.container import ContainerConfig
from cyclone_kit.config.toolbox import (
    build,
    check_directives,
    check_non_negative,
    check_positive,
    read_toml,
)
from cyclone_kit.core.errors import ValidationError
from cyclone_kit.rundir.network import LEVELS as NETWORK_LEVELS
from cyclone_kit.rundir.network import NetworkFigures, level_from_dict
from cyclone_kit.slurm.walltime import parse_time

GPU_REQUESTS = ("gres", "gpus-per-node")


PROFILE_DIR = Path(__file__).resolve().parent.parent / "profiles"


@dataclass(frozen=True)
class Partition:
    """One Slurm partition of a cluster: what a node has and how long a job may run."""

    name: str
    nodes: int
    cpus_per_node: int
    gpus_per_node: int = 0
    memory_gb: int = 0
    gpu_type: str = ""
    max_time: str = "1-00:00:00"
    default: bool = False
    nodelist: str = ""
    #: published network figures (the ``[partitions.NAME.network]`` table), labelled as such by ``predict``.
    network: NetworkFigures | None = field(default=None, compare=False, hash=False)

    def __post_init__(self) -> None:
        check_positive(f"partition {self.name!r} nodes", self.nodes)
        check_positive(f"partition {self.name!r} cpus_per_node", self.cpus_per_node)
        check_non_negative(f"partition {self.name!r} gpus_per_node", self.gpus_per_node)
        parse_time(self.max_time)

    @property
    def max_time_s(self) -> int:
        """The partition's wall-time limit in seconds."""
        return parse_time(self.max_time)

    @property
    def cpus_per_gpu(self) -> int:
        """Cores per GPU when the node is split evenly (all cores on CPU partitions)."""
        return self.cpus_per_node // self.gpus_per_node if self.gpus_per_node else self.cpus_per_node


@dataclass(frozen=True)
class ClusterProfile:
    """A cluster: its partitions and how a job script sets up its software.

    ``setup`` lines are raw shell (e.g. ``source ~/venv/bin/activate``): they come from the
    user's own profile file and are trusted like a shell rc file. ``modules`` and ``env``
    values are data and are always shell-quoted when rendered.

    ``container`` (the ``[container]`` table) gives the cluster's container runtime, binds every
    containerised job gets, and optionally a default image (then every job runs in it).

    ``gpu_bind``, ``cpu_bind`` and ``distribution`` (empty: Slurm's defaults) are passed to
    every ``srun`` of the job as ``--gpu-bind``, ``--cpu-bind`` and ``--distribution``. The
    runtime needs each task to see one GPU, or all of the node's GPUs (it refuses e.g. 2 visible
    GPUs for 4 ranks, what ``--gpu-bind=closest`` gives with 2 tasks per socket).
    """

    name: str
    partitions: tuple[Partition, ...]
    description: str = ""
    modules: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    account: str = ""
    account_required: bool = False
    extra_sbatch: tuple[str, ...] = ()
    setup: tuple[str, ...] = ()
    python: str = ""
    gpu_request: str = "gres"
    cpus_per_gpu: int = 0
    gpu_bind: str = ""
    cpu_bind: str = ""
    distribution: str = ""
    spare_nodes: int = 0  # spare nodes a job on this cluster asks for unless it says (in-job restarts)
    container: ContainerConfig | None = None  # the [container] table: runtime, binds, a default image

    @property
    def srun_binding(self) -> tuple[str, ...]:
        """The binding options of every srun line (``--cpu-bind=cores`` & co.), empty ones left out."""
        pairs = (("--cpu-bind", self.cpu_bind), ("--distribution", self.distribution), ("--gpu-bind", self.gpu_bind))
        return tuple(f"{flag}={value}" for flag, value in pairs if value)

    def __post_init__(self) -> None:
        if not self.partitions:
            raise ValidationError(f"profile {self.name!r} has no partitions", hint="add a [partitions.NAME] table")
        defaults = [p.name for p in self.partitions if p.default]
        if len(defaults) > 1:
            raise ValidationError(
                f"profile {self.name!r} marks several default partitions: {', '.join(defaults)}",
                hint="set default = true on exactly one partition",
            )
        if self.gpu_request not in GPU_REQUESTS:
            raise ValidationError(
                f"profile {self.name!r}: gpu_request {self.gpu_request!r} is unknown",
                hint=f"use one of {', '.join(GPU_REQUESTS)}",
            )
        for key, _ in self.env:
            if not key.isidentifier():
                raise ValidationError(
                    f"profile {self.name!r}: environment name {key!r} is not a valid variable name",
                    hint="use letters, digits and '_' only, not starting with a digit",
                )
        check_directives(f"profile {self.name!r}: extra_sbatch", self.extra_sbatch)
        check_non_negative(f"profile {self.name!r}: spare_nodes", self.spare_nodes)
        for key in ("gpu_bind", "cpu_bind", "distribution"):
            value = getattr(self, key)
            if value and not re.fullmatch(r"[A-Za-z0-9_.,:*+-]+", value):
                raise ValidationError(
                    f"profile {self.name!r}: {key} {value!r} is not a Slurm binding value",
                    hint=f"use a value srun accepts for --{key.replace('_', '-')}, e.g. "
                         + {"gpu_bind": "none or single:1", "cpu_bind": "cores", "distribution": "block:block"}[key],
                )

    @property
    def default_partition(self) -> Partition:
        """The partition marked default (else the first one)."""
        return next((p for p in self.partitions if p.default), self.partitions[0])

    def partition(self, name: str) -> Partition:
        """Look a partition up by name, or raise a ValidationError listing the valid ones."""
        for p in self.partitions:
            if p.name == name:
                return p
        raise ValidationError(
            f"unknown partition {name!r} in profile {self.name!r}",
            hint=f"use one of: {', '.join(p.name for p in self.partitions)}",
        )


def published_network(table: Any, profile: str, part: Partition) -> NetworkFigures:
    """The ``[partitions.NAME.network]`` table: published figures per level (``intra`` / ``inter``).

    Keys: ``backend`` (gloo / nccl), ``source`` (the citation), and per level ``alpha_us``,
    ``busbw_gbps``, ``ranks`` (the ranks the figures hold for) and its own ``source``.

    Raises:
        ValidationError: not a table, an unknown level or key, or a figure that is not a positive number.
    """
    where = f"profile {profile!r} partitions.{part.name}.network"
    if not isinstance(table, dict):
        raise ValidationError(f"{where} is not a table", hint=f"write [partitions.{part.name}.network.inter]")
    table = dict(table)
    backend, source = str(table.pop("backend", "nccl" if part.gpus_per_node else "gloo")), str(table.pop("source", ""))
    for level, figures in table.items():
        if level not in NETWORK_LEVELS:
            raise ValidationError(f"{where}: unknown key {level!r}", hint=f"use backend, source, {', '.join(NETWORK_LEVELS)}")
        unknown = set(figures) - {"alpha_us", "busbw_gbps", "ranks", "source"} if isinstance(figures, dict) else set()
        if unknown:
            raise ValidationError(f"{where}.{level}: unknown key(s) {', '.join(sorted(unknown))}",
                                  hint="use alpha_us, busbw_gbps, ranks, source")
    levels = {k: level_from_dict({"source": source, **v} if isinstance(v, dict) else v, f"{where}.{k}", published=True)
              for k, v in table.items()}
    return NetworkFigures(levels=levels, source="published", cluster=profile, partition=part.name,
                          device="cuda" if part.gpus_per_node else "cpu", device_type=part.gpu_type, backend=backend,
                          origin=f"profile {profile!r} [partitions.{part.name}.network] (published figures)")


def profile_from_dict(data: dict[str, Any], name: str) -> ClusterProfile:
    """Build a ClusterProfile from the dict of a profile TOML file."""
    data = dict(data)
    parts = data.pop("partitions", None)
    if not isinstance(parts, dict) or not parts:
        raise ValidationError(f"profile {name!r} has no partitions", hint="add a [partitions.NAME] table per partition")
    partitions = []
    for pname, pdata in parts.items():
        if not isinstance(pdata, dict):
            raise ValidationError(f"profile {name!r}: partitions.{pname} is not a table", hint="write [partitions.NAME]")
        pdata = dict(pdata)
        network = pdata.pop("network", None)
        part = build(Partition, f"partitions.{pname}", {"name": pname, **pdata})
        if network is not None:
            part = dataclasses.replace(part, network=published_network(network, name, part))
        partitions.append(part)
    env = data.pop("env", {})
    container = data.pop("container", None)
    if container is not None:
        if not isinstance(container, dict):
            raise ValidationError(f"profile {name!r}: container must be a table",
                                  hint='write [container] then runtime = "apptainer"')
        data["container"] = build(ContainerConfig, "container", container)
    if not isinstance(env, dict) or not all(isinstance(v, str | int | float) for v in env.values()):
        raise ValidationError(f"profile {name!r}: env must be a table of strings", hint='write [env] then KEY = "value"')
    data.setdefault("name", name)
    return build(
        ClusterProfile,
        "profile",
        {**data, "partitions": tuple(partitions), "env": tuple((str(k), str(v)) for k, v in env.items())},
    )


def user_profile_dir(environ: typing.Mapping[str, str] | None = None) -> Path:
    """Where user profiles live: ``$XDG_CONFIG_HOME/cyclone_kit/profiles`` (``~/.config``)."""
    environ = os.environ if environ is None else environ
    base = environ.get("XDG_CONFIG_HOME") or str(Path(environ.get("HOME", "~")).expanduser() / ".config")
    return Path(base) / "cyclone_kit" / "profiles"


def profile_names() -> list[str]:
    """Names of every profile found (built-in and user), sorted."""
    names = {p.stem for p in PROFILE_DIR.glob("*.toml")}
    udir = user_profile_dir()
    if udir.is_dir():
        names |= {p.stem for p in udir.glob("*.toml")}
    return sorted(names)


def load_profile(name_or_path: str) -> ClusterProfile:
    """Load a profile by name (user dir first, then built-in) or from a ``.toml`` path."""
    candidate = Path(name_or_path)
    if name_or_path.endswith(".toml") or os.sep in name_or_path:
        if not candidate.is_file():
            raise ValidationError(f"profile file {name_or_path!r} does not exist", hint="check the path")
        return profile_from_dict(read_toml(candidate), candidate.stem)
    for folder in (user_profile_dir(), PROFILE_DIR):
        path = folder / f"{name_or_path}.toml"
        if path.is_file():
            return profile_from_dict(read_toml(path), name_or_path)
    raise ValidationError(
        f"unknown profile {name_or_path!r}",
        hint=f"use one of: {', '.join(profile_names())}, or a path to a .toml profile",
    )
