"""Typed, frozen configuration: cluster profiles and job specs.

Dicts exist only at the edge (TOML files, ``--set`` flags); everything past
:func:`spec_from_dict` / :func:`profile_from_dict` is a frozen dataclass that was
validated on construction. Cross-checks against a cluster profile live in
:mod:`cyclone_kit.validate`.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from cyclone_kit.errors import ValidationError
from cyclone_kit.walltime import parse_time

#: Models the runtime can build (cyclone_kit.runtime.models implements every one).
MODELS = (
    "tiny_cnn",
    "resnet18",
    "resnet34",
    "resnet50",
    "mobilenet_v3_small",
    "mobilenet_v3_large",
    "vit_b_16",
)
#: Data sets the runtime can load (never downloaded).
DATASETS = ("synthetic", "cifar10", "imagefolder", "fashion_mnist")
PRECISIONS = ("fp32", "bf16", "fp16", "auto")
STRATEGIES = ("ddp", "fsdp", "horovod", "pipeline")
LAUNCHERS = ("srun", "torchrun", "horovod")
SIGNALS = ("USR1", "USR2", "TERM", "INT", "HUP", "URG")
GPU_REQUESTS = ("gres", "gpus-per-node")

_PROFILE_DIR = Path(__file__).parent / "profiles"


# --------------------------------------------------------------------------- profiles
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

    def __post_init__(self) -> None:
        _positive(f"partition {self.name!r} nodes", self.nodes)
        _positive(f"partition {self.name!r} cpus_per_node", self.cpus_per_node)
        _non_negative(f"partition {self.name!r} gpus_per_node", self.gpus_per_node)
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
        _check_directives(f"profile {self.name!r}: extra_sbatch", self.extra_sbatch)
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
        partitions.append(_build(Partition, f"partitions.{pname}", {"name": pname, **pdata}))
    env = data.pop("env", {})
    if not isinstance(env, dict) or not all(isinstance(v, str | int | float) for v in env.values()):
        raise ValidationError(f"profile {name!r}: env must be a table of strings", hint='write [env] then KEY = "value"')
    data.setdefault("name", name)
    return _build(
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
    names = {p.stem for p in _PROFILE_DIR.glob("*.toml")}
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
    for folder in (user_profile_dir(), _PROFILE_DIR):
        path = folder / f"{name_or_path}.toml"
        if path.is_file():
            return profile_from_dict(read_toml(path), name_or_path)
    raise ValidationError(
        f"unknown profile {name_or_path!r}",
        hint=f"use one of: {', '.join(profile_names())}, or a path to a .toml profile",
    )


# --------------------------------------------------------------------------- job specs
@dataclass(frozen=True)
class TrainConfig:
    """What to train and how: model, data, schedule, precision and strategy."""

    model: str = "resnet18"
    dataset: str = "synthetic"
    data_dir: str = ""
    image_size: int = 32
    num_classes: int = 10
    synthetic_samples: int = 50000
    steps: int = 100
    epochs: int = 0
    batch_size: int = 64
    lr: float = 0.1
    lr_scaling: str = "linear"
    base_batch_size: int = 256
    warmup_steps: int = 0
    momentum: float = 0.9
    weight_decay: float = 5e-4
    precision: str = "auto"
    strategy: str = "ddp"
    grad_accum: int = 1
    compile: bool = False
    channels_last: bool = True
    seed: int = 0
    deterministic: bool = False
    log_every: int = 10
    val_every_epochs: int = 1
    val_samples: int = 0
    bucket_cap_mb: int = 25
    static_graph: bool = True  # DDP's static graph where valid (runtime/train.py use_static_graph)
    num_workers: int = -1
    pg_timeout_s: int = 600  # PyTorch's NCCL default: rank 0 may write or load a large checkpoint meanwhile
    microbatches: int = 4
    fp16_allreduce: bool = False

    def __post_init__(self) -> None:
        _choice("train.model", self.model, MODELS)
        _choice("train.dataset", self.dataset, DATASETS)
        _choice("train.precision", self.precision, PRECISIONS)
        _choice("train.strategy", self.strategy, STRATEGIES)
        _choice("train.lr_scaling", self.lr_scaling, ("linear", "sqrt", "none"))
        for name in ("image_size", "num_classes", "batch_size", "base_batch_size", "grad_accum", "log_every",
                     "bucket_cap_mb", "pg_timeout_s", "microbatches", "synthetic_samples"):
            _positive(f"train.{name}", getattr(self, name))
        for name in ("steps", "epochs", "warmup_steps", "val_every_epochs", "val_samples", "seed"):
            _non_negative(f"train.{name}", getattr(self, name))
        if self.steps == 0 and self.epochs == 0:
            raise ValidationError("train.steps and train.epochs are both 0", hint="set train.steps=N or train.epochs=N")
        if not self.lr > 0:
            raise ValidationError(f"train.lr must be > 0, got {self.lr}", hint="e.g. --set train.lr=0.1")
        if self.dataset in ("cifar10", "imagefolder", "fashion_mnist") and not self.data_dir:
            raise ValidationError(
                f"train.dataset {self.dataset!r} needs train.data_dir",
                hint="--set train.data_dir=/path/to/data (nothing is downloaded)",
            )


@dataclass(frozen=True)
class Resources:
    """Where and how the job runs: profile, partition, node/task/GPU counts, wall time."""

    profile: str = "cyclone"
    partition: str = ""
    nodes: int = 1
    gpus_per_node: int | None = None
    ntasks_per_node: int | None = None
    cpus_per_task: int | None = None
    time: str = "01:00:00"
    account: str = ""
    exclusive: bool = False
    launcher: str = "srun"
    mem: str = ""
    extra_sbatch: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _positive("resources.nodes", self.nodes)
        for name in ("gpus_per_node",):
            if getattr(self, name) is not None:
                _non_negative(f"resources.{name}", getattr(self, name))
        for name in ("ntasks_per_node", "cpus_per_task"):
            if getattr(self, name) is not None:
                _positive(f"resources.{name}", getattr(self, name))
        parse_time(self.time)
        _choice("resources.launcher", self.launcher, LAUNCHERS)
        _safe_token("resources.account", self.account)
        if self.mem:
            parse_mem_mb(self.mem)
        _check_directives("resources.extra_sbatch", self.extra_sbatch)


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpointing and wall-time requeue: how often, how many, which signal, how early."""

    every_steps: int = 0
    keep: int = 2
    resume: bool = True
    requeue: bool = True
    max_requeues: int = 3
    signal: str = "USR2"
    signal_lead_s: int = 120
    sharded: bool = False
    poll_s: float = 0.5  # seconds between the ranks' stop-flag agreements (0: after every step)

    def __post_init__(self) -> None:
        _non_negative("checkpoint.every_steps", self.every_steps)
        _positive("checkpoint.keep", self.keep)
        _non_negative("checkpoint.max_requeues", self.max_requeues)
        _choice("checkpoint.signal", self.signal, SIGNALS)
        _positive("checkpoint.signal_lead_s", self.signal_lead_s)
        if not 0 <= self.poll_s <= 60:
            raise ValidationError(
                f"checkpoint.poll_s={self.poll_s} is outside 0-60 s (a stop is acted on within about twice this)",
                hint="keep the default 0.5, or 0 to agree after every step",
            )
        if self.signal_lead_s > 65535:
            raise ValidationError(
                f"checkpoint.signal_lead_s={self.signal_lead_s} exceeds Slurm's limit of 65535 s",
                hint="use a lead time of a few minutes, e.g. 300",
            )


