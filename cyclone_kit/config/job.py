"""Job specs: typed, frozen descriptions of one run (``[train]``/``[script]``, ``[resources]``, ``[checkpoint]``).

Dicts exist only at the edge (TOML files, ``--set`` flags); everything past :func:`spec_from_dict`
is a frozen dataclass validated on construction. Cross-checks against a cluster profile live in
:mod:`cyclone_kit.config.validate`.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cyclone_kit.config.container import ContainerConfig
from cyclone_kit.config.toolbox import (
    build,
    check_choice,
    check_directives,
    check_non_negative,
    check_positive,
    check_safe_token,
    field_names,
    parse_assignment,
    read_text,
    read_toml,
)
from cyclone_kit.core.errors import ValidationError, did_you_mean
from cyclone_kit.launchers import DEFAULT, selectable_names
from cyclone_kit.slurm.memory import parse_mem_mb
from cyclone_kit.slurm.walltime import parse_time

#: Models the runtime can build (cyclone_kit.runtime.engine.models implements every one).
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


#: Pipeline schedules (torch.distributed.pipelining's GPipe, 1F1B, interleaved 1F1B).
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


#: The launchers a job may name (from the registry, :mod:`cyclone_kit.launchers`).
LAUNCHERS = selectable_names()


SIGNALS = ("USR1", "USR2", "TERM", "INT", "HUP", "URG")


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
    static_graph: bool = True  # DDP's static graph where valid (runtime/engine/dataparallel.py use_static_graph)
    num_workers: int = -1
    pg_timeout_s: int = 600  # PyTorch's NCCL default: rank 0 may write or load a large checkpoint meanwhile
    microbatches: int = 4
    pipeline_stages: int = 0  # ranks per pipeline (0: all); world / pipeline_stages data-parallel replicas
    pipeline_schedule: str = "gpipe"
    fp16_allreduce: bool = False
    max_nonfinite_steps: int = 0  # stop after this many consecutive steps with a NaN/inf loss (0: never)
    allow_nonfinite_params: bool = False  # train on when a parameter holds NaN/inf (checked every log_every steps)

    def __post_init__(self) -> None:
        check_choice("train.model", self.model, MODELS)
        check_choice("train.dataset", self.dataset, DATASETS)
        check_choice("train.precision", self.precision, PRECISIONS)
        check_choice("train.strategy", self.strategy, STRATEGIES)
        check_choice("train.lr_scaling", self.lr_scaling, ("linear", "sqrt", "none"))
        check_choice("train.pipeline_schedule", self.pipeline_schedule, PIPELINE_SCHEDULES)
        for name in ("image_size", "num_classes", "batch_size", "base_batch_size", "grad_accum", "log_every",
                     "bucket_cap_mb", "pg_timeout_s", "microbatches", "synthetic_samples"):
            check_positive(f"train.{name}", getattr(self, name))
        for name in ("steps", "epochs", "warmup_steps", "val_every_epochs", "val_samples", "seed", "pipeline_stages",
                     "max_nonfinite_steps"):
            check_non_negative(f"train.{name}", getattr(self, name))
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
    launcher: str = DEFAULT.name
    mem: str = ""
    extra_sbatch: tuple[str, ...] = ()
    spare_nodes: int | None = None  # nodes allocated beside `nodes` for in-job restarts (None: the profile's)
    min_nodes: int = 0  # the step may shrink to this many nodes after a lost node (0: never below `nodes`)

    def __post_init__(self) -> None:
        check_positive("resources.nodes", self.nodes)
        if self.spare_nodes is not None:
            check_non_negative("resources.spare_nodes", self.spare_nodes)
        check_non_negative("resources.min_nodes", self.min_nodes)
        if self.min_nodes > self.nodes:
            raise ValidationError(f"--min-nodes={self.min_nodes} is more than --nodes={self.nodes}",
                                  hint=f"use --min-nodes between 1 and {self.nodes} (0: never shrink)")
        for name in ("gpus_per_node",):
            if getattr(self, name) is not None:
                check_non_negative(f"resources.{name}", getattr(self, name))
        for name in ("ntasks_per_node", "cpus_per_task"):
            if getattr(self, name) is not None:
                check_positive(f"resources.{name}", getattr(self, name))
        parse_time(self.time)
        check_choice("resources.launcher", self.launcher, LAUNCHERS)
        check_safe_token("resources.account", self.account)
        if self.mem:
            parse_mem_mb(self.mem)
        check_directives("resources.extra_sbatch", self.extra_sbatch)


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpointing and wall-time requeue: how often, how many, which signal, how early."""

    every_steps: int = 0
    keep: int = 2
    resume: bool = True
    requeue: bool = True
    max_requeues: int = 3
    max_restarts: int = 3  # in-job restarts on spare or fewer nodes before falling back to a requeue
    signal: str = "USR2"
    signal_lead_s: int = 120
    sharded: bool = False
    poll_s: float = 0.5  # seconds between the ranks' stop-flag agreements (0: after every step)
    stall_floor_s: float = 60.0  # a rank with no step for max(this, stall_factor x median step) is stalled (0: off)
    stall_factor: float = 20.0
    async_write: bool = True  # rank 0 copies the state to host memory at the step, writes it in a background thread
    local_dir: str = ""  # a node-local folder (/dev/shm/..., the local disk) written first, then copied into the run

    def __post_init__(self) -> None:
        check_non_negative("checkpoint.every_steps", self.every_steps)
        if self.local_dir and not self.local_dir.startswith("/"):
            raise ValidationError(f"checkpoint.local_dir={self.local_dir!r} is not an absolute path",
                                  hint='use a node-local folder such as local_dir = "/dev/shm/ck" or "" (none)')
        if self.stall_floor_s < 0 or self.stall_factor < 1:
            raise ValidationError(
                f"checkpoint.stall_floor_s={self.stall_floor_s}, stall_factor={self.stall_factor}: a rank is "
                "stalled after max(floor, factor x median step) without a step",
                hint="keep the defaults 60 and 20 (stall_floor_s = 0 turns the progress watchdog off; factor >= 1)",
            )
        check_positive("checkpoint.keep", self.keep)
        check_non_negative("checkpoint.max_requeues", self.max_requeues)
        check_non_negative("checkpoint.max_restarts", self.max_restarts)
        check_choice("checkpoint.signal", self.signal, SIGNALS)
        check_positive("checkpoint.signal_lead_s", self.signal_lead_s)
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


