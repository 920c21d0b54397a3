"""Scaling studies: a base job plus the points to run it at (pure, but for :func:`load_sweep`).

A sweep spec is a TOML file::

    [sweep]
    name = "strong-smoke"
    mode = "strong"                 # "strong": global batch fixed; "weak": per-device batch fixed
    global_batch_size = 64          # strong only: per-device batch = global / (N * grad_accum)
    points = [{nodes = 1, ntasks_per_node = 1}, {nodes = 2, ntasks_per_node = 2}]
    # or: world_sizes = [1, 2, 4]   # packed onto as few nodes as the partition allows
    repeats = 1                     # runs per point
    report = true                   # on Slurm: a final report job after all points
    serial = false                  # on Slurm: run the points one after another (afterany chain)
    base = "smoke.toml"             # base job spec, relative to this file ...

    [base]                          # ... and/or inline (merged over the file, section by section)
    [base.resources]
    profile = "local"

Everything past :func:`load_sweep` is frozen dataclasses; :func:`expand` turns a
:class:`SweepSpec` and a cluster profile into one :class:`SweepRun` (a validated
:class:`~cyclone_kit.config.validate.ResolvedJob`) per point and repeat. The smallest point is the
baseline of the study (the analysis takes the smallest world size).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cyclone_kit.config.job import SECTIONS, JobSpec, apply_overrides, set_fields, spec_from_dict, spec_to_dict, validate_name
from cyclone_kit.config.profile import ClusterProfile
from cyclone_kit.config.toolbox import read_toml
from cyclone_kit.config.validate import ResolvedJob, resolve
from cyclone_kit.core.errors import ValidationError, did_you_mean
from cyclone_kit.launchers import get_launcher

MODES = ("strong", "weak")
SWEEP_KEYS = ("name", "mode", "global_batch_size", "points", "world_sizes", "repeats", "report", "serial", "base")
POINT_KEYS = ("nodes", "ntasks_per_node")
SCHEMA = 1


@dataclass(frozen=True)
class SweepPoint:
    """One layout of the study: ``nodes`` x ``ntasks_per_node`` ranks (one per GPU on GPU partitions)."""

    nodes: int
    ntasks_per_node: int

    def __post_init__(self) -> None:
        for key in POINT_KEYS:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValidationError(
                    f"sweep point {key}={value!r} must be a positive integer",
                    hint="write points = [{nodes = 1, ntasks_per_node = 2}, ...]",
                )

    @property
    def world_size(self) -> int:
        """Ranks at this point."""
        return self.nodes * self.ntasks_per_node

    @property
    def label(self) -> str:
        """``ws4-n2x2``: world size, nodes and tasks per node."""
        return f"ws{self.world_size}-n{self.nodes}x{self.ntasks_per_node}"


@dataclass(frozen=True)
class SweepSpec:
    """A validated scaling study: the base job, the mode and the points.

    Attributes:
        name: study name (directory and job-name prefix).
        mode: ``"strong"`` or ``"weak"``.
        base: the base job spec; its ``train.batch_size`` is the per-device batch in weak mode.
        points: explicit layouts (empty when ``world_sizes`` is used).
        world_sizes: world sizes to pack onto nodes at expansion time (empty when ``points`` is used).
        global_batch_size: fixed global batch of a strong study (None in weak mode).
        repeats: runs per point.
        report: submit a final report job (Slurm backends).
        serial: on Slurm, chain the points (each starts after the previous ended) so they never
            share cores: needed where "nodes" share one machine (the local test cluster).
    """

    name: str
    mode: str
    base: JobSpec
    points: tuple[SweepPoint, ...] = ()
    world_sizes: tuple[int, ...] = ()
    global_batch_size: int | None = None
    repeats: int = 1
    report: bool = True
    serial: bool = False

    def __post_init__(self) -> None:
        validate_name(self.name)
        if self.mode not in MODES:
            raise ValidationError(f"unknown sweep mode {self.mode!r}", hint='use mode = "strong" or mode = "weak"')
        if bool(self.points) == bool(self.world_sizes):
            raise ValidationError(
                "a sweep needs exactly one of points or world_sizes",
                hint="write points = [{nodes = 1, ntasks_per_node = 1}, ...] or world_sizes = [1, 2, 4]",
            )
        for n in self.world_sizes:
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValidationError(f"sweep world size {n!r} must be a positive integer",
                                      hint="world_sizes = [1, 2, 4]")
        sizes = [p.world_size for p in self.points] or list(self.world_sizes)
        if len(set(self.points)) != len(self.points):
            raise ValidationError("sweep points repeat a layout",
                                  hint="list each layout once; use repeats = N to run a point several times")
        if len(set(self.world_sizes)) != len(self.world_sizes):
            raise ValidationError("sweep world_sizes repeat a value",
                                  hint="list each size once; use repeats = N to run a point several times")
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < 1:
            raise ValidationError(f"sweep repeats must be a positive integer, got {self.repeats!r}", hint="repeats = 1")
        for key in ("report", "serial"):
            if not isinstance(getattr(self, key), bool):
                raise ValidationError(f"sweep {key} must be true or false, got {getattr(self, key)!r}",
                                      hint=f"{key} = true")
        accum = self.base.train.grad_accum
        if self.base.script is not None and self.mode == "weak" and not self.base.script.batch_size:
            raise ValidationError(
                "a weak-scaling sweep of a script needs the per-device batch it trains with",
                hint="set batch_size = N in the base's [script] table (and pass {per_device_batch_size} in its args)",
            )
        if self.mode == "strong":
            gbs = self.global_batch_size
            if gbs is None:
                suggestion = (self.base.per_device_batch_size or 64) * min(sizes) * accum
                raise ValidationError(
                    "a strong-scaling sweep needs global_batch_size",
                    hint=f"add global_batch_size = {suggestion} to [sweep] (per-device batch = global / N)",
                )
            if isinstance(gbs, bool) or not isinstance(gbs, int) or gbs < 1:
                raise ValidationError(f"sweep global_batch_size must be a positive integer, got {gbs!r}",
                                      hint="global_batch_size = 256")
            for n in sizes:
                if gbs % (n * accum):
                    divisors = [k for k in sorted(set(sizes)) if gbs % (k * accum) == 0]
                    raise ValidationError(
                        f"strong scaling: global_batch_size={gbs} does not divide over world size {n}"
                        + (f" x grad_accum {accum}" if accum > 1 else ""),
                        hint=f"use a global batch divisible by {_lcm([k * accum for k in sizes])} "
                        f"(it divides for world sizes {divisors or 'none'})",
                    )
        elif self.global_batch_size is not None:
            raise ValidationError(
                "global_batch_size is only for strong scaling: a weak study keeps the per-device batch fixed",
                hint="drop global_batch_size and set the per-device batch in the base spec (train.batch_size)",
            )

    def per_device_batch(self, world_size: int) -> int:
        """The per-device batch at ``world_size`` (strong: global / (N * grad_accum); weak: the base's)."""
        if self.mode == "strong":
            assert self.global_batch_size is not None
            return self.global_batch_size // (world_size * self.base.train.grad_accum)
        return self.base.per_device_batch_size


@dataclass(frozen=True)
class SweepRun:
    """One run of a study: a point, a repeat, and its validated job.

    Attributes:
        name: the run's directory name inside the study (``p0-ws1-n1x1`` or ``...-r2``).
        point: the layout.
        repeat: 1-based repeat number.
        job: the resolved job for this point (its spec named ``<study>-ws<N>``).
    """

    name: str
    point: SweepPoint
    repeat: int
    job: ResolvedJob

    @property
    def world_size(self) -> int:
        """Ranks of this run (as the job will start them)."""
        return self.job.world_size

    @property
    def per_device_batch_size(self) -> int:
        """The per-device batch this run trains with."""
        return self.job.spec.per_device_batch_size

    def record(self) -> dict[str, Any]:
        """This run's entry of ``sweep.json`` (``run_dir`` relative to the study directory)."""
        return {
            "name": self.name,
            "world_size": self.world_size,
            "nodes": self.job.nodes,
            "ntasks_per_node": self.job.ntasks_per_node,
            "per_device_batch_size": self.per_device_batch_size,
            "global_batch_size": self.per_device_batch_size * self.world_size * self.job.spec.train.grad_accum,
            "repeat": self.repeat,
            "run_dir": self.name,
        }


# --------------------------------------------------------------------------- parsing
def sweep_from_dict(data: Mapping[str, Any], base: Mapping[str, Any] | None = None) -> SweepSpec:
    """Build a SweepSpec from a parsed sweep TOML (pure).

    Args:
        data: the sweep file's table: ``[sweep]`` and optionally an inline ``[base]`` job spec.
        base: the job spec dict read from ``sweep.base`` (a file), when there is one; the inline
            ``[base]`` table is merged over it section by section.

    Raises:
        ValidationError: unknown keys (listed), wrong types, no base, or an invalid study.
    """
    if not isinstance(data, Mapping):
        raise ValidationError("a sweep spec must be a table", hint="see jobs/strong_scaling.toml")
    unknown = sorted(set(data) - {"sweep", "base"})
    if unknown:
        raise ValidationError(f"unknown sweep spec key(s): {', '.join(unknown)}",
                              hint="a sweep file has a [sweep] table and optionally a [base] job spec table")
    table = data.get("sweep")
    if not isinstance(table, Mapping):
        raise ValidationError("the sweep spec has no [sweep] table", hint="see jobs/strong_scaling.toml")
    unknown = sorted(set(table) - set(SWEEP_KEYS))
    if unknown:
        raise ValidationError(f"unknown key(s) in [sweep]: {', '.join(unknown)}",
                              hint=did_you_mean(unknown, SWEEP_KEYS) + f"valid keys: {', '.join(SWEEP_KEYS)}")
    inline = data.get("base", {})
    if not isinstance(inline, Mapping):
        raise ValidationError("[base] must be a job spec table", hint="write [base.train], [base.resources] ...")
    if base is None and "base" not in data:
        raise ValidationError("the sweep spec names no base job",
                              hint='add base = "smoke.toml" to [sweep] or an inline [base] job spec table')
    spec = spec_from_dict(merge_spec_dicts(dict(base or {}), dict(inline)))

    name = table.get("name", spec.name)
    if not isinstance(name, str):
        raise ValidationError(f"sweep name must be a string, got {name!r}", hint='name = "strong-resnet18"')
    mode = table.get("mode")
    if mode is None:
        raise ValidationError("the sweep spec has no mode", hint='add mode = "strong" or mode = "weak" to [sweep]')

    points: list[SweepPoint] = []
    raw_points = table.get("points", [])
    if not isinstance(raw_points, list):
        raise ValidationError("sweep points must be a list of tables",
                              hint="points = [{nodes = 1, ntasks_per_node = 2}]")
    for i, raw in enumerate(raw_points):
        if not isinstance(raw, Mapping):
            raise ValidationError(f"sweep point {i} is not a table: {raw!r}",
                                  hint="points = [{nodes = 1, ntasks_per_node = 2}]")
        bad = sorted(set(raw) - set(POINT_KEYS))
        if bad:
            raise ValidationError(f"unknown key(s) in sweep point {i}: {', '.join(bad)}",
                                  hint=f"valid keys: {', '.join(POINT_KEYS)}")
        points.append(SweepPoint(nodes=raw.get("nodes", 1), ntasks_per_node=raw.get("ntasks_per_node", 1)))
    sizes = table.get("world_sizes", [])
    if not isinstance(sizes, list):
        raise ValidationError("sweep world_sizes must be a list of integers", hint="world_sizes = [1, 2, 4]")
    return SweepSpec(
        name=name,
        mode=mode,
        base=spec,
        points=tuple(points),
        world_sizes=tuple(sizes),
        global_batch_size=table.get("global_batch_size"),
        repeats=table.get("repeats", 1),
        report=table.get("report", True),
        serial=table.get("serial", False),
    )


def merge_spec_dicts(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Merge job spec dicts section by section: ``over``'s keys win (pure)."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def load_sweep(
    path: str | Path,
    overrides: Iterable[str] = (),
    flags: Iterable[tuple[str, Any]] = (),
) -> SweepSpec:
    """Read a sweep TOML file (and its ``base`` job file), apply ``--set`` and flag overrides to the base.

    Args:
        path: the sweep spec file.
        overrides: ``--set key=value`` strings for the base job.
        flags: ``(spec key, value)`` pairs (``resources.profile`` ...), applied last.

    Raises:
        ValidationError: a file is missing or malformed, or the study is invalid.
    """
    path = Path(path)
    data = read_toml(path)
    table = data.get("sweep")
    if "sweep" not in data and set(data) & {"name", *SECTIONS}:
        raise ValidationError(f"{path} is a job spec (no [sweep] table), not a sweep spec",
                              hint=f"submit one job with `cyclone-kit submit {path}`, or write a sweep file "
                                   f"with [sweep] base = {path.name!r} (see jobs/strong_scaling.toml)")
    if not isinstance(table, dict):
        return sweep_from_dict(data)  # raises the precise error
    base_ref = table.get("base")
    base: dict[str, Any] = {}
    if base_ref is not None:
        if not isinstance(base_ref, str) or not base_ref:
            raise ValidationError(f"sweep base must be a path string, got {base_ref!r}", hint='base = "smoke.toml"')
        base = _absolute_script(read_toml(path.parent / base_ref), (path.parent / base_ref).parent)
    elif "base" not in data:
        return sweep_from_dict(data)  # raises: no base job
    inline = data.get("base", {})
    if not isinstance(inline, dict):
        return sweep_from_dict(data)  # raises: [base] is not a table
    inline = _absolute_script(inline, path.parent)
    merged = set_fields(apply_overrides(merge_spec_dicts(base, inline), overrides), flags)
    return sweep_from_dict({**data, "sweep": {k: v for k, v in table.items() if k != "base"}, "base": merged})


def _absolute_script(spec: dict[str, Any], folder: Path) -> dict[str, Any]:
    """A spec dict whose ``[script]`` path and chdir are made absolute from the folder of the file it came from."""
    table = spec.get("script")
    if not isinstance(table, dict):
        return spec
    out = dict(table)
    for key in ("path", "chdir"):
        value = table.get(key)
        if isinstance(value, str) and value and not Path(value).expanduser().is_absolute():
            out[key] = str((folder / Path(value).expanduser()).absolute())
    return {**spec, "script": out}

# --------------------------------------------------------------------------- expansion
def point_layouts(sweep: SweepSpec, profile: ClusterProfile) -> tuple[SweepPoint, ...]:
    """The study's layouts, smallest world size first (``world_sizes`` packed onto the partition).

    A world size N is packed onto as few nodes as possible: N ranks on one node when they fit
    (the base's ``ntasks_per_node`` when set, else the partition's GPUs per node, else its
    cores per node), else full nodes; N must then be a multiple of the per-node count.
    """
    if sweep.points:
        return tuple(sorted(sweep.points, key=lambda p: (p.world_size, p.nodes)))
    res = sweep.base.resources
    part = profile.partition(res.partition) if res.partition else profile.default_partition
    per_node = res.ntasks_per_node or part.gpus_per_node or part.cpus_per_node
    layouts = []
    for n in sorted(sweep.world_sizes):
        if n <= per_node:
            layouts.append(SweepPoint(1, n))
        elif n % per_node == 0:
            layouts.append(SweepPoint(n // per_node, per_node))
        else:
            raise ValidationError(
                f"world size {n} does not fill whole nodes of {per_node} ranks on partition {part.name!r}",
                hint=f"use a multiple of {per_node} above {per_node}, "
                "or explicit points = [{nodes = ..., ntasks_per_node = ...}]",
            )
    return tuple(layouts)


def point_spec(sweep: SweepSpec, point: SweepPoint, profile: ClusterProfile) -> JobSpec:
    """The base spec placed at ``point``: nodes, tasks (and GPUs) per node, batch and name (pure)."""
    res = sweep.base.resources
    part = profile.partition(res.partition) if res.partition else profile.default_partition
    # the launcher places the point's ranks: tasks (and GPUs) per node, or torchrun's one agent per node
    layout = get_launcher(res.launcher).point_resources(point.ntasks_per_node, bool(part.gpus_per_node))
    resources = dataclasses.replace(res, nodes=point.nodes, **layout)
    name = f"{sweep.name}-ws{point.world_size}"
    if sweep.base.script is not None:  # the script's args get the point's numbers ({per_device_batch_size} ...)
        from cyclone_kit.config.script import fill_script_args

        per_device = sweep.per_device_batch(point.world_size)
        values = {"per_device_batch_size": per_device, "global_batch_size": per_device * point.world_size,
                  "world_size": point.world_size, "num_nodes": point.nodes}
        script = dataclasses.replace(sweep.base.script, batch_size=per_device,
                                     args=fill_script_args(sweep.base.script.args, values))
        return dataclasses.replace(sweep.base, name=name, script=script, resources=resources)
    train = dataclasses.replace(sweep.base.train, batch_size=sweep.per_device_batch(point.world_size))
    return dataclasses.replace(sweep.base, name=name, train=train, resources=resources)


def expand(sweep: SweepSpec, profile: ClusterProfile) -> tuple[SweepRun, ...]:
    """Every run of the study, baseline first, each validated against ``profile`` (pure).

    Raises:
        ValidationError: a point does not fit the profile (e.g. more nodes than the partition has).
    """
    runs = []
    for i, point in enumerate(point_layouts(sweep, profile)):
        try:
            job = resolve(point_spec(sweep, point, profile), profile)
        except ValidationError as e:
            raise ValidationError(f"sweep point {point.label}: {e.message}", hint=e.hint) from None
        for r in range(1, sweep.repeats + 1):
            name = f"p{i}-{point.label}" + (f"-r{r}" if sweep.repeats > 1 else "")
            runs.append(SweepRun(name=name, point=point, repeat=r, job=job))
    return tuple(runs)


def sweep_record(sweep: SweepSpec, runs: Sequence[SweepRun], profile: ClusterProfile, backend: str) -> dict[str, Any]:
    """The ``sweep.json`` document (the contract the analysis reads; pure)."""
    return {
        "schema": SCHEMA,
        "kind": "sweep",
        "study": sweep.name,
        "mode": sweep.mode,
        "global_batch_size": sweep.global_batch_size,
        "repeats": sweep.repeats,
        "serial": sweep.serial,
        "profile": profile.name,
        "backend": backend,
        "base_spec": spec_to_dict(sweep.base),
        "points": [run.record() for run in runs],
    }


def _lcm(values: Iterable[int]) -> int:
    from math import lcm

    return lcm(*values)