@dataclass(frozen=True)
class ScriptConfig:
    """The user's own training program, run on every rank instead of the built-in trainer.

    Exactly one of ``path`` (a ``.py`` file; absolute once resolved) and ``module`` (run as
    ``python -m MODULE``). ``args`` may hold the placeholders of :data:`SCRIPT_PLACEHOLDERS`
    (filled per job by :func:`fill_script_args`). ``batch_size`` is the per-device batch the
    script trains with, when known (records, sweeps, ``{per_device_batch_size}``); 0: not told.
    ``sha256`` is the content hash of the script file recorded at submission.
    """

    path: str = ""
    module: str = ""
    args: tuple[str, ...] = ()
    batch_size: int = 0
    sha256: str = ""

    def __post_init__(self) -> None:
        if bool(self.path) == bool(self.module):
            raise ValidationError(
                "[script] needs exactly one of path and module",
                hint='write path = "train.py" (a file) or module = "pkg.train" (python -m), not both',
            )
        if self.module and not all(part.isidentifier() for part in self.module.split(".")):
            raise ValidationError(f"script.module {self.module!r} is not a dotted module name",
                                  hint='e.g. module = "mypkg.train"')
        if self.path and ("\n" in self.path or "\0" in self.path):
            raise ValidationError(f"script.path {self.path!r} contains a line break or NUL",
                                  hint="rename the file or give another path")
        for arg in self.args:
            if "\0" in arg:
                raise ValidationError(f"script argument {arg!r} contains NUL", hint="remove it")
        _non_negative("script.batch_size", self.batch_size)
        if self.sha256 and (len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256)):
            raise ValidationError(f"script.sha256 {self.sha256!r} is not a SHA-256 hex digest",
                                  hint="drop it: cyclone_kit records the hash itself")

    @property
    def label(self) -> str:
        """The script's file name, or ``-m MODULE``."""
        return Path(self.path).name if self.path else f"-m {self.module}"


