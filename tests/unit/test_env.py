"""Table tests of the rank bootstrap (cyclone_kit.runtime.env.detect): every launcher, every
hostlist form, port uniqueness, and inconsistent environments."""

from __future__ import annotations

import itertools
import json

import pytest

from cyclone_kit.core.errors import ValidationError
from cyclone_kit.runtime.dist import choose_device, cpus_per_task, worker_cpus
from cyclone_kit.runtime.env import DistEnv, default_port, detect
from cyclone_kit.submit.render import PORT_BASE, PORT_SPAN
from tests.helpers.slurm_env import SLURM_BATCH, SLURM_TASK3

# Recorded from a real Slurm 22.05 job (sbatch -N2 --ntasks-per-node=2; srun env) on the local
# test cluster: task 3 of step 0, and the batch script's own environment.


def slurm_task(nodelist: str, tasks_per_node: str, ntasks: int, procid: int, nodeid: int, localid: int,
               job: str = "1234", step: str = "0", **extra: str) -> dict[str, str]:
    """A minimal srun task environment."""
    return {
        "SLURM_JOB_ID": job, "SLURM_STEP_ID": step, "SLURM_PROCID": str(procid), "SLURM_NODEID": str(nodeid),
        "SLURM_LOCALID": str(localid), "SLURM_NTASKS": str(ntasks), "SLURM_JOB_NODELIST": nodelist,
        "SLURM_TASKS_PER_NODE": tasks_per_node, **extra,
    }


# ------------------------------------------------------------------------ launchers
def test_single_process_defaults() -> None:
    env = detect({})
    assert env == DistEnv(launcher="single", master_addr="127.0.0.1", master_port=PORT_BASE)
    assert not env.is_distributed and env.is_main


def test_one_task_slurm_job_without_srun_is_a_single_process() -> None:
    env = detect({"SLURM_JOB_ID": "77", "SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": "gpu07", "SLURM_PROCID": "0"})
    assert (env.launcher, env.world_size, env.job_id, env.hostnames) == ("single", 1, "77", ("gpu07",))


def test_real_slurm_task_environment() -> None:
    env = detect(SLURM_TASK3)
    assert env == DistEnv(
        rank=3, local_rank=1, world_size=4, local_world_size=2, node_rank=1, num_nodes=2, master_addr="c1",
        master_port=default_port("22", "0"), launcher="slurm", hostnames=("c1", "c2"), job_id="22", step_id="0",
        restart_count=0, host="c2",
    )


def test_slurm_batch_step_that_forgot_srun_is_an_error_naming_the_fix() -> None:
    with pytest.raises(ValidationError, match="not an srun task") as err:
        detect(SLURM_BATCH)
    assert "srun python -m cyclone_kit.runtime" in err.value.hint


