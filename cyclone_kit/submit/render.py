"""Render sbatch scripts from Jinja2 templates (pure: a ResolvedJob in, script text out).

One sandboxed Jinja2 Environment with StrictUndefined: templates cannot call into Python,
and a misspelt variable is an error rather than an empty string. User templates (from
``$CYCLONE_KIT_TEMPLATES`` or ``~/.config/cyclone_kit/templates``) shadow the packaged ones.
Every interpolated value goes through a quoting filter: ``q`` for shell words in the body,
``sbatch`` for ``#SBATCH`` header values.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from cyclone_kit.config.container import container_runtime
from cyclone_kit.config.validate import ResolvedJob
from cyclone_kit.core.errors import ValidationError
from cyclone_kit.core.malloc import GLIBC_TUNABLES
from cyclone_kit.core.ports import PORT_BASE, PORT_SPAN  # the templates' MASTER_PORT range (cyclone_kit.core.ports)
from cyclone_kit.core.version import __version__
from cyclone_kit.launchers import Launcher, Wrapped
from cyclone_kit.launchers.containers import ContainerRuntime
from cyclone_kit.rundir.entry import rank_words
from cyclone_kit.rundir.layout import RunDir, StudyDir

_SAFE_HEADER = re.compile(r"^[A-Za-z0-9_./:@%+,=-]+$")


def packaged_template_dir() -> Path:
    """The templates shipped with cyclone_kit (inside the wheel, or the repo's templates/)."""
    inside = Path(__file__).resolve().parents[2] / "templates"
    return inside if inside.is_dir() else Path(__file__).resolve().parents[2] / "templates"


def template_dirs(environ: Mapping[str, str] | None = None) -> list[Path]:
    """Template search path: the user's directory first, the packaged templates second."""
    environ = os.environ if environ is None else environ
    user = environ.get("CYCLONE_KIT_TEMPLATES") or str(
        Path(environ.get("XDG_CONFIG_HOME") or Path(environ.get("HOME", "~")).expanduser() / ".config")
        / "cyclone_kit"
        / "templates"
    )
    return [Path(user), packaged_template_dir()]


def shell_quote(value: Any) -> str:
    """Quote a value as one shell word (the ``q`` filter)."""
    return shlex.quote(str(value))


def sbatch_quote(value: Any) -> str:
    """Quote a value for an ``#SBATCH`` line (the ``sbatch`` filter).

    sbatch splits directive lines on blanks and honours double quotes; it never runs a shell
    there. Values with a double quote, backslash or line break cannot be carried safely and
    are refused.
    """
    text = str(value)
    if _SAFE_HEADER.match(text):
        return text
    if any(c in text for c in '"\\\n\r') or not text.isprintable():
        raise ValidationError(
            f"value {text!r} cannot be written into an #SBATCH line",
            hint="avoid double quotes, backslashes and line breaks in names and paths",
        )
    return f'"{text}"'


@lru_cache(maxsize=4)
def _environment(dirs: tuple[str, ...]) -> Any:
    from jinja2 import FileSystemBytecodeCache, FileSystemLoader, StrictUndefined
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        loader=FileSystemLoader(list(dirs)),
        undefined=StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
        bytecode_cache=_bytecode_cache(FileSystemBytecodeCache),
    )
    env.filters["q"] = shell_quote
    env.filters["sbatch"] = sbatch_quote
    return env


def _bytecode_cache(cls: Any) -> Any:
    """Compiled templates cached per user (keyed by source checksum): a faster login-node CLI."""
    folder = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cyclone_kit" / "jinja"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return cls(str(folder))