#: Placeholders a script's args may use (filled per job; strong sweeps: per-device = global / N).
SCRIPT_PLACEHOLDERS = ("per_device_batch_size", "global_batch_size", "world_size", "num_nodes")


def fill_script_args(args: typing.Iterable[str], values: typing.Mapping[str, int]) -> tuple[str, ...]:
    """Replace ``{world_size}`` & co. (:data:`SCRIPT_PLACEHOLDERS`) in ``args`` (pure).

    Other braces are left alone (JSON in an argument stays intact).

    Raises:
        ValidationError: a placeholder is used but its value is unknown (0), e.g.
            ``{per_device_batch_size}`` without ``script.batch_size`` or a sweep.
    """
    import re

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


@dataclass(frozen=True)
class JobSpec:
    """A whole job: its name plus the train (or script), resources and checkpoint sections.

    A job runs either the built-in trainer (``train``) or the user's own program (``script``,
    not None); ``train`` keeps its defaults and is unused in the second case.
    """

    name: str = "cyclone"
    train: TrainConfig = field(default_factory=TrainConfig)
    resources: Resources = field(default_factory=Resources)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    script: ScriptConfig | None = None

    def __post_init__(self) -> None:
        validate_name(self.name)

    @property
    def per_device_batch_size(self) -> int:
        """The per-device batch: ``train.batch_size``, or ``script.batch_size`` (0 when not told)."""
        return self.script.batch_size if self.script is not None else self.train.batch_size


SECTIONS: dict[str, type] = {"train": TrainConfig, "resources": Resources, "checkpoint": CheckpointConfig}
#: Sections a spec may leave out entirely (None then).
OPTIONAL_SECTIONS: dict[str, type] = {"script": ScriptConfig}


def validate_name(name: str) -> None:
    """Job names become file names and ``--job-name``: letters, digits, ``._+-`` only."""
    ok = isinstance(name, str) and 0 < len(name) <= 64 and all(c.isascii() and (c.isalnum() or c in "._+-") for c in name)
    if not ok or name.startswith((".", "-")):
        raise ValidationError(
            f"job name {name!r} is not allowed",
            hint="use 1-64 ASCII letters, digits, '.', '_', '+' or '-', not starting with '.' or '-'",
        )


def spec_from_dict(data: dict[str, Any]) -> JobSpec:
    """Build a JobSpec from a nested dict (a parsed TOML file); unknown keys are errors."""
    if not isinstance(data, dict):
        raise ValidationError("a job spec must be a table", hint="see jobs/smoke.toml")
    unknown = set(data) - {"name", *SECTIONS, *OPTIONAL_SECTIONS}
    if unknown:
        raise ValidationError(
            f"unknown job spec key(s): {', '.join(sorted(unknown))}",
            hint=did_you_mean(sorted(unknown), ["name", *SECTIONS, *OPTIONAL_SECTIONS])
            + f"valid top-level keys: name, {', '.join([*SECTIONS, *OPTIONAL_SECTIONS])}",
        )
    kwargs: dict[str, Any] = {}
    if "script" in data:
        if "train" in data:
            raise ValidationError(
                "the job spec has both [train] and [script]",
                hint="[script] runs your own program instead of the built-in trainer: keep one of the two",
            )
        if not isinstance(data["script"], dict):
            raise ValidationError("job spec key 'script' must be a table", hint='write [script] then path = "train.py"')
        kwargs["script"] = _build(ScriptConfig, "script", data["script"])
    for section, cls in SECTIONS.items():
        sdata = data.get(section, {})
        if not isinstance(sdata, dict):
            raise ValidationError(f"job spec key {section!r} must be a table", hint=f"write [{section}]")
        kwargs[section] = _build(cls, section, sdata)
    if "name" in data:
        if not isinstance(data["name"], str):
            raise ValidationError(f"job spec name must be a string, got {data['name']!r}", hint='name = "my-job"')
        kwargs["name"] = data["name"]
    return JobSpec(**kwargs)