@pytest.mark.parametrize(
    ("nodelist", "tasks", "ntasks", "procid", "nodeid", "localid", "hosts", "local_world"),
    [
        ("gpu[01-04,07],cn[001-003]", "4(x5),2(x3)", 26, 23, 6, 1,
         ("gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "cn001", "cn002", "cn003"), 2),
        ("rack[1-2]-node[01-02]", "2(x4)", 8, 5, 2, 1, ("rack1-node01", "rack1-node02", "rack2-node01",
                                                         "rack2-node02"), 2),
        ("linux[1,2]", "3,1", 4, 3, 1, 0, ("linux1", "linux2"), 1),
        ("alpha,beta", "1(x2)", 2, 1, 1, 0, ("alpha", "beta"), 1),
        ("node64-[17-20]", "2(x3),1", 7, 6, 3, 0, ("node64-17", "node64-18", "node64-19", "node64-20"), 1),
        ("n[9-11]", "2,2,2", 6, 2, 1, 0, ("n9", "n10", "n11"), 2),
    ],
)
def test_slurm_hostlist_forms(nodelist: str, tasks: str, ntasks: int, procid: int, nodeid: int, localid: int,
                              hosts: tuple[str, ...], local_world: int) -> None:
    env = detect(slurm_task(nodelist, tasks, ntasks, procid, nodeid, localid))
    assert env.hostnames == hosts
    assert env.master_addr == hosts[0]
    assert env.num_nodes == len(hosts)
    assert env.local_world_size == local_world
    assert env.host == hosts[nodeid]
    assert (env.rank, env.world_size, env.node_rank, env.local_rank) == (procid, ntasks, nodeid, localid)


def test_slurm_step_variables_win_over_the_jobs() -> None:
    # A step on 2 of the job's 3 nodes, with 2 tasks each.
    environ = slurm_task("c[1-3]", "4(x3)", 12, 3, 1, 1, SLURM_STEP_NODELIST="c[2-3]",
                         SLURM_STEP_TASKS_PER_NODE="2(x2)", SLURM_STEP_NUM_TASKS="4")
    env = detect(environ)
    assert (env.world_size, env.num_nodes, env.hostnames, env.master_addr) == (4, 2, ("c2", "c3"), "c2")


def test_master_addr_and_port_from_the_environment_win() -> None:
    env = detect(slurm_task("c[1-2]", "1(x2)", 2, 1, 1, 0, MASTER_ADDR="10.0.0.5", MASTER_PORT="29500"))
    assert (env.master_addr, env.master_port) == ("10.0.0.5", 29500)


def test_submitit_slurm_executor_is_an_srun_task_labelled_submitit() -> None:
    env = detect({**slurm_task("c[1-2]", "2(x2)", 4, 2, 1, 0), "SUBMITIT_EXECUTOR": "slurm"})
    assert (env.launcher, env.rank, env.node_rank) == ("submitit", 2, 1)


def test_submitit_local_executor() -> None:
    env = detect({"SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_NTASKS": "3", "SUBMITIT_LOCAL_GLOBALID": "2",
                  "SUBMITIT_LOCAL_LOCALID": "2", "SUBMITIT_LOCAL_JOB_ID": "4242", "SUBMITIT_LOCAL_NODEID": "0",
                  "SUBMITIT_LOCAL_JOB_NUM_NODES": "1"})
    assert (env.launcher, env.rank, env.world_size, env.job_id) == ("submitit", 2, 3, "4242")
    assert env.master_port == default_port("4242")


def test_torchrun_outside_slurm() -> None:
    env = detect({"TORCHELASTIC_RUN_ID": "abc", "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8",
                  "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1", "MASTER_ADDR": "h0", "MASTER_PORT": "29400",
                  "TORCHELASTIC_RESTART_COUNT": "2"})
    assert env == DistEnv(rank=5, local_rank=1, world_size=8, local_world_size=4, node_rank=1, num_nodes=2,
                          master_addr="h0", master_port=29400, launcher="torchrun", restart_count=2)


def test_torchrun_inside_slurm_overrides_the_agent_task() -> None:
    # srun started one torchrun agent per node (task 1 of 2); torchrun started 4 workers there.
    environ = {**slurm_task("gpu[01-02]", "1(x2)", 2, 1, 1, 0, job="99", SLURM_RESTART_COUNT="1"),
               "TORCHELASTIC_RUN_ID": "99", "RANK": "6", "LOCAL_RANK": "2", "WORLD_SIZE": "8",
               "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1", "MASTER_ADDR": "gpu01", "MASTER_PORT": "15099"}
    env = detect(environ)
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.node_rank) == ("torchrun", 6, 8, 2, 1)
    assert (env.hostnames, env.job_id, env.restart_count, env.host) == (("gpu01", "gpu02"), "99", 1, "gpu02")


def test_open_mpi() -> None:
    env = detect({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                  "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "MASTER_ADDR": "gpu01"})
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.node_rank, env.num_nodes) == (
        "openmpi", 5, 8, 1, 1, 2)


def test_mpich_pmi_single_host() -> None:
    env = detect({"PMI_RANK": "1", "PMI_SIZE": "2"})
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.num_nodes, env.master_addr) == (
        "mpich", 1, 2, 1, 1, "127.0.0.1")


def test_mpich_with_local_ids() -> None:
    env = detect({"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2",
                  "MASTER_ADDR": "n1"})
    assert (env.node_rank, env.num_nodes, env.local_world_size) == (1, 2, 2)


def test_restart_count_from_slurm() -> None:
    env = detect(slurm_task("c1", "2", 2, 0, 0, 0, SLURM_RESTART_COUNT="3"))
    assert env.restart_count == 3


# ------------------------------------------------------------------------ ports
def test_default_port_is_unique_across_nearby_jobs_and_steps() -> None:
    pairs = list(itertools.product(range(5000, 5999), range(16)))
    ports = {default_port(str(j), str(s)) for j, s in pairs}
    assert len(ports) == len(pairs)
    assert all(PORT_BASE <= p < PORT_BASE + PORT_SPAN for p in ports)


def test_two_steps_of_one_job_get_different_ports() -> None:
    a = detect(slurm_task("c1", "2", 2, 0, 0, 0, job="31337", step="0"))
    b = detect(slurm_task("c1", "2", 2, 0, 0, 0, job="31337", step="1"))
    assert a.master_port != b.master_port


def test_non_numeric_ids_fall_back_to_base() -> None:
    assert default_port(None) == PORT_BASE
    assert default_port("batch", "extern") == PORT_BASE


# ------------------------------------------------------------------------ inconsistent environments
@pytest.mark.parametrize(
    ("environ", "match"),
    [
        (slurm_task("c[1-2]", "2(x2)", 3, 0, 0, 0), "adds up to 4 tasks but the step has 3"),
        (slurm_task("c[1-3]", "2(x2)", 4, 0, 0, 0), "lists 2 node"),
        (slurm_task("c[1-2]", "2(x2)", 4, 4, 1, 0), "rank 4 is outside world size 4"),
        (slurm_task("c[1-2]", "2(x2)", 4, 1, 0, 2), "local rank 2 is outside"),
        (slurm_task("c[1-2]", "2(x2)", 4, 1, 5, 0), "SLURM_NODEID=5"),
        (slurm_task("c[1-2", "2(x2)", 4, 1, 0, 1), "bad hostlist"),
        (slurm_task("c[1-2]", "2(y2)", 4, 1, 0, 1), "bad SLURM_TASKS_PER_NODE"),
        (slurm_task("c[1-2]", "2(x2)", 4, 1, 0, 1, MASTER_PORT="http"), "MASTER_PORT"),
        ({"RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}, "rank 2 is outside world size 2"),
        ({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "4"}, "not a multiple"),
        ({"RANK": "x", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
        ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
          "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, "MASTER_ADDR is not set"),
        ({"SLURM_JOB_ID": "5", "SLURM_NTASKS": "8"}, "not an srun task"),
    ],
)
def test_inconsistent_environments_raise_with_a_hint(environ: dict[str, str], match: str) -> None:
    with pytest.raises(ValidationError, match=match) as err:
        detect(environ)
    assert err.value.hint


def test_dist_env_is_frozen_and_serialisable() -> None:
    env = detect(SLURM_TASK3)
    with pytest.raises(AttributeError):
        env.rank = 0  # type: ignore[misc]
    assert json.loads(json.dumps(env.to_dict()))["hostnames"] == ["c1", "c2"]


# ------------------------------------------------------------------------ device choice (pure)
@pytest.mark.parametrize(
    ("local_rank", "usable", "count", "kind", "index"),
    [(0, True, 4, "cuda", 0), (5, True, 4, "cuda", 1), (3, True, 1, "cuda", 0), (1, False, 0, "cpu", None)],
)
def test_choose_device(local_rank: int, usable: bool, count: int, kind: str, index: int | None) -> None:
    d = choose_device(local_rank, usable, count, {})
    assert (d.kind, d.index, d.backend) == (kind, index, "nccl" if kind == "cuda" else "gloo")


def test_fake_gpus_fall_back_to_cpu_with_a_warning_only_when_allowed() -> None:
    """Issue 16 item 11: GPUs allocated but CUDA unusable is an error, unless CYCLONE_CPU_FALLBACK=1
    (the local test cluster's fake GPUs)."""
    d = choose_device(0, False, 0, {"CUDA_VISIBLE_DEVICES": "0,1,2,3", "CYCLONE_CPU_FALLBACK": "1"})
    assert d.kind == "cpu" and "CUDA_VISIBLE_DEVICES=0,1,2,3" in d.warning
    with pytest.raises(ValidationError, match=r"given GPUs \(CUDA_VISIBLE_DEVICES=0,1,2,3\)") as info:
        choose_device(0, False, 0, {"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    assert "\n" not in str(info.value) and "CYCLONE_CPU_FALLBACK=1" in info.value.hint
    assert choose_device(0, False, 0, {"CUDA_VISIBLE_DEVICES": ""}).kind == "cpu"  # no GPUs given: CPU, silently


#: (GPUs the task sees, ranks on the node, local rank) -> device index, or None = refused.
LAYOUTS = [
    (1, 4, 3, 0),      # --gpus-per-task=1 / --gpu-bind=single:1: each task's one GPU is device 0
    (4, 4, 3, 3),      # one task per GPU, every task sees the node's 4 GPUs (--gpu-bind=none)
    (4, 1, 0, 0),      # one process per node (torchrun agent's worker 0 / single GPU run)
    (8, 4, 2, 2),      # more GPUs than ranks: rank r on GPU r
    (4, 0, 5, 1),      # node size unknown: the old local_rank % count
    (2, 4, 0, None),   # --gpu-bind=closest, 2 GPUs per socket, 4 ranks: rank 0 and 2 would share GPU 0
    (2, 4, 3, None),
    (3, 4, 1, None),
]


@pytest.mark.parametrize(("count", "local_world", "local_rank", "expected"), LAYOUTS)
def test_device_layouts(count: int, local_world: int, local_rank: int, expected: int | None) -> None:
    if expected is None:
        with pytest.raises(ValidationError, match=f"sees {count} GPUs but its node runs {local_world} ranks"):
            choose_device(local_rank, True, count, {}, local_world_size=local_world)
    else:
        d = choose_device(local_rank, True, count, {}, local_world_size=local_world)
        assert (d.kind, d.index) == ("cuda", expected)


@pytest.mark.parametrize(("capability", "native"), [((7, 0), False), ((7, 5), False), ((8, 0), True), ((9, 0), True)])
def test_auto_precision_is_fp16_below_sm80_and_bf16_from_it(capability: tuple[int, int], native: bool) -> None:
    """Item 1: torch.cuda.is_bf16_supported() is True on a V100 (emulation); the choice uses native bf16."""
    from cyclone_kit.runtime.dist import DeviceChoice
    from cyclone_kit.runtime.engine.plan import resolve_precision

    d = DeviceChoice("cuda", 0, "gpu", "nccl", capability=capability)
    assert d.native_bf16 is native
    assert resolve_precision("auto", "cuda", d.native_bf16) == ("bf16" if native else "fp16")
    assert resolve_precision("bf16", "cuda", d.native_bf16) == ("bf16" if native else "fp16")
    assert not DeviceChoice("cpu", None, "cpu", "gloo").native_bf16


CU130_ARCHS = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]  # torch 2.14.1+cu130, as the venv lists
CU126_ARCHS = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]


@pytest.mark.parametrize(("capability", "archs", "ok"), [
    ((7, 0), CU130_ARCHS, False), ((7, 0), CU126_ARCHS, True), ((8, 9), CU130_ARCHS, True),  # sm_86 cubin runs on 8.9
    ((9, 0), CU130_ARCHS, True), ((7, 0), ["sm_80", "compute_70"], True), ((12, 1), CU126_ARCHS, False),
])
def test_arch_supported(capability: tuple[int, int], archs: list[str], ok: bool) -> None:
    from cyclone_kit.runtime.dist import arch_supported

    assert arch_supported(capability, archs) is ok


def test_v100_with_a_cu130_torch_is_refused_naming_the_cu126_index() -> None:
    from cyclone_kit.runtime.dist import check_arch

    with pytest.raises(ValidationError) as info:
        check_arch((7, 0), CU130_ARCHS, "Tesla V100-SXM2-32GB", "2.14.1+cu130")
    err = info.value
    assert "\n" not in str(err) and "sm_70" in str(err) and "Tesla V100" in str(err)
    assert "https://download.pytorch.org/whl/cu126" in err.hint
    check_arch((7, 0), CU126_ARCHS, "Tesla V100", "2.14.1+cu126")  # no error


def test_cpus_per_task() -> None:
    assert cpus_per_task({"SLURM_CPUS_PER_TASK": "10", "OMP_NUM_THREADS": "2"}) == 10
    assert cpus_per_task({"OMP_NUM_THREADS": "2"}) == 2
    assert cpus_per_task({}) is None


# ------------------------------------------------------------------------ the env command






@pytest.mark.parametrize(("environ", "expected"), [
    ({"SLURM_CPUS_PER_TASK": "10"}, 10),
    ({"OMP_NUM_THREADS": "3"}, 3),
    ({}, None),
    ({"SLURM_CPUS_PER_TASK": "40", "TORCHELASTIC_RUN_ID": "7", "LOCAL_WORLD_SIZE": "4"}, 10),
    ({"SLURM_CPUS_PER_TASK": "2", "TORCHELASTIC_RUN_ID": "7", "LOCAL_WORLD_SIZE": "4"}, 1),
    ({"OMP_NUM_THREADS": "1", "TORCHELASTIC_RUN_ID": "7", "LOCAL_WORLD_SIZE": "4"}, 1),
])
def test_cpus_per_task_shares_a_torchrun_task_between_its_workers(environ, expected):
    from cyclone_kit.runtime.dist import cpus_per_task

    assert cpus_per_task(environ) == expected


def test_worker_cpus_falls_back_to_the_affinity_shared_by_the_nodes_ranks() -> None:
    """No --cpus-per-task declared: 40 cores of affinity and 4 ranks give each rank 10 (not 1)."""
    assert worker_cpus({"SLURM_CPUS_PER_TASK": "10"}, 4, affinity=40) == 10  # declared wins
    assert worker_cpus({}, 4, affinity=40) == 10
    assert worker_cpus({}, 8, affinity=4) == 1  # never 0
    assert worker_cpus({}, 1) >= 1  # the real probe
