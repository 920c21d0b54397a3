"""The launcher registry: each launcher's rules, read from the registry alone (pure)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from cyclone_kit.config.job import LAUNCHERS as SPEC_LAUNCHERS
from cyclone_kit.core.errors import ValidationError
from cyclone_kit.launchers import HOROVOD, LAUNCHERS, LOCAL, SRUN, TORCHRUN, Launcher, Wrapped, get_launcher


def test_every_launcher_is_registered_under_its_name_and_speaks_the_protocol() -> None:
    assert list(LAUNCHERS) == ["srun", "torchrun", "horovod", "local"]
    for name, launcher in LAUNCHERS.items():
        assert launcher.name == name and isinstance(launcher, Launcher)
    assert SPEC_LAUNCHERS == ("srun", "torchrun", "horovod")  # local is the local backend's own
    with pytest.raises(ValidationError, match=r"unknown resources\.launcher 'mpirun'.*srun, torchrun, horovod"):
        get_launcher("mpirun")


@pytest.mark.parametrize(("launcher", "requested", "gpus", "tasks", "procs"), [
    (SRUN, None, 4, 4, 4),
    (SRUN, None, 0, 1, 1),
    (SRUN, 3, 0, 3, 3),
    (HOROVOD, None, 2, 2, 2),
    (TORCHRUN, None, 4, 1, 4),
    (TORCHRUN, 4, 0, 1, 4),
    (TORCHRUN, None, 0, 1, 1),
])
def test_tasks_and_processes_per_node(launcher: Launcher, requested: int | None, gpus: int, tasks: int,
                                      procs: int) -> None:
    assert launcher.tasks_per_node(requested, gpus) == tasks
    assert launcher.procs_per_node(tasks, gpus, requested) == procs


def test_each_layouts_refusals_carry_a_hint() -> None:
    where = "partition 'gpu' of profile 'p'"
    assert SRUN.layout_error(None, 4, where) is None and TORCHRUN.layout_error(1, 4, where) is None
    srun = SRUN.layout_error(3, 4, where)
    assert srun is not None and "with the srun launcher each task drives one GPU" in str(srun)
    assert srun.hint == "use --ntasks-per-node=4 or --gpus-per-node=3"
    agent = TORCHRUN.layout_error(3, 4, where)
    assert agent is not None and "drop --ntasks-per-node (torchrun starts 4 workers per node)" in agent.hint
    assert TORCHRUN.cpu_error(4, 2, 0, 0, 8, where) is not None and TORCHRUN.cpu_error(4, 4, 0, 0, 8, where) is None
    assert SRUN.cpu_error(None, 9, 1, 8, 64, where) is not None and SRUN.cpu_error(None, 8, 1, 8, 64, where) is None


def test_in_job_restarts_are_refused_by_the_agent_only() -> None:
    assert SRUN.restart_error(1, 0, 2) is None and HOROVOD.restart_error(0, 1, 2) is None
    error = TORCHRUN.restart_error(1, 0, 2)
    assert error is not None and "with the srun and horovod launchers" in str(error)
    assert error.hint.startswith("use --launcher srun")
    assert TORCHRUN.restart_error(0, 2, 2) is None


def test_the_shim_flags_and_templates() -> None:
    assert HOROVOD.shim_flags == ("--horovod",) and SRUN.shim_flags == TORCHRUN.shim_flags == ()
    assert [lc.template for lc in (SRUN, TORCHRUN, HOROVOD, LOCAL)] == [
        "srun.sbatch.j2", "torchrun.sbatch.j2", "horovod.sbatch.j2", ""]


def test_the_local_launcher_sets_srun_like_variables_and_knows_its_ranks() -> None:
    ranks = LOCAL.rank_variables(4, 2, job_id="9", master_port=1234, threads=2, run_dir="/r", job_name="j",
                                 submit_dir="/s")
    assert [(v["SLURM_PROCID"], v["SLURM_LOCALID"], v["SLURMD_NODENAME"]) for v in ranks] == [
        ("0", "0", "127.0.0.1"), ("1", "1", "127.0.0.1"), ("2", "0", "127.0.0.2"), ("3", "1", "127.0.0.2")]
    assert ranks[0]["SLURM_TASKS_PER_NODE"] == "2(x2)" and ranks[0]["CYCLONE_LAUNCHER"] == "local"
    # each rank's share of the cores: torch's threads and torch.compile's workers (torch sizes the pool by the
    # CPUs the process may run on, and the local ranks may all run on every core)
    assert {(v["OMP_NUM_THREADS"], v["TORCHINDUCTOR_COMPILE_THREADS"]) for v in ranks} == {("2", "2")}
    assert LOCAL.started(ranks[0]) and not LOCAL.started({}) and not LOCAL.started({"CYCLONE_LAUNCHER": "slurm"})
    with pytest.raises(ValidationError, match="does not split evenly"):
        LOCAL.rank_variables(3, 2, job_id="9", master_port=1, threads=1, run_dir="/r", job_name="j", submit_dir="/")


@dataclass(frozen=True)
class Container:
    """A container runtime as the seam expects one (a stand-in for Charliecloud's ch-run)."""

    name: str = "charliecloud"

    def wrap(self, argv: Sequence[str]) -> list[str]:
        return ["ch-run", "IMAGE", "--", *argv]


def test_a_container_wraps_the_rank_command_and_keeps_every_other_rule() -> None:
    wrapped = Wrapped(TORCHRUN, Container())
    assert isinstance(wrapped, Launcher) and wrapped.name == "torchrun"
    assert wrapped.rank_command(["python", "x.py"]) == ["ch-run", "IMAGE", "--", "python", "x.py"]
    assert wrapped.template == TORCHRUN.template and wrapped.procs_per_node(1, 4, None) == 4
    assert wrapped.restart_error(1, 0, 2) is not None and not wrapped.in_job_restarts


@pytest.mark.parametrize(("environ", "wanted"), [
    ({"SLURM_JOB_ID": "7"}, True),                                   # a rank of a real Slurm job
    ({"SLURM_JOB_ID": "7", "CYCLONE_LAUNCHER": "local"}, False),     # the local launcher watches its ranks itself
    ({"SLURM_JOB_ID": "7", "CYCLONE_LAUNCHER": "srun"}, True),
    ({}, False),
    ({"CYCLONE_LAUNCHER": "local", "CYCLONE_WATCHDOG": "1"}, True),  # switched on by hand
    ({"SLURM_JOB_ID": "7", "CYCLONE_WATCHDOG": "0"}, False),
])
def test_the_rank_watchdog_runs_in_slurm_jobs_but_not_under_the_local_launcher(environ, wanted):
    from cyclone_kit.runtime.watchers import rankexit

    assert rankexit.wanted(environ) is wanted