#: What a script's ranks see of torchrun's variables (``script.dist_env``, ``--dist-env``).
DIST_ENV_CHOICES = ("auto", "torchrun")


@dataclass(frozen=True)
class ScriptConfig:
    """The user's own training program, run on every rank instead of the built-in trainer.

    Exactly one of ``path`` (a ``.py`` file; absolute once resolved) and ``module`` (run as
    ``python -m MODULE``). ``args`` may hold the placeholders of :data:`SCRIPT_PLACEHOLDERS`
    (filled per job by :func:`cyclone_kit.config.script.fill_script_args`). ``batch_size`` is the
    per-device batch the script trains with, when known (records, sweeps, ``{per_device_batch_size}``);
    0: not told.
    ``sha256`` is the content hash of the script file recorded at submission.
    ``chdir`` is the job's working directory (absolute once resolved; default: the folder
    ``submit`` ran in, as ``sbatch`` does), so the script's relative paths (``./data``,
    ``./ckpt.pt``) mean what they mean where it was submitted. ``live`` runs the script file
    itself on every segment instead of the run directory's snapshot of it (taken at submission).
    ``samples_per_run`` is how many samples one run of the script processes (time-to-solution
    reports: cost per sample); 0: not told.
    ``dist_env`` is what a rank sees of torchrun's variables (:data:`DIST_ENV_CHOICES`): ``auto``
    gives them to every rank of a world of two or more and none to a world of one (as ``python
    SCRIPT``), ``torchrun`` gives them to every rank, a world of one too (as ``torchrun --nproc 1``).
    """

    path: str = ""
    module: str = ""
    args: tuple[str, ...] = ()
    batch_size: int = 0
    sha256: str = ""
    chdir: str = ""
    live: bool = False
    samples_per_run: int = 0
    dist_env: str = "auto"

    def __post_init__(self) -> None:
        if self.dist_env not in DIST_ENV_CHOICES:
            raise ValidationError(f"script.dist_env {self.dist_env!r} is not one of {', '.join(DIST_ENV_CHOICES)}",
                                  hint='dist_env = "auto" (a world of one runs as python SCRIPT) or "torchrun" '
                                       "(every rank gets RANK, WORLD_SIZE, LOCAL_RANK ..., a world of one too)")
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
        check_non_negative("script.batch_size", self.batch_size)
        check_non_negative("script.samples_per_run", self.samples_per_run)
        if "\n" in self.chdir or "\0" in self.chdir:
            raise ValidationError(f"script.chdir {self.chdir!r} contains a line break or NUL",
                                  hint="give another working directory")
        if self.sha256 and (len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256)):
            raise ValidationError(f"script.sha256 {self.sha256!r} is not a SHA-256 hex digest",
                                  hint="drop it: cyclone_kit records the hash itself")

    @property
    def label(self) -> str:
        """The script's file name, or ``-m MODULE``."""
        return Path(self.path).name if self.path else f"-m {self.module}"