def script_context(job: ResolvedJob, run_dir: Path | str, python: str | None = None) -> dict[str, Any]:
    """Every value a template may use, derived from a resolved job (pure)."""
    spec, prof = job.spec, job.profile
    ck = spec.checkpoint
    run_dir = str(run_dir)
    want_signal = ck.requeue or ck.every_steps > 0 or ck.resume
    python = python or prof.python or sys.executable
    runtime = container_runtime(spec, run_dir, gpus=bool(job.gpus_per_node))
    launcher: Launcher = job.launcher if runtime is None else Wrapped(job.launcher, runtime)
    rank_python = spec.container.python if spec.container is not None else python
    return {
        "version": __version__,
        "profile": prof.name,
        "launcher": job.launcher.name,
        "name": spec.name,
        "nodes": job.nodes,
        "alloc_nodes": job.alloc_nodes if job.restarts_in_job else job.nodes,
        # in-job restarts (resources.spare_nodes, min_nodes): the allocation outlives a lost node (--no-kill)
        # and the step watcher runs the step on `nodes` of it, restarting it on a spare or on fewer nodes
        "no_kill": job.restarts_in_job,
        "min_nodes": job.min_nodes,
        "stepwatch_args": stepwatch_args(job),
        "ntasks_per_node": job.ntasks_per_node,
        "cpus_per_task": job.cpus_per_task,
        "gpus_per_node": job.gpus_per_node,
        "gpu_request": prof.gpu_request,
        "procs_per_node": job.procs_per_node,
        "time": job.time,
        "partition": job.partition.name,
        "account": job.account,
        "account_required": prof.account_required,
        "mem": spec.resources.mem,
        "exclusive": spec.resources.exclusive,
        "signal": f"{ck.signal}@{ck.signal_lead_s}" if want_signal else "",
        # torchrun's agent handles only these by default; the requeue signal would kill it
        "signals_to_handle": ",".join(dict.fromkeys(["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", f"SIG{ck.signal}"])),
        "shutdown_timeout": ck.signal_lead_s,
        "srun_bind": [*prof.srun_binding, *(runtime.srun_options() if runtime is not None else ())],
        "requeue": ck.requeue,
        "extra_sbatch": [*prof.extra_sbatch, *spec.resources.extra_sbatch],
        "modules": list(prof.modules),
        "env": list(prof.env),
        "setup": list(prof.setup),
        "python": python,
        # what a rank's command starts with: the job's python, or the container's words and the image's python
        "rank_python": " ".join(shell_quote(w) for w in launcher.rank_command([rank_python])),
        "container_lines": container_lines(job, runtime),
        "run_dir": run_dir,
        "log_dir": str(RunDir(run_dir).logs),
        "worker_log_dir": str(RunDir(run_dir).worker_logs),
        "port_base": PORT_BASE,
        "glibc_tunables": GLIBC_TUNABLES,
        "port_span": PORT_SPAN,
        "entry": rank_entry(job, run_dir),
        # a script job runs in its working directory (script.chdir: where `submit` ran, or --chdir)
        "workdir": spec.script.chdir if spec.script is not None else "",
        "script_source": (spec.script.path or f"-m {spec.script.module}") if spec.script is not None else "",
        "script_live": bool(spec.script is not None and (spec.script.live or spec.script.module)),
    }


def container_lines(job: ResolvedJob, runtime: ContainerRuntime | None) -> list[str]:
    """The batch script's lines before the launch for a containerised job (pure; none without one)."""
    if runtime is None:
        return []
    image = job.spec.container.image if job.spec.container is not None else ""
    lines = [f"# The ranks run in the {runtime.name} image {image} (cyclone_kit/launchers/containers.py): every path "
             "the job needs",
             "# (run directory, working folder, virtual environment) is bound at the same path, so the shim, checkpoints, "
             "signals and requeue work as outside."]
    if runtime.name == "charliecloud":
        lines.append('export USER="${USER:-$(id -un)}"  # ch-run refuses to start without $USER')
    box = job.spec.container
    if box is not None and box.pythonpath:  # this venv (and project) for the image's python, after the job's own entries
        lines.append(f'export PYTHONPATH="${{PYTHONPATH:+$PYTHONPATH:}}"{shell_quote(":".join(box.pythonpath))}')
    return lines


