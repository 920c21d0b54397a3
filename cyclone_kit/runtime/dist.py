"""Device choice, threads and the process group (torch is imported inside functions only).

* Device: ``cuda:(local_rank % visible devices)`` when CUDA is usable, which is right both
  for one task per node seeing all GPUs and for ``--gpus-per-task`` (each task sees one GPU as
  device 0); otherwise the CPU, with a warning when GPUs were allocated but CUDA is unusable
  (e.g. the fake GPUs of the local test cluster).
* Backend: NCCL on CUDA, gloo on CPU; timeout from ``train.pg_timeout_s`` so a dead peer makes
  every rank fail instead of hang.
* Threads: ``SLURM_CPUS_PER_TASK``, else ``OMP_NUM_THREADS``.
"""

from __future__ import annotations

import datetime
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cyclone_kit.runtime.env import DistEnv


@dataclass(frozen=True)
class DeviceChoice:
    """The device a rank trains on.

    Attributes:
        kind: ``"cuda"`` or ``"cpu"``.
        index: CUDA device index (None on CPU).
        name: human name (GPU model, or the CPU's).
        backend: ``"nccl"`` or ``"gloo"``.
        warning: why the CPU was chosen although GPUs were allocated ("" otherwise).
    """

    kind: str
    index: int | None
    name: str
    backend: str
    warning: str = ""

    @property
    def torch_device(self) -> str:
        """The torch device string (``cuda:1``, ``cpu``)."""
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index}"


def choose_device(
    local_rank: int,
    cuda_usable: bool,
    device_count: int,
    environ: Mapping[str, str],
    gpu_name: str = "",
    cpu_name: str = "cpu",
) -> DeviceChoice:
    """Pick the device of a rank (pure): ``cuda:(local_rank % device_count)`` or the CPU."""
    if cuda_usable and device_count > 0:
        return DeviceChoice("cuda", local_rank % device_count, gpu_name or "cuda", "nccl")
    visible = environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    warning = ""
    if visible and visible not in ("-1", "none", "NoDevFiles"):
        warning = (
            f"CUDA_VISIBLE_DEVICES={visible} but CUDA is not usable here "
            f"({'no CUDA device found' if cuda_usable or device_count == 0 else 'CUDA unavailable'}); "
            "training on the CPU with gloo"
        )
    return DeviceChoice("cpu", None, cpu_name, "gloo", warning)


def probe_device(env: DistEnv, environ: Mapping[str, str]) -> DeviceChoice:
    """Import torch and choose the device of this rank (see :func:`choose_device`)."""
    import torch

    usable = False
    count = 0
    try:
        usable = torch.cuda.is_available()
        count = torch.cuda.device_count() if usable else 0
    except Exception:  # a broken driver must not stop a CPU run
        usable = False
    name = ""
    if usable and count:
        name = torch.cuda.get_device_name(env.local_rank % count)
    return choose_device(env.local_rank, usable, count, environ, gpu_name=name, cpu_name=cpu_name())


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo, else the platform's processor string."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "cpu"


def cpus_per_task(environ: Mapping[str, str]) -> int | None:
    """Cores this rank may use: SLURM_CPUS_PER_TASK, else OMP_NUM_THREADS, else None (pure).

    Under torchrun inside Slurm one task holds every worker of the node, so its
    SLURM_CPUS_PER_TASK is shared by LOCAL_WORLD_SIZE processes (4 workers x 40 threads on 40
    cores would oversubscribe the node 4x).
    """
    for key in ("SLURM_CPUS_PER_TASK", "OMP_NUM_THREADS"):
        raw = environ.get(key, "").strip()
        if raw.isdigit() and int(raw) > 0:
            n = int(raw)
            local = environ.get("LOCAL_WORLD_SIZE", "").strip()
            if key == "SLURM_CPUS_PER_TASK" and "TORCHELASTIC_RUN_ID" in environ and local.isdigit() and int(local) > 0:
                n = max(1, n // int(local))
            return n
    return None


def worker_cpus(environ: Mapping[str, str], local_world_size: int, affinity: int | None = None) -> int:
    """Cores this rank may feed DataLoader workers from: :func:`cpus_per_task` when the launcher
    says, else this process's CPU affinity (``os.sched_getaffinity``; Slurm's cgroup/cpuset shows
    there) shared by the ranks of the node. ``affinity`` overrides the probe (tests)."""
    declared = cpus_per_task(environ)
    if declared is not None:
        return declared
    if affinity is None:
        affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, affinity // max(1, local_world_size))


def setup_threads(environ: Mapping[str, str]) -> int:
    """Set torch's intra-op threads from :func:`cpus_per_task`; returns the count in use."""
    import torch

    n = cpus_per_task(environ)
    if n is not None and torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return torch.get_num_threads()


def init_process_group(env: DistEnv, device: DeviceChoice, timeout_s: int) -> bool:
    """Join the process group (TCP rendezvous at master_addr:master_port).

    A world of one process needs no group and gets none (returns False). On CUDA the device
    is selected first and NCCL's asynchronous error handling is on, so a dead peer raises
    after ``timeout_s`` rather than hanging.

    Returns:
        True when a process group was created.
    """
    if not env.is_distributed:
        if device.kind == "cuda":
            import torch

            torch.cuda.set_device(device.index)
        return False
    import torch
    import torch.distributed as dist

    if device.kind == "cuda":
        torch.cuda.set_device(device.index)
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    kwargs: dict[str, Any] = {}
    if device.kind == "cuda":
        kwargs["device_id"] = torch.device(device.torch_device)
    dist.init_process_group(
        backend=device.backend,
        init_method=f"tcp://{_bracket(env.master_addr)}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **kwargs,
    )
    return True


def teardown() -> None:
    """Destroy the process group if one exists (clean shutdown after a successful run)."""
    try:
        import torch.distributed as dist
    except ImportError:
        return
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def warn(message: str) -> None:
    """Print a one-line runtime warning on stderr."""
    sys.stderr.write(f"cyclone_kit: warning: {message}\n")
    sys.stderr.flush()


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