def spec_to_dict(spec: JobSpec) -> dict[str, Any]:
    """The inverse of :func:`spec_from_dict` (JSON-serialisable; None values kept)."""
    out = dataclasses.asdict(spec)
    out["resources"]["extra_sbatch"] = list(spec.resources.extra_sbatch)
    if spec.script is None:
        del out["script"]
    else:
        del out["train"]  # unused: the script trains
        out["script"]["args"] = list(spec.script.args)
    return out


def load_spec(path: str | Path) -> JobSpec:
    """Read a job spec TOML (or a resolved ``spec.json``) file."""
    p = Path(path)
    if p.suffix == ".json":
        import json

        try:
            return spec_from_dict(json.loads(_read_text(p)))
        except ValueError as e:
            raise ValidationError(f"{p}: not valid JSON ({e})", hint="regenerate it with cyclone_kit submit") from None
    return spec_from_dict(read_toml(p))


def apply_overrides(data: dict[str, Any], assignments: typing.Iterable[str]) -> dict[str, Any]:
    """Apply ``--set key=value`` strings to a spec dict (pure; returns a new dict).

    ``key`` is ``section.field`` (``train.lr``) or a field name that is unique across sections
    (``lr``); ``value`` is a TOML literal (``0.1``, ``true``, ``"text"``, ``[1, 2]``) or else a
    bare string.
    """
    return set_fields(data, [parse_assignment(item) for item in assignments])


