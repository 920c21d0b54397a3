"""The ``[container]`` table of a job spec and of a cluster profile, and its checks on the login node.

A job runs its ranks inside a container image when its spec (or ``--container IMAGE``) names one;
the profile may give the runtime, extra binds and a default image for the cluster. The merged
:class:`ContainerConfig` is recorded in the run's ``spec.json``. :func:`container_problems` is the
login side's check (the image exists and is of the runtime's form, the runtime is installed, the
binds exist, Charliecloud's mount points are in the image): one line with a HINT, before anything
is written or queued. Building the wrapper is the registry's (:mod:`cyclone_kit.launchers.containers`).
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import sysconfig
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from cyclone_kit.core.errors import ValidationError
from cyclone_kit.launchers.containers import (
    RUNTIMES,
    Bind,
    ContainerRuntime,
    charliecloud_mount_points,
    image_form_error,
    is_remote,
    job_binds,
    make_runtime,
    missing_runtime_error,
    parse_bind,
    rank_env,
    runtime_names,
)


class _PlacedJob(Protocol):
    """What :func:`check_container` reads of a :class:`~cyclone_kit.config.validate.ResolvedJob` (not imported
    here: validate imports this module)."""

    @property
    def spec(self) -> Any: ...
    @property
    def partition(self) -> Any: ...


Job = TypeVar("Job", bound=_PlacedJob)


@dataclass(frozen=True)
class ContainerConfig:
    """Where a job's ranks run: ``runtime`` (:data:`~cyclone_kit.launchers.containers.RUNTIMES`), ``image``,
    extra ``binds`` (``SRC`` or ``SRC:DST``), the ``python`` inside the image.

    ``host_venv``: the image brings Python but not torch or cyclone_kit; the job binds this
    installation's virtual environment (and, for an editable install, the project) in at the same
    paths and puts them on ``PYTHONPATH`` (``pythonpath``, filled in on the login side at submission,
    :func:`with_host_paths`). The image's Python must be of the same minor version as the venv's.
    """

    runtime: str = ""
    image: str = ""
    binds: tuple[str, ...] = ()
    python: str = "python3"
    host_venv: bool = True
    pythonpath: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.runtime and self.runtime not in RUNTIMES:
            raise ValidationError(f"unknown container.runtime {self.runtime!r}",
                                  hint=f"use one of: {', '.join(runtime_names())}")
        for text in self.binds:
            parse_bind(text)
        for p in self.pythonpath:
            if not p.startswith("/"):
                raise ValidationError(f"container.pythonpath entry {p!r} is not an absolute path",
                                      hint="leave pythonpath out: the login side fills it in (host_venv)")
        if not self.python or any(c.isspace() for c in self.python):
            raise ValidationError(f"container.python {self.python!r} is not one command",
                                  hint='the interpreter inside the image, e.g. python = "python3"')

    @property
    def bind_list(self) -> tuple[Bind, ...]:
        """``binds`` parsed."""
        return tuple(parse_bind(b) for b in self.binds)


def merged(job: ContainerConfig | None, profile: ContainerConfig | None) -> ContainerConfig | None:
    """The job's container over the profile's (pure): None unless one of them names an image.

    The job's runtime, image and python win where given; binds are the profile's then the job's.

    Raises:
        ValidationError: an image without a runtime on either side.
    """
    if job is None and (profile is None or not profile.image):
        return None
    prof = profile or ContainerConfig()
    mine = job or ContainerConfig()
    out = dataclasses.replace(
        mine,
        runtime=mine.runtime or prof.runtime,
        image=mine.image or prof.image,
        binds=tuple(dict.fromkeys((*prof.binds, *mine.binds))),
        python=mine.python if mine.python != ContainerConfig.python else prof.python,
        host_venv=mine.host_venv and prof.host_venv,
    )
    if not out.image:
        return None if job is None else _no_image()
    if not out.runtime:
        raise ValidationError(f"container image {out.image!r} but no container runtime",
                              hint=f"--set container.runtime=NAME ({', '.join(runtime_names())}), or set runtime in "
                                   "the profile's [container] table")
    return out


def _no_image() -> ContainerConfig:
    raise ValidationError("the job's [container] table names no image",
                          hint="--container IMAGE, or image = \"/path/to/image\" in [container]")


def host_paths(prefix: str | None = None, purelib: str | None = None) -> tuple[str, ...]:
    """What a container needs on ``PYTHONPATH`` to run this installation: the venv's site-packages and,
    for an editable install, the folder cyclone_kit is imported from (absolute; read from this process)."""
    prefix = prefix or sys.prefix
    site = purelib or sysconfig.get_paths()["purelib"]
    package_root = str(Path(__file__).resolve().parents[2])
    paths = [site]
    if not Path(package_root).is_relative_to(site):
        paths.append(package_root)
    return tuple(paths)


def with_host_paths(container: ContainerConfig) -> ContainerConfig:
    """``container`` with ``pythonpath`` filled in from this installation when ``host_venv`` asks and none is given."""
    if not container.host_venv or container.pythonpath:
        return container
    return dataclasses.replace(container, pythonpath=host_paths())


def container_paths(spec: Any, run_dir: Path | str) -> list[str]:
    """The paths a containerised job of ``spec`` binds at the same path (pure): the run directory, the
    working folder, a live script's folder, the built-in trainer's data and the container's ``pythonpath``."""
    paths = [str(run_dir)]
    script = getattr(spec, "script", None)
    if script is not None:
        paths.append(script.chdir)
        if script.live and script.path:
            paths.append(str(Path(script.path).parent))
    elif spec.train.data_dir:
        paths.append(spec.train.data_dir)
    if spec.container is not None:
        paths += spec.container.pythonpath
    return [p for p in paths if p]


