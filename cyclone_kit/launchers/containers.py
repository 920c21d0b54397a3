"""Container runtimes as command wrappers of the launcher registry (pure).

A container runtime wraps a rank's command (:class:`~cyclone_kit.launchers.registry.CommandWrapper`):
the launcher's rules stay its own, only the rank's command runs inside the image. Three runtimes:

* ``charliecloud``: ``ch-run -b SRC:DST ... --set-env=K=V ... IMAGE -- CMD`` (a directory image or a
  SquashFS file). ch-run 0.31 binds only onto folders the image already has and cannot create one in
  a read-only image, so each path a job needs is bound by its top-level folder (``/tmp``, ``/work``,
  ``/scratch``); :func:`charliecloud_mount_points` names them, and the login side checks the image
  has them. ch-run needs ``$USER`` set (the batch script sets it when empty).
* ``apptainer`` (or Singularity's ``singularity``, the same words): ``apptainer exec [--nv] --bind
  SRC:DST ... IMAGE CMD`` (a ``.sif`` file, a sandbox folder, or a ``docker://`` reference); it makes
  its own mount points, so each path is bound as it is.
* ``pyxis`` (Enroot through Slurm's Pyxis plugin): no words before the command; ``srun`` itself takes
  ``--container-image=IMAGE --container-mounts=SRC:DST,...`` (a ``.sqsh`` file or a registry
  reference such as ``nvcr.io#nvidia/pytorch:24.05-py3``).

The ranks' own variables (:func:`rank_env`: the runtime's name, and requeue through the step watcher, as the image has no
``scontrol``) are passed as each runtime requires: ``--set-env`` (ch-run), ``--env`` (apptainer),
srun's ``--export=ALL,...`` (pyxis); the rest of the job's environment (Slurm's, ``PYTHONPATH`` to
the job's own virtual environment, exported by the batch script) passes through as it is.
Every path is bound at the same path inside, so the rank side is the same in the container as
outside: the run directory, the shim, the script's snapshot, signals (ch-run and the srun task exec
the command; apptainer's starter forwards signals) and requeue.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Protocol

from cyclone_kit.core.errors import ValidationError

#: A container has no ``scontrol``: its ranks ask the step watcher, outside, to requeue the job
#: (:func:`cyclone_kit.runtime.signals.requeue`); every runtime passes this variable to the ranks only.
REQUEUE_BY_VARIABLE = "CYCLONE_REQUEUE_BY"
REQUEUE_BY_STEPWATCH = "stepwatch"
#: The runtime a rank runs in, as its runtime passed it (doctor's probe reports it: the rank really ran inside).
CONTAINER_VARIABLE = "CYCLONE_CONTAINER"


def rank_env(runtime: str) -> tuple[tuple[str, str], ...]:
    """The variables every runtime passes to a container job's ranks only (pure)."""
    return ((REQUEUE_BY_VARIABLE, REQUEUE_BY_STEPWATCH), (CONTAINER_VARIABLE, runtime))

#: Top-level folders of an image that a bind must never cover (the image's own system).
SYSTEM_FOLDERS = frozenset({"/", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/usr", "/etc", "/proc", "/sys", "/dev",
                            "/boot", "/run"})


@dataclass(frozen=True)
class Bind:
    """One bind mount: host ``source`` at ``target`` inside the container."""

    source: str
    target: str

    @property
    def spec(self) -> str:
        """``SRC:DST`` (or ``SRC`` when both are the same), as the runtimes write a bind."""
        return self.source if self.source == self.target else f"{self.source}:{self.target}"


def parse_bind(text: str) -> Bind:
    """A bind written ``SRC`` or ``SRC:DST`` (absolute paths; pure).

    Raises:
        ValidationError: a relative path, an empty part, or more than one ``:``.
    """
    parts = text.split(":")
    if len(parts) > 2 or not all(parts) or not all(p.startswith("/") for p in parts):
        raise ValidationError(f"container bind {text!r} is not SRC or SRC:DST with absolute paths",
                              hint='write binds = ["/data"] or ["/host/data:/data"] (no other ":" in a path)')
    return Bind(parts[0], parts[-1])


def outermost(paths: Iterable[str]) -> tuple[str, ...]:
    """``paths`` normalised, without duplicates and without any path inside another one (order kept; pure)."""
    norm = [str(PurePosixPath(p)) for p in paths if p]
    out: list[str] = []
    for p in norm:
        if p in out or any(PurePosixPath(p).is_relative_to(q) for q in norm if q != p):
            continue
        out.append(p)
    return tuple(out)


def top_folder(path: str) -> str:
    """The top-level folder of an absolute ``path`` (``/work/main/.venv`` -> ``/work``; pure)."""
    parts = PurePosixPath(path).parts
    return "/" + parts[1] if len(parts) > 1 else "/"