def set_fields(data: dict[str, Any], pairs: typing.Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """Set ``(key, value)`` pairs on a spec dict (pure; keys as in :func:`apply_overrides`)."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    for key, value in pairs:
        section, fname = resolve_key(key)
        if section is None:
            out[fname] = value
        else:
            current = out.get(section, {})
            if not isinstance(current, dict):
                raise ValidationError(f"job spec key {section!r} must be a table", hint=f"write [{section}]")
            out[section] = {**current, fname: value}
    return out


def reject_empty_strings(data: Any, source: str, where: str = "") -> None:
    """Refuse an empty (or blank) string anywhere in a user's spec file: leave a key out instead.

    An empty value is what an unset shell variable or a half-edited file gives; taking it as "not
    given" would silently submit something else than asked (e.g. the default partition).
    """
    if isinstance(data, dict):
        for key, value in data.items():
            reject_empty_strings(value, source, f"{where}.{key}" if where else str(key))
    elif isinstance(data, list | tuple):
        for value in data:
            reject_empty_strings(value, source, where)
    elif isinstance(data, str) and not data.strip():
        raise ValidationError(
            f"{where} is empty in {source}",
            hint=f"remove the {where.rsplit('.', 1)[-1]} line to use the default, or give it a value",
        )


def parse_mem_mb(text: str) -> int:
    """Slurm's ``--mem`` value (a count with an optional K, M, G or T suffix; M by default) in MiB."""
    match = re.fullmatch(r"(\d+)([KMGT]?)B?", text.strip().upper())
    if not match or int(match.group(1)) == 0:
        raise ValidationError(
            f"resources.mem {text!r} is not a memory size Slurm accepts",
            hint="write it as a positive count with a unit, e.g. '32G' or '16000M'",
        )
    factor = {"K": 1 / 1024, "": 1, "M": 1, "G": 1024, "T": 1024 * 1024}[match.group(2)]
    return max(1, int(int(match.group(1)) * factor))


def parse_assignment(item: str) -> tuple[str, Any]:
    """Split ``key=value`` and parse the value as a TOML literal (else keep the string)."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValidationError(f"--set {item!r} is not key=value", hint="write --set train.lr=0.2")
    if not raw.strip() or raw.strip() in ('""', "''"):
        raise ValidationError(
            f"--set {key}= has an empty value (an unset shell variable?)",
            hint=f"give {key} a value, or leave the --set out to keep the spec's",
        )
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    if isinstance(value, datetime.date | datetime.time):
        value = raw.strip()  # 01:00:00 is a wall time, not a TOML time of day
    return key, value


def resolve_key(key: str) -> tuple[str | None, str]:
    """Map a ``--set`` key to (section, field); raises with the valid keys listed."""
    if key == "name":
        return None, "name"
    section, dot, fname = key.partition(".")
    if dot:
        cls = SECTIONS.get(section) or OPTIONAL_SECTIONS.get(section)
        if cls is not None and fname in _field_names(cls):
            return section, fname
    else:
        owners = [s for s, cls in SECTIONS.items() if key in _field_names(cls)]
        if len(owners) == 1:
            return owners[0], key
    valid = ["name"] + [f"{s}.{f}" for s, cls in {**SECTIONS, **OPTIONAL_SECTIONS}.items() for f in _field_names(cls)]
    short = [f for cls in SECTIONS.values() for f in _field_names(cls)] if not dot else []
    raise ValidationError(f"unknown spec key {key!r}",
                          hint=did_you_mean([key], valid + short) + f"valid keys: {', '.join(valid)}")


# --------------------------------------------------------------------------- TOML edge
def read_toml(path: Path) -> dict[str, Any]:
    """Read a TOML file, turning every failure into a one-line ValidationError."""
    text = _read_text(path)
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValidationError(f"{path}: malformed TOML ({e})", hint="fix the syntax at the position shown") from None


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValidationError(f"file {str(path)!r} does not exist", hint="check the path") from None
    except IsADirectoryError:
        raise ValidationError(f"{str(path)!r} is a directory, not a file", hint="give the path of a .toml file") from None
    except PermissionError:
        raise ValidationError(f"cannot read {str(path)!r}: permission denied", hint="check the file's permissions") from None
    except UnicodeDecodeError:
        raise ValidationError(f"{str(path)!r} is not UTF-8 text", hint="save the file as UTF-8") from None


# --------------------------------------------------------------------------- helpers
def did_you_mean(unknown: typing.Sequence[str], valid: typing.Sequence[str]) -> str:
    """``"did you mean train.lr (not train.lrr)? "`` for the first unknown key with a close valid one, else ``""``."""
    import difflib

    for key in unknown:
        close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
        if close:
            return f"did you mean {close[0]} (not {key})? "
    return ""


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _build(cls: type, where: str, data: dict[str, Any]) -> Any:
    """Construct a frozen dataclass from a dict, checking unknown keys and value types."""
    names = _field_names(cls)
    unknown = set(data) - set(names)
    if unknown:
        valid = [n for n in names if not (where == "partitions" and n == "name")]
        raise ValidationError(
            f"unknown key(s) in [{where}]: {', '.join(sorted(unknown))}",
            hint=did_you_mean(sorted(unknown), valid) + f"valid keys: {', '.join(valid)}",
        )
    hints = typing.get_type_hints(cls)
    kwargs = {k: _coerce(f"{where}.{k}", hints[k], v) for k, v in data.items()}
    return cls(**kwargs)


def _coerce(where: str, hint: Any, value: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        return _coerce(where, args[0], value)
    if origin is tuple:
        if isinstance(value, list | tuple):
            item = typing.get_args(hint)[0]
            if item is str and all(isinstance(v, str) for v in value):
                return tuple(value)
            if item is not str:
                return tuple(value)
        raise ValidationError(f"{where} must be a list of strings, got {value!r}", hint=f'write {where.split(".")[-1]} = ["..."]')
    if hint is str and isinstance(value, datetime.time):
        value = value.isoformat()  # an unquoted `time = 01:00:00` in TOML
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, int | float) and not isinstance(value, bool),
        str: isinstance(value, str),
    }.get(hint, True)
    if not ok:
        example = {bool: "true", int: "4", float: "0.1", str: '"text"'}.get(hint, "")
        raise ValidationError(
            f"{where} must be {getattr(hint, '__name__', hint)}, got {type(value).__name__} {value!r}",
            hint=f"e.g. {where.split('.')[-1]} = {example}",
        )
    return float(value) if hint is float else value


def _positive(where: str, value: int) -> None:
    if value < 1:
        raise ValidationError(f"{where} must be at least 1, got {value}", hint=f"set {where} to a positive count")


def _non_negative(where: str, value: int) -> None:
    if value < 0:
        raise ValidationError(f"{where} must not be negative, got {value}", hint=f"set {where} to 0 or more")


def _choice(where: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValidationError(f"unknown {where} {value!r}", hint=f"use one of: {', '.join(valid)}")


def _check_directives(where: str, directives: tuple[str, ...]) -> None:
    for directive in directives:
        if not directive.startswith("--") or not directive.isprintable():
            raise ValidationError(
                f"{where} entry {directive!r} is not one '--option=value'",
                hint="write each extra #SBATCH directive as '--option=value' on one line",
            )


def _safe_token(where: str, value: str) -> None:
    if value and not all(c.isascii() and (c.isalnum() or c in "._+-:") for c in value):
        raise ValidationError(
            f"{where} {value!r} contains characters Slurm does not accept here",
            hint="use ASCII letters, digits, '.', '_', '+', '-' or ':'",
        )