#: Placeholders a script's args may use (filled per job; strong sweeps: per-device = global / N).
SCRIPT_PLACEHOLDERS = ("per_device_batch_size", "global_batch_size", "world_size", "num_nodes")


@dataclass(frozen=True)
class JobSpec:
    """A whole job: its name plus the train (or script), resources and checkpoint sections.

    A job runs either the built-in trainer (``train``) or the user's own program (``script``,
    not None); ``train`` keeps its defaults and is unused in the second case. ``container`` (not
    None): its ranks run inside a container image (:mod:`cyclone_kit.config.container`).
    """

    name: str = "cyclone"
    train: TrainConfig = field(default_factory=TrainConfig)
    resources: Resources = field(default_factory=Resources)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    script: ScriptConfig | None = None
    container: ContainerConfig | None = None

    def __post_init__(self) -> None:
        validate_name(self.name)

    @property
    def per_device_batch_size(self) -> int:
        """The per-device batch: ``train.batch_size``, or ``script.batch_size`` (0 when not told)."""
        return self.script.batch_size if self.script is not None else self.train.batch_size


SECTIONS: dict[str, type] = {"train": TrainConfig, "resources": Resources, "checkpoint": CheckpointConfig}


#: Sections a spec may leave out entirely (None then).
OPTIONAL_SECTIONS: dict[str, type] = {"script": ScriptConfig, "container": ContainerConfig}


def validate_name(name: str) -> None:
    """Job names become file names and ``--job-name``: letters, digits, ``._+-`` only."""
    ok = isinstance(name, str) and 0 < len(name) <= 64 and all(c.isascii() and (c.isalnum() or c in "._+-") for c in name)
    if not ok or name.startswith((".", "-")):
        raise ValidationError(
            f"job name {name!r} is not allowed",
            hint="use 1-64 ASCII letters, digits, '.', '_', '+' or '-', not starting with '.' or '-'",
        )


def job_name_for(script: ScriptConfig) -> str:
    """A valid job name from the script's file or module name (``plain_ddp``; pure)."""
    stem = Path(script.path).stem if script.path else script.module.rsplit(".", 1)[-1]
    name = re.sub(r"[^A-Za-z0-9._+-]", "-", stem).lstrip(".-")[:64]
    return name or "script"


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
        kwargs["script"] = build(ScriptConfig, "script", data["script"])
    if data.get("container") is not None:
        if not isinstance(data["container"], dict):
            raise ValidationError("job spec key 'container' must be a table",
                                  hint='write [container] then image = "/path/to/image"')
        kwargs["container"] = build(ContainerConfig, "container", data["container"])
    for section, cls in SECTIONS.items():
        sdata = data.get(section, {})
        if not isinstance(sdata, dict):
            raise ValidationError(f"job spec key {section!r} must be a table", hint=f"write [{section}]")
        kwargs[section] = build(cls, section, sdata)
    if "name" in data:
        if not isinstance(data["name"], str):
            raise ValidationError(f"job spec name must be a string, got {data['name']!r}", hint='name = "my-job"')
        kwargs["name"] = data["name"]
    return JobSpec(**kwargs)


def spec_to_dict(spec: JobSpec) -> dict[str, Any]:
    """The inverse of :func:`spec_from_dict` (JSON-serialisable; None values kept)."""
    out = dataclasses.asdict(spec)
    out["resources"]["extra_sbatch"] = list(spec.resources.extra_sbatch)
    if spec.container is None:
        del out["container"]
    else:
        out["container"] = {k: list(v) if isinstance(v, tuple) else v for k, v in out["container"].items()}
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
            return spec_from_dict(json.loads(read_text(p)))
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


def resolve_key(key: str) -> tuple[str | None, str]:
    """Map a ``--set`` key to (section, field); raises with the valid keys listed."""
    if key == "name":
        return None, "name"
    section, dot, fname = key.partition(".")
    if dot:
        cls = SECTIONS.get(section) or OPTIONAL_SECTIONS.get(section)
        if cls is not None and fname in field_names(cls):
            return section, fname
    else:
        owners = [s for s, cls in SECTIONS.items() if key in field_names(cls)]
        if len(owners) == 1:
            return owners[0], key
    valid = ["name"] + [f"{s}.{f}" for s, cls in {**SECTIONS, **OPTIONAL_SECTIONS}.items() for f in field_names(cls)]
    short = [f for cls in SECTIONS.values() for f in field_names(cls)] if not dot else []
    raise ValidationError(f"unknown spec key {key!r}",
                          hint=did_you_mean([key], valid + short) + f"valid keys: {', '.join(valid)}")
