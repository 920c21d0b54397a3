"""The Slurm-like environment of a rank on this machine (pure): what ``srun`` would give it.

SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID, SLURM_NTASKS, SLURM_JOB_NODELIST,
SLURM_TASKS_PER_NODE in its ``2(x2)`` form, SLURM_STEP_ID, a fake SLURM_JOB_ID, plus
MASTER_ADDR and a free MASTER_PORT, so the runtime takes the very bootstrap path it takes
under Slurm. All "nodes" are this host: one node is ``localhost``, several are ``127.0.0.1``,
``127.0.0.2`` ... Used by the srun emulator and by the submitit backend's local executor.
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cyclone_kit.core.errors import ValidationError
from cyclone_kit.core.malloc import malloc_environment

#: Variables of an enclosing launcher that must not leak into the ranks (they would win detection).
FOREIGN_PREFIXES = ("SLURM_", "SLURMD_", "SBATCH_", "SRUN_", "SALLOC_", "OMPI_", "PMI_", "PMIX_", "SUBMITIT_",
                     "TORCHELASTIC_")


FOREIGN_NAMES = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                            "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "CYCLONE_RUN_DIR"})


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def threads_per_rank(nproc: int, cores: int) -> int:
    """Torch threads per rank: the cores shared evenly, at least 1 (pure)."""
    return max(1, cores // max(1, nproc))


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


def clean_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without an enclosing launcher's variables (Slurm, torchrun, MPI, submitit; pure)."""
    return {k: v for k, v in environ.items() if not k.startswith(FOREIGN_PREFIXES) and k not in FOREIGN_NAMES}


#: Where the NVIDIA driver lists this machine's GPUs (one folder each), read without importing torch.
NVIDIA_GPU_DIR = Path("/proc/driver/nvidia/gpus")


def visible_gpus(environ: Mapping[str, str], driver_dir: Path = NVIDIA_GPU_DIR) -> list[str]:
    """The GPUs ranks started from ``environ`` would see: ``CUDA_VISIBLE_DEVICES``'s entries when it
    is set (empty, ``-1`` or ``none``: no GPU), else one index per GPU the NVIDIA driver lists."""
    if "CUDA_VISIBLE_DEVICES" in environ:
        entries = [e.strip() for e in environ["CUDA_VISIBLE_DEVICES"].split(",") if e.strip()]
        return [] if not entries or entries[0] in ("-1", "none", "NoDevFiles") else entries
    try:
        count = sum(1 for _ in driver_dir.iterdir())
    except OSError:
        return []
    return [str(i) for i in range(count)]


def gpu_slices(gpus: Sequence[str], nproc: int, nodes: int) -> list[str] | None:
    """``CUDA_VISIBLE_DEVICES`` of each pretend node (pure): all of ``gpus`` for one node, a disjoint
    slice of ``nproc / nodes`` GPUs for each of several (they share this host's GPUs, and each
    rank takes ``cuda:LOCAL_RANK`` of its slice); None when there is no GPU.

    Raises:
        ValidationError: more ranks than GPUs: two ranks would take one GPU, which NCCL refuses
            ("Duplicate GPU detected").
    """
    if not gpus:
        return None
    if nproc > len(gpus):
        where = f"--nproc={nproc}" + (f" over --nodes={nodes}" if nodes > 1 else "")
        raise ValidationError(
            f"{where} needs {nproc} GPUs, but this machine shows {len(gpus)} (CUDA_VISIBLE_DEVICES "
            f"{','.join(gpus)}): ranks would share a GPU, which NCCL refuses ('Duplicate GPU detected')",
            hint=f"use --nproc {len(gpus)} or fewer (pretend nodes split this machine's GPUs), or --cpu to "
                 "train on the CPU with gloo",
        )
    if nodes == 1:
        return [",".join(gpus)]
    per_node = nproc // nodes
    return [",".join(gpus[k * per_node:(k + 1) * per_node]) for k in range(nodes)]


def rank_environments(
    nproc: int,
    nodes: int,
    *,
    job_id: str,
    master_port: int,
    threads: int,
    run_dir: Path | str,
    job_name: str = "cyclone",
    base: Mapping[str, str] | None = None,
    submit_dir: str | None = None,
) -> list[dict[str, str]]:
    """The environment of every rank, as srun would set it for ``nodes`` x ``nproc/nodes`` tasks (pure).

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
        **clean_environment(base or {}),
        **malloc_environment(base or {}),
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
        "SLURM_SUBMIT_DIR": submit_dir or os.getcwd(),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port),
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "PYTHONUNBUFFERED": "1",
        "CYCLONE_RUN_DIR": str(run_dir),
        "CYCLONE_LAUNCHER": "local",
    }
    envs = []
    for rank in range(nproc):
        node = rank // per_node
        envs.append({
            **common,
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank % per_node),
            "SLURM_NODEID": str(node),
            "SLURMD_NODENAME": hosts[node],
            "SLURM_TOPOLOGY_ADDR": hosts[node],
        })
    return envs


def working_directory(spec: Any) -> str | None:
    """A script job's working directory (``script.chdir``: where it was submitted, or ``--chdir``); None: ours (pure)."""
    script = getattr(spec, "script", None)
    return (script.chdir or None) if script is not None else None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def new_job_id() -> str:
    """A fake, numeric Slurm job id for a local run (``9`` + 8 random digits)."""
    return str(900_000_000 + secrets.randbelow(100_000_000))
