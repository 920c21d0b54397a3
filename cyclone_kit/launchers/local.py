"""The local launcher's rank variables (pure): what ``srun`` would set for each rank on this machine.

SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID, SLURM_NTASKS, SLURM_JOB_NODELIST,
SLURM_TASKS_PER_NODE in its ``2(x2)`` form, SLURM_STEP_ID, a fake SLURM_JOB_ID, plus
MASTER_ADDR and a free MASTER_PORT, so the runtime takes the very bootstrap path it takes
under Slurm. All "nodes" are this host: one node is ``localhost``, several are ``127.0.0.1``,
``127.0.0.2`` ... Only the variables the launcher sets: the base environment they are laid on
(cleaned of an enclosing launcher's variables) is :mod:`cyclone_kit.backends.local_env`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from cyclone_kit.core.errors import ValidationError

#: The variable that names, on every rank, the launcher that started it.
LAUNCHER_VARIABLE = "CYCLONE_LAUNCHER"


def fake_hosts(nodes: int) -> list[str]:
    """Host names for ``nodes`` pretend nodes of this machine: all resolve to loopback (pure)."""
    if nodes == 1:
        return ["localhost"]
    return [f"127.0.0.{i + 1}" for i in range(nodes)]


def nodelist_string(hosts: Sequence[str]) -> str:
    """The hosts as a Slurm hostlist (``localhost`` or ``127.0.0.[1-2]``; pure)."""
    if len(hosts) == 1:
        return hosts[0]
    if all(h.startswith("127.0.0.") for h in hosts):
        last = [int(h.rsplit(".", 1)[1]) for h in hosts]
        if last == list(range(last[0], last[0] + len(last))):
            return f"127.0.0.[{last[0]}-{last[-1]}]"
    return ",".join(hosts)


def tasks_per_node_string(per_node: int, nodes: int) -> str:
    """SLURM_TASKS_PER_NODE for an even layout: ``2`` or ``2(x3)`` (pure)."""
    return str(per_node) if nodes == 1 else f"{per_node}(x{nodes})"


def rank_variables(
    nproc: int,
    nodes: int,
    *,
    job_id: str,
    master_port: int | str,
    threads: int,
    run_dir: Path | str,
    job_name: str,
    submit_dir: str,
    launcher: str,
) -> list[dict[str, str]]:
    """The variables of every rank, as srun would set them for ``nodes`` x ``nproc/nodes`` tasks (pure).

    ``launcher`` is the launcher's name, exported as ``CYCLONE_LAUNCHER`` (the shim records it).

    Raises:
        ValidationError: ``nproc`` is not a positive multiple of ``nodes``.
    """
    if nodes < 1 or nproc < 1:
        raise ValidationError(f"--nproc={nproc} --nodes={nodes}: both must be at least 1", hint="e.g. --nproc 2")
    if nproc % nodes:
        raise ValidationError(
            f"--nproc={nproc} does not split evenly over --nodes={nodes}",
            hint=f"use --nproc as a multiple of {nodes}, e.g. --nproc {nodes * max(1, nproc // nodes)}",
        )
    per_node = nproc // nodes
    hosts = fake_hosts(nodes)
    nodelist = nodelist_string(hosts)
    tpn = tasks_per_node_string(per_node, nodes)
    common = {
        "SLURM_JOB_ID": job_id,
        "SLURM_JOBID": job_id,
        "SLURM_JOB_NAME": job_name,
        "SLURM_JOB_NODELIST": nodelist,
        "SLURM_NODELIST": nodelist,
        "SLURM_JOB_NUM_NODES": str(nodes),
        "SLURM_NNODES": str(nodes),
        "SLURM_NTASKS": str(nproc),
        "SLURM_NPROCS": str(nproc),
        "SLURM_NTASKS_PER_NODE": str(per_node),
        "SLURM_TASKS_PER_NODE": tpn,
        "SLURM_JOB_CPUS_PER_NODE": tasks_per_node_string(per_node * threads, nodes),
        "SLURM_CPUS_PER_TASK": str(threads),
        "SLURM_STEP_ID": "0",
        "SLURM_STEPID": "0",
        "SLURM_STEP_NODELIST": nodelist,
        "SLURM_STEP_NUM_NODES": str(nodes),
        "SLURM_STEP_NUM_TASKS": str(nproc),
        "SLURM_STEP_TASKS_PER_NODE": tpn,
        "SLURM_SUBMIT_DIR": submit_dir,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port),
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        # torch.compile's worker pool: torch sizes it by the CPUs the process may run on, which srun's binding
        # makes the task's own; here every rank sees every core, and each rank's pool of processes (each
        # importing torch) would be this machine's size (2 cores, 2 ranks: ~15 CPU-s more per rank for one
        # compile of the tiny CNN). 1 = compile in the rank's own process.
        "TORCHINDUCTOR_COMPILE_THREADS": str(threads),
        "PYTHONUNBUFFERED": "1",
        "CYCLONE_RUN_DIR": str(run_dir),
        LAUNCHER_VARIABLE: launcher,
    }
    out = []
    for rank in range(nproc):
        node = rank // per_node
        out.append({
            **common,
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank % per_node),
            "SLURM_NODEID": str(node),
            "SLURMD_NODENAME": hosts[node],
            "SLURM_TOPOLOGY_ADDR": hosts[node],
        })
    return out
