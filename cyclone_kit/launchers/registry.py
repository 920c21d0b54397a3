"""Every launcher cyclone_kit knows, registered by name, each owning its rules (pure).

A launcher is how a job's ranks are started inside its allocation. Two layouts exist:

* :class:`TaskPerGpu`: one task per GPU (or per CPU rank), every rank a task of the step:
  ``srun``, ``horovod`` (srun's tasks plus Horovod's rendezvous in the shim) and ``local`` (the
  srun emulator on this machine, :mod:`cyclone_kit.backends.srun_emulator`);
* :class:`AgentPerNode`: one task per node whose agent starts the node's workers: ``torchrun``.

Each launcher answers, for the validation (:func:`cyclone_kit.config.validate.resolve`), how
many tasks and processes a node runs and which requests it refuses (a ``ValidationError`` with a
HINT, returned, not raised); for the batch script, the template whose launch block starts it; for
a rank's command, the shim's flags (:mod:`cyclone_kit.rundir.entry`) and :meth:`rank_command`; for
the local launcher, the ranks' environment (:mod:`cyclone_kit.launchers.local`).

The seam for containers: a container runtime is a :class:`CommandWrapper` (its words go before a
rank's command, e.g. ``apptainer exec --nv IMAGE``); :class:`Wrapped` is the launcher it wraps
with that command, and every other rule stays the wrapped launcher's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from cyclone_kit.core.errors import ValidationError
from cyclone_kit.launchers import local as local_env


@runtime_checkable
class Launcher(Protocol):
    """What every launcher answers (pure methods; errors returned, not raised)."""

    @property
    def name(self) -> str:
        """The name a job spec's ``resources.launcher`` gives (and the batch script's header shows)."""
        ...

    @property
    def template(self) -> str:
        """The batch script template whose ``launch`` block starts the ranks ('' when none: local)."""
        ...

    @property
    def selectable(self) -> bool:
        """Whether a job spec may choose it (the local launcher is the local backend's own)."""
        ...

    @property
    def shim_flags(self) -> tuple[str, ...]:
        """Flags the launch shim gets before a user's script (``--horovod``: Horovod's rendezvous first)."""
        ...

    @property
    def in_job_restarts(self) -> bool:
        """Whether the step watcher may restart its step inside the job (spare nodes, a shrink floor)."""
        ...

    def tasks_per_node(self, requested: int | None, gpus: int) -> int:
        """Slurm tasks per node for ``requested`` (``--ntasks-per-node``, None: unset) and ``gpus`` per node."""
        ...

    def procs_per_node(self, tasks: int, gpus: int, requested: int | None) -> int:
        """Training processes per node (ranks) for ``tasks`` tasks and ``gpus`` GPUs per node."""
        ...

    def cpus_per_task(self, cpus_per_gpu: int, gpus: int) -> int:
        """A task's CPUs by default on a GPU node (``cpus_per_gpu`` for each GPU the task drives)."""
        ...

    def recorded_tasks_per_node(self, tasks: int, procs: int, gpus: int) -> int:
        """``resources.ntasks_per_node`` as a run's resolved spec records it."""
        ...

    def layout_error(self, requested: int | None, gpus: int, where: str) -> ValidationError | None:
        """The refusal of ``requested`` tasks per node beside ``gpus`` GPUs per node, if any."""
        ...

    def cpu_error(self, requested: int | None, cpus: int, gpus: int, cpus_per_gpu: int, cpus_per_node: int,
                  where: str) -> ValidationError | None:
        """The refusal of ``cpus`` CPUs per task against the partition's cores, if any."""
        ...

    def restart_error(self, spares: int, min_nodes: int, nodes: int) -> ValidationError | None:
        """The refusal of in-job restarts (``spares`` spare nodes, a shrink floor of ``min_nodes``), if any."""
        ...

    def signal_error(self, signal: str, torch_release: tuple[int, int] | None) -> ValidationError | None:
        """The refusal of the requeue signal ``signal`` (``checkpoint.signal``, e.g. ``USR2``) under the
        installed torch (``(major, minor)``; None: unknown), if the launcher would not pass it on to the ranks."""
        ...

    def point_resources(self, per_node: int, gpu_partition: bool) -> dict[str, int | None]:
        """A scaling study's point of ``per_node`` ranks per node, as ``resources`` fields."""
        ...

    def rank_command(self, argv: Sequence[str]) -> list[str]:
        """What a rank runs for its command ``argv`` (``argv`` itself, unless a container wraps it)."""
        ...


@dataclass(frozen=True)
class TaskPerGpu:
    """One task per GPU (or per CPU rank): every rank is a task of the step (srun, horovod)."""

    name: str
    template: str
    selectable: bool = True
    shim_flags: tuple[str, ...] = ()
    in_job_restarts: bool = True

    def tasks_per_node(self, requested: int | None, gpus: int) -> int:
        """``--ntasks-per-node`` when given, else one per GPU (one on a CPU node)."""
        if gpus:
            return gpus if requested is None else requested
        return requested or 1

    def procs_per_node(self, tasks: int, gpus: int, requested: int | None) -> int:
        """Each task is a rank."""
        return tasks

    def cpus_per_task(self, cpus_per_gpu: int, gpus: int) -> int:
        """A task drives one GPU: its cores."""
        return cpus_per_gpu

    def recorded_tasks_per_node(self, tasks: int, procs: int, gpus: int) -> int:
        """The tasks."""
        return tasks

    def layout_error(self, requested: int | None, gpus: int, where: str) -> ValidationError | None:
        """On GPU nodes each task drives one GPU: tasks per node must equal GPUs per node."""
        tasks = self.tasks_per_node(requested, gpus)
        if gpus and tasks != gpus:
            return ValidationError(
                f"--ntasks-per-node={tasks} but --gpus-per-node={gpus}: with the {self.name} launcher each task "
                "drives one GPU",
                hint=f"use --ntasks-per-node={gpus} or --gpus-per-node={tasks}",
            )
        return None

    def cpu_error(self, requested: int | None, cpus: int, gpus: int, cpus_per_gpu: int, cpus_per_node: int,
                  where: str) -> ValidationError | None:
        """A task takes at most its GPU's share of the node's cores."""
        if gpus and cpus > cpus_per_gpu:
            return ValidationError(f"--cpus-per-task={cpus} is more than the {cpus_per_gpu} cores per GPU of {where}",
                                   hint=f"use --cpus-per-task={cpus_per_gpu} or fewer")
        return None

    def restart_error(self, spares: int, min_nodes: int, nodes: int) -> ValidationError | None:
        """The step watcher restarts the step: none refused."""
        return None

    def signal_error(self, signal: str, torch_release: tuple[int, int] | None) -> ValidationError | None:
        """Slurm signals the tasks (the ranks) themselves: none refused."""
        return None

    def point_resources(self, per_node: int, gpu_partition: bool) -> dict[str, int | None]:
        """``per_node`` tasks (and as many GPUs on a GPU partition)."""
        if gpu_partition:
            return {"ntasks_per_node": per_node, "gpus_per_node": per_node}
        return {"ntasks_per_node": per_node}

    def rank_command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` as it is."""
        return list(argv)


#: The signals torchrun's agent passes on to its workers on every torch release (its own handlers).
AGENT_SIGNALS = ("TERM", "INT", "HUP")
#: The first torch whose agent passes on the signals of TORCHELASTIC_SIGNALS_TO_HANDLE (pytorch#160690).
AGENT_SIGNALS_SINCE = (2, 10)


@dataclass(frozen=True)
class AgentPerNode:
    """One task per node whose agent starts the node's workers (torchrun: one per GPU, or
    ``--ntasks-per-node`` workers on a CPU node, its ``--nproc-per-node``)."""

    name: str
    template: str
    selectable: bool = True
    shim_flags: tuple[str, ...] = ()
    in_job_restarts: bool = False

    def tasks_per_node(self, requested: int | None, gpus: int) -> int:
        """One agent per node."""
        return 1

    def procs_per_node(self, tasks: int, gpus: int, requested: int | None) -> int:
        """One worker per GPU, else the requested workers (at least one)."""
        return gpus or requested or 1

    def cpus_per_task(self, cpus_per_gpu: int, gpus: int) -> int:
        """The node's one task drives every GPU of it."""
        return cpus_per_gpu * gpus

    def recorded_tasks_per_node(self, tasks: int, procs: int, gpus: int) -> int:
        """On CPU nodes the workers per node (its ``--nproc-per-node``, as the flag meant), else the tasks."""
        return tasks if gpus else procs

    def layout_error(self, requested: int | None, gpus: int, where: str) -> ValidationError | None:
        """On GPU nodes the workers are one per GPU: another ``--ntasks-per-node`` is refused."""
        if gpus and requested not in (None, 1, gpus):
            return ValidationError(
                f"--ntasks-per-node={requested} with the {self.name} launcher on {where}, whose workers are "
                f"one per GPU ({gpus} per node)",
                hint=f"drop --ntasks-per-node ({self.name} starts {gpus} workers per node), or use "
                f"--gpus-per-node={requested}",
            )
        return None

    def cpu_error(self, requested: int | None, cpus: int, gpus: int, cpus_per_gpu: int, cpus_per_node: int,
                  where: str) -> ValidationError | None:
        """On CPU nodes each worker needs a core of the node's one task."""
        workers = requested or 1
        if not gpus and workers > cpus:
            return ValidationError(
                f"--ntasks-per-node={workers} {self.name} workers per node but --cpus-per-task={cpus}: each worker "
                "needs a core of the node's one task",
                hint=f"use --cpus-per-task={min(workers, cpus_per_node)} or more, or fewer workers "
                f"(at most {cpus})" if workers <= cpus_per_node else
                f"use at most {cpus_per_node} workers per node (the cores of a node of {where})",
            )
        return None

    def restart_error(self, spares: int, min_nodes: int, nodes: int) -> ValidationError | None:
        """The agent has its own elastic restarts: spare nodes and a shrink floor are refused."""
        if spares or 0 < min_nodes < nodes:
            others = [lc.name for lc in LAUNCHERS.values() if lc.selectable and lc.in_job_restarts]
            return ValidationError(
                f"--spare-nodes / --min-nodes restart the step inside the job with the {' and '.join(others)} "
                f"launchers; {self.name} has its own elastic restarts",
                hint=f"use --launcher {DEFAULT.name} (the ranks get torchrun's variables all the same), or drop "
                "--spare-nodes and --min-nodes",
            )
        return None

    def signal_error(self, signal: str, torch_release: tuple[int, int] | None) -> ValidationError | None:
        """The agent passes on to its workers only the signals it handles: SIGTERM, SIGINT and SIGHUP on
        every torch, others (``TORCHELASTIC_SIGNALS_TO_HANDLE``, which the batch script sets) from torch
        2.10. An older agent dies of SIGUSR1/SIGUSR2 and its workers never checkpoint (seen with 2.6.0:
        the agent exited -12, its workers kept running; 2.7-2.9's sources have no such variable either)."""
        if signal in AGENT_SIGNALS or torch_release is None or torch_release >= AGENT_SIGNALS_SINCE:
            return None
        since = ".".join(map(str, AGENT_SIGNALS_SINCE))
        return ValidationError(
            f"checkpoint.signal={signal} with the {self.name} launcher under torch "
            f"{'.'.join(map(str, torch_release))}: its agent passes SIG{signal} on to the workers only from torch "
            f"{since} (before, the signal ends the agent and no rank checkpoints)",
            hint=f"--set checkpoint.signal=TERM (every agent passes it on), --launcher {DEFAULT.name}, or torch>={since}",
        )

    def point_resources(self, per_node: int, gpu_partition: bool) -> dict[str, int | None]:
        """One agent per node starting ``per_node`` workers, one per GPU."""
        return {"ntasks_per_node": None, "gpus_per_node": per_node}

    def rank_command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` as it is."""
        return list(argv)


@dataclass(frozen=True)
class LocalLauncher(TaskPerGpu):
    """The srun emulator: ranks on this machine with the environment srun would give them."""

    def rank_variables(self, nproc: int, nodes: int, *, job_id: str, master_port: int | str, threads: int,
                       run_dir: Path | str, job_name: str, submit_dir: str) -> list[dict[str, str]]:
        """The variables this launcher sets for each rank (Slurm's, the rendezvous, threads; pure).

        Raises:
            ValidationError: ``nproc`` is not a positive multiple of ``nodes``.
        """
        return local_env.rank_variables(nproc, nodes, job_id=job_id, master_port=master_port, threads=threads,
                                        run_dir=run_dir, job_name=job_name, submit_dir=submit_dir,
                                        launcher=self.name)

    def started(self, environ: Mapping[str, str]) -> bool:
        """Whether ``environ`` is a rank's that this launcher started (its ``CYCLONE_LAUNCHER``; pure)."""
        return environ.get(local_env.LAUNCHER_VARIABLE) == self.name


class CommandWrapper(Protocol):
    """A container runtime (Apptainer, Enroot/Pyxis, Charliecloud): words around a rank's command."""

    @property
    def name(self) -> str:
        """The runtime's name (``apptainer``, ``charliecloud`` ...)."""
        ...

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside the container (e.g. ``[ch-run, IMAGE, --, *argv]``)."""
        ...


@dataclass(frozen=True)
class Wrapped:
    """``inner`` with its rank command run inside ``wrapper``; every other rule is ``inner``'s."""

    inner: Launcher
    wrapper: CommandWrapper

    @property
    def name(self) -> str:
        """The wrapped launcher's name (a spec names the launcher; the container is its own choice)."""
        return self.inner.name

    @property
    def template(self) -> str:
        """The wrapped launcher's template."""
        return self.inner.template

    @property
    def selectable(self) -> bool:
        """As the wrapped launcher."""
        return self.inner.selectable

    @property
    def shim_flags(self) -> tuple[str, ...]:
        """As the wrapped launcher."""
        return self.inner.shim_flags

    @property
    def in_job_restarts(self) -> bool:
        """As the wrapped launcher."""
        return self.inner.in_job_restarts

    def tasks_per_node(self, requested: int | None, gpus: int) -> int:
        """As the wrapped launcher."""
        return self.inner.tasks_per_node(requested, gpus)

    def procs_per_node(self, tasks: int, gpus: int, requested: int | None) -> int:
        """As the wrapped launcher."""
        return self.inner.procs_per_node(tasks, gpus, requested)

    def cpus_per_task(self, cpus_per_gpu: int, gpus: int) -> int:
        """As the wrapped launcher."""
        return self.inner.cpus_per_task(cpus_per_gpu, gpus)

    def recorded_tasks_per_node(self, tasks: int, procs: int, gpus: int) -> int:
        """As the wrapped launcher."""
        return self.inner.recorded_tasks_per_node(tasks, procs, gpus)

    def layout_error(self, requested: int | None, gpus: int, where: str) -> ValidationError | None:
        """As the wrapped launcher."""
        return self.inner.layout_error(requested, gpus, where)

    def cpu_error(self, requested: int | None, cpus: int, gpus: int, cpus_per_gpu: int, cpus_per_node: int,
                  where: str) -> ValidationError | None:
        """As the wrapped launcher."""
        return self.inner.cpu_error(requested, cpus, gpus, cpus_per_gpu, cpus_per_node, where)

    def restart_error(self, spares: int, min_nodes: int, nodes: int) -> ValidationError | None:
        """As the wrapped launcher."""
        return self.inner.restart_error(spares, min_nodes, nodes)

    def signal_error(self, signal: str, torch_release: tuple[int, int] | None) -> ValidationError | None:
        """As the wrapped launcher."""
        return self.inner.signal_error(signal, torch_release)

    def point_resources(self, per_node: int, gpu_partition: bool) -> dict[str, int | None]:
        """As the wrapped launcher."""
        return self.inner.point_resources(per_node, gpu_partition)

    def rank_command(self, argv: Sequence[str]) -> list[str]:
        """The wrapped launcher's command, inside the container."""
        return self.wrapper.wrap(self.inner.rank_command(argv))


SRUN = TaskPerGpu("srun", template="srun.sbatch.j2")
TORCHRUN = AgentPerNode("torchrun", template="torchrun.sbatch.j2")
HOROVOD = TaskPerGpu("horovod", template="horovod.sbatch.j2", shim_flags=("--horovod",))
LOCAL = LocalLauncher("local", template="", selectable=False)

#: name -> launcher; the selectable ones in the order error messages list them.
LAUNCHERS: dict[str, Launcher] = {lc.name: lc for lc in (SRUN, TORCHRUN, HOROVOD, LOCAL)}
#: What a job spec's ``resources.launcher`` is when it says nothing.
DEFAULT = SRUN


def selectable_names() -> tuple[str, ...]:
    """The launchers a job spec may name (``resources.launcher``), in order."""
    return tuple(name for name, lc in LAUNCHERS.items() if lc.selectable)


def get_launcher(name: str) -> Launcher:
    """The launcher registered as ``name``.

    Raises:
        ValidationError: no launcher has that name.
    """
    if name not in LAUNCHERS:
        raise ValidationError(f"unknown resources.launcher {name!r}", hint=f"use one of: {', '.join(selectable_names())}")
    return LAUNCHERS[name]
