"""The Slurm-like environment of a rank on this machine (pure): what ``srun`` would give it.

The local launcher's own variables (SLURM_PROCID & co., the rendezvous, threads) are
:mod:`cyclone_kit.launchers.local`'s; here they are laid on this process's environment, cleaned of
an enclosing launcher's variables, beside this machine's cores, GPUs, a free port and a fake job
id. Used by the srun emulator and by the submitit backend's local executor.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cyclone_kit.core.errors import ValidationError
from cyclone_kit.core.malloc import malloc_environment
from cyclone_kit.core.ports import free_local_port
from cyclone_kit.launchers import LOCAL
from cyclone_kit.launchers.local import fake_hosts, nodelist_string, tasks_per_node_string

__all__ = ["FOREIGN_NAMES", "FOREIGN_PREFIXES", "available_cores", "clean_environment", "fake_hosts", "free_port",
           "gpu_slices", "launcher_variables", "new_job_id", "nodelist_string", "rank_environments", "tasks_per_node_string",
           "threads_per_rank", "visible_gpus", "working_directory"]

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
    """The environment of every rank, as srun would set it for ``nodes`` x ``nproc/nodes`` tasks (pure
    but for the working directory when ``submit_dir`` is None): ``base`` without an enclosing
    launcher's variables, the malloc settings, and the local launcher's
    (:meth:`~cyclone_kit.launchers.registry.LocalLauncher.rank_variables`) on top.

    Raises:
        ValidationError: ``nproc`` is not a positive multiple of ``nodes``.
    """
    ours = LOCAL.rank_variables(nproc, nodes, job_id=job_id, master_port=master_port, threads=threads,
                                run_dir=run_dir, job_name=job_name, submit_dir=submit_dir or os.getcwd())
    below = {**clean_environment(base or {}), **malloc_environment(base or {})}
    return [{**below, **variables} for variables in ours]


def launcher_variables(
    nproc: int,
    nodes: int,
    *,
    job_id: str,
    master_port: int | str,
    threads: int,
    run_dir: Path | str,
    job_name: str,
    submit_dir: str,
    base: Mapping[str, str],
    extra_env: Mapping[str, str] | None = None,
) -> list[dict[str, str]]:
    """Every variable the local launcher sets on each rank, and nothing of ``base`` but what it decides:
    the local launcher's own (:meth:`~cyclone_kit.launchers.registry.LocalLauncher.rank_variables`),
    the malloc default unless ``base`` sets it, ``extra_env``, and each pretend node's share of the
    GPUs ``base`` shows (``CUDA_VISIBLE_DEVICES``). A rank's environment is ``base`` cleaned of an
    enclosing launcher's variables with these on top.

    Raises:
        ValidationError: ``nproc`` is not a positive multiple of ``nodes``, or more ranks than GPUs.
    """
    ours = LOCAL.rank_variables(nproc, nodes, job_id=job_id, master_port=master_port, threads=threads,
                                run_dir=run_dir, job_name=job_name, submit_dir=submit_dir)
    extra = dict(extra_env or {})
    out = [{**malloc_environment(base), **v, **extra} for v in ours]
    slices = gpu_slices(visible_gpus({**base, **extra}), nproc, nodes)
    if slices is not None:  # each pretend node its own GPUs
        out = [{**v, "CUDA_VISIBLE_DEVICES": slices[int(v["SLURM_NODEID"])]} for v in out]
    return out


def working_directory(spec: Any) -> str | None:
    """A script job's working directory (``script.chdir``: where it was submitted, or ``--chdir``); None: ours (pure)."""
    script = getattr(spec, "script", None)
    return (script.chdir or None) if script is not None else None


def free_port() -> int:
    """A TCP port for the ranks' rendezvous that nobody holds right now, outside the kernel's ephemeral range
    (:func:`cyclone_kit.core.ports.free_local_port`)."""
    return free_local_port()


def new_job_id() -> str:
    """A fake, numeric Slurm job id for a local run (``9`` + 8 random digits)."""
    return str(900_000_000 + secrets.randbelow(100_000_000))