def container_runtime(spec: Any, run_dir: Path | str, *, gpus: bool = False) -> ContainerRuntime | None:
    """The container runtime that wraps the rank command of ``spec`` in ``run_dir`` (pure; None without a
    container): the paths the job needs bound at the same paths, the ranks' own variables, and the working
    folder (a script's ``chdir``, else the run directory) where the runtime does not keep it."""
    box = spec.container
    if box is None:
        return None
    needed = container_paths(spec, run_dir)
    binds = job_binds(box.runtime, needed, box.bind_list)
    script = getattr(spec, "script", None)
    cwd = script.chdir if script is not None and script.chdir else str(run_dir)
    return make_runtime(box.runtime, box.image, binds, rank_env(box.runtime), gpus=gpus, cwd=cwd)


def container_environment(container: ContainerConfig, environ: Mapping[str, str], user: str) -> dict[str, str]:
    """What a container's ranks need on top of ``environ`` (pure): the job's venv on ``PYTHONPATH`` after
    the entries ``environ`` has (as site-packages would be), and ``USER`` = ``user`` where ``environ`` has
    none (ch-run refuses to start without it)."""
    out: dict[str, str] = {}
    if container.pythonpath:
        out["PYTHONPATH"] = ":".join([p for p in environ.get("PYTHONPATH", "").split(":") if p]
                                     + list(container.pythonpath))
    if not environ.get("USER"):
        out["USER"] = user
    return out


def container_problems(container: ContainerConfig, needed: Iterable[str], partition: str, *,
                       which: Callable[[str], str | None] = shutil.which) -> None:
    """Check a container request on the login node; raise its first problem (one line with a HINT).

    ``needed`` are the paths the job binds at the same path (run-directory folder, working folder,
    data, ``pythonpath``); ``partition`` names where the HINT says to check the compute nodes;
    ``which`` finds a binary on this node's PATH. The image and binds are checked first, the runtime's
    binary then.

    Raises:
        ValidationError: the runtime is not installed here, the image does not exist or is not of the
            runtime's form, a bind's source does not exist, or (Charliecloud, a folder image) the image
            lacks the folder a path is bound onto.
    """
    runtime, image = container.runtime, container.image
    path = Path(image)
    if not is_remote(runtime, image):
        if not path.is_absolute():
            raise ValidationError(f"container image {image!r} is not an absolute path",
                                  hint=f"give the full path, e.g. --container {path.absolute()}")
        error = image_form_error(runtime, image, is_dir=path.is_dir(), is_file=path.is_file())
        if error is not None:
            raise error
    for bind in container.bind_list:
        if not Path(bind.source).exists():
            raise ValidationError(f"container bind source {bind.source!r} does not exist on this machine",
                                  hint="fix the path in container.binds (or the profile's [container] binds)")
    if which(RUNTIMES[runtime].binary) is None:
        raise missing_runtime_error(runtime, partition)
    paths = [p for p in needed if p]
    if runtime == "charliecloud":
        tops = charliecloud_mount_points(paths)
        if path.is_dir():
            for top in tops:
                if not (path / top.lstrip("/")).is_dir():
                    raise ValidationError(
                        f"Charliecloud image {image} has no folder {top} to bind the job's {top} onto "
                        "(ch-run cannot create one in a read-only image)",
                        hint=f"mkdir {path / top.lstrip('/')} (once, in the image), then submit again")
        for bind in container.bind_list:
            if path.is_dir() and not (path / bind.target.lstrip("/")).is_dir():
                raise ValidationError(f"Charliecloud image {image} has no folder {bind.target} for the bind "
                                      f"{bind.spec}", hint=f"mkdir -p {path / bind.target.lstrip('/')}")


def check_container(job: Job, runs_dir: Path) -> Job:
    """``job`` with its container's ``pythonpath`` filled in from this venv (``host_venv``), checked on this
    login node (:func:`container_problems`); ``job`` itself without a container.

    Raises:
        ValidationError: the runtime is not installed, the image or a bind does not exist, or the image lacks
            a mount point, before any run directory is written.
    """
    if job.spec.container is None:
        return job
    spec = dataclasses.replace(job.spec, container=with_host_paths(job.spec.container))
    needed = container_paths(spec, runs_dir.absolute() / "run")  # a run directory's folder stands for it
    container_problems(spec.container, needed, job.partition.name)
    return dataclasses.replace(job, spec=spec)