def stepwatch_args(job: ResolvedJob) -> list[str]:
    """The step watcher's in-job restart options for ``job`` (pure; none without spares or a shrink floor)."""
    if not job.restarts_in_job:
        return []
    return ["--nodes", str(job.nodes), "--min-nodes", str(job.min_nodes), "--tasks-per-node", str(job.ntasks_per_node)]


def rank_entry(job: ResolvedJob, run_dir: Path | str) -> str:
    """What every rank runs after ``python`` (one shell-quoted string; pure): see :mod:`cyclone_kit.rundir.entry`."""
    return " ".join(shell_quote(w) for w in rank_words(job.spec, run_dir))


def render_script(
    job: ResolvedJob,
    run_dir: Path | str,
    *,
    python: str | None = None,
    environ: Mapping[str, str] | None = None,
    template: str | None = None,
    extra: Mapping[str, Any] | None = None,
) -> str:
    """Render the sbatch script of ``job`` for ``run_dir`` with its launcher's template.

    ``template`` picks another template (``doctor.sbatch.j2``); ``extra`` adds the values only
    that template uses to :func:`script_context`.
    """
    name = template or job.launcher.template
    return _render(name, {**script_context(job, run_dir, python), **(extra or {})}, environ)



def report_context(study_dir: Path | str, job: ResolvedJob, after: Sequence[str] = (), *,
                   python: str | None = None, name: str = "report") -> dict[str, Any]:
    """The values of a study's report job (pure): one core of the profile's default partition, no GPU.

    Raises:
        ValidationError: an id in ``after`` is not a Slurm job id.
    """
    for job_id in after:
        if not str(job_id).replace("_", "").isdigit():
            raise ValidationError(f"job id {job_id!r} is not a Slurm job id", hint="pass the ids sbatch printed")
    study = str(study_dir)
    prof = job.profile
    return {
        **script_context(job, study, python),
        "launcher": "report", "name": name, "nodes": 1, "alloc_nodes": 1, "no_kill": False, "stepwatch_args": [],
        "ntasks_per_node": 1, "cpus_per_task": 1,
        "gpus_per_node": 0, "time": "00:15:00", "partition": prof.default_partition.name, "mem": "",
        "exclusive": False, "signal": "", "requeue": False, "extra_sbatch": list(prof.extra_sbatch),
        "log_dir": str(StudyDir(study).logs), "log_stem": "report",
        "dependency": f"afterany:{':'.join(str(i) for i in after)}" if after else "",
        "study_dir": study, "report_dir": str(StudyDir(study).report), "workdir": "",
        "script_source": "",
    }


def render_report_script(study_dir: Path | str, job: ResolvedJob, after: Sequence[str] = (), *,
                         python: str | None = None, name: str = "report",
                         environ: Mapping[str, str] | None = None) -> str:
    """The sbatch script of a study's report job, from ``report.sbatch.j2`` (extends ``base.sbatch.j2``).

    It waits for every job in ``after`` (``--dependency=afterany:...``, so failed points are
    reported as incomplete rather than blocking the report), then runs
    ``python -m cyclone_kit report STUDY -o STUDY/report``.
    """
    return _render("report.sbatch.j2", report_context(study_dir, job, after, python=python, name=name), environ)


def _render(name: str, context: Mapping[str, Any], environ: Mapping[str, str] | None) -> str:
    from jinja2 import TemplateError, TemplateNotFound

    env = _environment(tuple(str(d) for d in template_dirs(environ)))
    try:
        return env.get_template(name).render(context)
    except TemplateNotFound as e:
        raise ValidationError(f"template {e.name!r} not found", hint=f"search path: {template_dirs(environ)}") from None
    except TemplateError as e:
        raise ValidationError(f"template {name} failed: {e}", hint="fix the user template or remove it") from None