def charliecloud_mount_points(paths: Iterable[str]) -> tuple[str, ...]:
    """The folders ch-run binds for ``paths``: each one's top-level folder, once (pure).

    Raises:
        ValidationError: a path lies in one of the image's own system folders (``/usr`` ...), which a
            bind would cover.
    """
    tops = []
    for p in paths:
        top = top_folder(p)
        if top in SYSTEM_FOLDERS:
            raise ValidationError(
                f"{p} would be bound into a Charliecloud container by its top-level folder {top}, "
                "which would cover the image's own",
                hint="keep the job's paths (run directory, data, virtual environment) outside "
                     f"{', '.join(sorted(SYSTEM_FOLDERS - {'/'}))}, e.g. under /scratch or $HOME",
            )
        if top not in tops:
            tops.append(top)
    return tuple(tops)


def _no_separators(runtime: str, paths: Iterable[str], seps: str) -> None:
    for p in paths:
        bad = [c for c in seps if c in p]
        if bad:
            raise ValidationError(f"path {p!r} holds {bad[0]!r}, which {runtime}'s bind list cannot carry",
                                  hint="rename the folder, or bind a parent folder of it")


class ContainerRuntime(Protocol):
    """A container runtime as the registry's command wrapper, plus what the batch script gives srun."""

    @property
    def name(self) -> str:
        """The runtime's name (``charliecloud``, ``apptainer``, ``pyxis``)."""
        ...

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside the container."""
        ...

    def srun_options(self) -> tuple[str, ...]:
        """Options of the job's ``srun`` (pyxis's ``--container-image`` ...); none for the others."""
        ...


@dataclass(frozen=True)
class Charliecloud:
    """``ch-run``: every bind by its top-level folder (see the module's note), the environment by ``--set-env``,
    the working folder by ``--cd`` (ch-run starts in ``/`` otherwise, not in the folder it was started in)."""

    image: str
    binds: tuple[Bind, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    cwd: str = ""
    name: str = "charliecloud"

    def __post_init__(self) -> None:
        _no_separators("ch-run", [p for b in self.binds for p in (b.source, b.target)], ":")

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """``ch-run -b DIR ... --set-env=K=V ... [--cd=DIR] IMAGE -- argv``."""
        words = ["ch-run"]
        for b in self.binds:
            words += ["-b", b.spec]
        words += [f"--set-env={k}={v}" for k, v in self.env]
        if self.cwd:
            words.append(f"--cd={self.cwd}")
        return [*words, self.image, "--", *argv]

    def srun_options(self) -> tuple[str, ...]:
        """None."""
        return ()


@dataclass(frozen=True)
class Apptainer:
    """``apptainer exec [--nv] --bind SRC:DST ... --env K=V ... IMAGE argv`` (``binary``: ``singularity`` too)."""

    image: str
    binds: tuple[Bind, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    gpus: bool = False
    binary: str = "apptainer"
    name: str = "apptainer"

    def __post_init__(self) -> None:
        _no_separators("apptainer", [p for b in self.binds for p in (b.source, b.target)], ":,")

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """The command inside the image; ``--nv`` on GPU nodes (the host's driver and devices)."""
        words = [self.binary, "exec"]
        if self.gpus:
            words.append("--nv")
        for b in self.binds:
            words += ["--bind", b.spec]
        for k, v in self.env:
            words += ["--env", f"{k}={v}"]
        return [*words, self.image, *argv]

    def srun_options(self) -> tuple[str, ...]:
        """None."""
        return ()


@dataclass(frozen=True)
class Pyxis:
    """Enroot by Slurm's Pyxis plugin: srun's ``--container-image``/``--container-mounts``; the command as it is."""

    image: str
    binds: tuple[Bind, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    name: str = "pyxis"

    def __post_init__(self) -> None:
        _no_separators("pyxis", [p for b in self.binds for p in (b.source, b.target)], ":,")
        _no_separators("srun --export", [v for _, v in self.env], ",")

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """``argv`` itself: srun's options put it in the container."""
        return list(argv)

    def srun_options(self) -> tuple[str, ...]:
        """``--container-image=IMAGE``, ``--container-mounts=SRC:DST,...``, ``--no-container-mount-home`` and
        ``--export=ALL,K=V,...`` for the ranks' own variables."""
        opts = [f"--container-image={self.image}"]
        if self.binds:
            opts.append("--container-mounts=" + ",".join(f"{b.source}:{b.target}" for b in self.binds))
        opts.append("--no-container-mount-home")
        if self.env:
            opts.append("--export=" + ",".join(["ALL", *(f"{k}={v}" for k, v in self.env)]))
        return tuple(opts)


@dataclass(frozen=True)
class RuntimeInfo:
    """What the login side checks of a runtime: its binary and the images it takes."""

    name: str
    binary: str
    #: image forms: "dir" (a folder), or file suffixes such as ".sif"
    image_forms: tuple[str, ...]
    #: prefixes (or a mark) of an image fetched from a registry, which no file check applies to
    remote_marks: tuple[str, ...]
    #: how to see that the compute nodes have it
    node_check: str
    #: whether it can run ranks on this machine (the local backend); Pyxis needs srun
    local: bool = True


RUNTIMES: dict[str, RuntimeInfo] = {
    "charliecloud": RuntimeInfo("charliecloud", "ch-run", ("dir", ".sqfs", ".squashfs"), (),
                                "srun -N1 -p PARTITION which ch-run"),
    "apptainer": RuntimeInfo("apptainer", "apptainer", ("dir", ".sif", ".simg"),
                             ("docker://", "oras://", "library://", "shub://"), "srun -N1 -p PARTITION apptainer --version"),
    "singularity": RuntimeInfo("singularity", "singularity", ("dir", ".sif", ".simg"),
                               ("docker://", "oras://", "library://", "shub://"),
                               "srun -N1 -p PARTITION singularity --version"),
    "pyxis": RuntimeInfo("pyxis", "srun", (".sqsh", ".squashfs"), ("#", "docker://"),
                         "srun -N1 -p PARTITION --help | grep container-image", local=False),
}


def runtime_names() -> tuple[str, ...]:
    """The runtimes a ``[container]`` table may name."""
    return tuple(RUNTIMES)


def is_remote(runtime: str, image: str) -> bool:
    """Whether ``image`` is fetched by the runtime from a registry (no file to check; pure)."""
    info = RUNTIMES[runtime]
    if any(mark in image for mark in info.remote_marks):
        return True
    return runtime == "pyxis" and not image.startswith(("/", "./", "../"))


def image_form_error(runtime: str, image: str, *, is_dir: bool, is_file: bool) -> ValidationError | None:
    """The refusal of ``image`` for ``runtime`` given what the path is (pure; None when it fits).

    A Charliecloud image is a folder (or a SquashFS file), an Apptainer image a ``.sif`` file or a
    sandbox folder, a Pyxis one a ``.sqsh`` file (Enroot's) or a registry reference.
    """
    info = RUNTIMES[runtime]
    if is_remote(runtime, image):
        return None
    forms = " or ".join("a folder" if f == "dir" else f"a {f} file" for f in info.image_forms)
    if not is_dir and not is_file:
        return ValidationError(f"container image {image!r} does not exist", hint=f"a {runtime} image is {forms}; "
                               "check the path (it must be readable from the compute nodes too)")
    if is_dir and "dir" in info.image_forms:
        return None
    if is_file and image.endswith(tuple(f for f in info.image_forms if f != "dir")):
        return None
    what = "a folder" if is_dir else "a file"
    return ValidationError(f"container image {image!r} is {what}, not an image {runtime} runs",
                           hint=f"a {runtime} image is {forms}" + (
                               " (convert with `enroot import` / `enroot create`)" if runtime == "pyxis" else
                               " (build one with `apptainer build IMAGE.sif docker://...`)"
                               if runtime in ("apptainer", "singularity") else
                               " (unpack one with `ch-convert`, or build one with `ch-image`)"))


def missing_runtime_error(runtime: str, partition: str) -> ValidationError:
    """The refusal of a runtime whose binary this login node lacks (pure)."""
    info = RUNTIMES[runtime]
    return ValidationError(
        f"container runtime {runtime}: {info.binary!r} is not on this login node's PATH",
        hint=f"install it or load its module (the profile's modules), or choose another runtime; check the compute "
             f"nodes with `{info.node_check.replace('PARTITION', partition)}`",
    )


def make_runtime(runtime: str, image: str, binds: Sequence[Bind], env: Sequence[tuple[str, str]] = (), *,
                 gpus: bool = False, cwd: str = "") -> ContainerRuntime:
    """The wrapper of ``runtime`` for ``image`` with ``binds`` and ``env`` (pure); ``cwd``: the ranks' working
    folder where the runtime does not keep the one it starts in (Charliecloud).

    Raises:
        ValidationError: an unknown runtime, or a path a runtime's bind list cannot carry.
    """
    if runtime not in RUNTIMES:
        raise ValidationError(f"unknown container runtime {runtime!r}", hint=f"use one of: {', '.join(RUNTIMES)}")
    if runtime == "charliecloud":
        return Charliecloud(image, tuple(binds), tuple(env), cwd=cwd)
    if runtime in ("apptainer", "singularity"):
        return Apptainer(image, tuple(binds), tuple(env), gpus=gpus, binary=RUNTIMES[runtime].binary, name=runtime)
    return Pyxis(image, tuple(binds), tuple(env))


def job_binds(runtime: str, paths: Iterable[str], extra: Iterable[Bind] = ()) -> tuple[Bind, ...]:
    """The binds of a job that needs ``paths`` (each at the same path) and the ``extra`` binds asked for (pure).

    Charliecloud binds each needed path by its top-level folder (:func:`charliecloud_mount_points`);
    the others bind the outermost paths themselves. ``extra`` binds come after, as written.
    """
    extra = tuple(extra)
    paths = [p for p in paths if p]
    if runtime == "charliecloud":
        same = charliecloud_mount_points(paths)
    else:  # a path inside an extra bind of the same path is bound by it
        covering = [b.target for b in extra if b.source == b.target]
        same = tuple(p for p in outermost([*covering, *paths]) if p not in covering)
    targets = {b.target for b in extra}
    return tuple(Bind(p, p) for p in same if p not in targets) + extra
