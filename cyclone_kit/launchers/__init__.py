"""The launcher registry: how a job's ranks are started, each launcher with its own rules.

A launcher (``srun`` one task per GPU, ``torchrun`` one agent per node, ``horovod`` ranks by srun
with Horovod's rendezvous, ``local`` the srun emulator on this machine) owns its validation rules,
its batch script's launch block (the template it names), the words it adds to a rank's command
and the environment it gives the ranks. No module outside this package compares a launcher's
name (tests/unit/test_architecture.py holds that); callers ask :func:`get_launcher` and use
what the launcher says. A container runtime wraps a launcher's rank command
(:class:`~cyclone_kit.launchers.registry.CommandWrapper`, :class:`~cyclone_kit.launchers.registry.Wrapped`);
the runtimes themselves (Charliecloud, Apptainer/Singularity, Enroot/Pyxis) are in
:mod:`cyclone_kit.launchers.containers`.

Imports: ``core`` only, so every side may ask it (config, rundir, submit, backends, runtime, analysis).
"""

from cyclone_kit.launchers.registry import (
    DEFAULT,
    HOROVOD,
    LAUNCHERS,
    LOCAL,
    SRUN,
    TORCHRUN,
    AgentPerNode,
    CommandWrapper,
    Launcher,
    TaskPerGpu,
    Wrapped,
    get_launcher,
    selectable_names,
)

__all__ = ["DEFAULT", "HOROVOD", "LAUNCHERS", "LOCAL", "SRUN", "TORCHRUN", "AgentPerNode", "CommandWrapper",
           "Launcher", "TaskPerGpu", "Wrapped", "get_launcher", "selectable_names"]
