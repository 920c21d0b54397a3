"""Device choice, threads and the process group (torch is imported inside functions only).

* Device (:func:`device_index`, a table in the tests): ``cuda:0`` when a task sees one GPU
  (``--gpus-per-task=1``, ``--gpu-bind=single:1``), ``cuda:local_rank`` when it sees at least
  as many GPUs as its node has ranks; any other layout (e.g. 2 visible GPUs for 4 ranks after
  ``--gpu-bind=closest``) is refused, since ``local_rank % count`` would put two ranks on one
  GPU. A job that was given GPUs (``CUDA_VISIBLE_DEVICES``) but finds CUDA unusable fails,
  unless ``CYCLONE_CPU_FALLBACK=1`` (the local test cluster's fake GPUs) allows the CPU.
* A GPU whose compute capability the installed torch has no kernels for (V100 = sm_70 with
  the cu128/cu130 wheels) is refused with the wheel index to use (:func:`check_arch`).
* Backend: NCCL on CUDA, gloo on CPU; timeout from ``train.pg_timeout_s`` so a dead peer makes
  every rank fail instead of hang. :func:`side_group` is a gloo group for small host-side
  collectives (checkpoint barriers, object gathers) that must not sit in NCCL's watchdog;
  :func:`background_group` one for a background thread's collectives (asynchronous sharded checkpoints).
* Threads: ``SLURM_CPUS_PER_TASK``, else ``OMP_NUM_THREADS``.
"""

from __future__ import annotations

import datetime
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cyclone_kit.core.errors import ValidationError
from cyclone_kit.runtime.env import DistEnv

#: Set to 1 to let a job whose CUDA_VISIBLE_DEVICES names GPUs train on the CPU (fake GPUs in tests).
CPU_FALLBACK_VAR = "CYCLONE_CPU_FALLBACK"


@dataclass(frozen=True)
class DeviceChoice:
    """The device a rank trains on.

    Attributes:
        kind: ``"cuda"`` or ``"cpu"``.
        index: CUDA device index (None on CPU).
        name: human name (GPU model, or the CPU's).
        backend: ``"nccl"`` or ``"gloo"``.
        warning: why the CPU was chosen although GPUs were allocated ("" otherwise).
        capability: CUDA compute capability (major, minor); None on CPU or when unknown.
    """

    kind: str
    index: int | None
    name: str
    backend: str
    warning: str = ""
    capability: tuple[int, int] | None = None

    @property
    def native_bf16(self) -> bool:
        """bf16 runs natively (compute capability 8.0+, Ampere on); below it torch only emulates it."""
        return self.kind == "cuda" and self.capability is not None and self.capability >= (8, 0)

    @property
    def torch_device(self) -> str:
        """The torch device string (``cuda:1``, ``cpu``)."""
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index}"


def device_index(local_rank: int, device_count: int, local_world_size: int = 0) -> int:
    """The CUDA device of a rank that sees ``device_count`` GPUs on a node running
    ``local_world_size`` ranks (0: unknown) (pure).

    Raises:
        ValidationError: the task sees several GPUs but fewer than the node's ranks.
    """
    if device_count == 1:
        return 0
    if local_world_size <= 0 or device_count >= local_world_size:
        return local_rank % device_count
    raise ValidationError(
        f"this task sees {device_count} GPUs but its node runs {local_world_size} ranks: local rank {local_rank} "
        f"cannot tell which GPU is its own (two ranks would share one)",
        hint="give each task one GPU (--gpus-per-task=1 or --gpu-bind=single:1) or all of the node's GPUs "
             "(--gpu-bind=none), not --gpu-bind=closest with several tasks per socket",
    )


def choose_device(
    local_rank: int,
    cuda_usable: bool,
    device_count: int,
    environ: Mapping[str, str],
    gpu_name: str = "",
    cpu_name: str = "cpu",
    local_world_size: int = 0,
    capability: tuple[int, int] | None = None,
) -> DeviceChoice:
    """Pick the device of a rank (pure): ``cuda:`` :func:`device_index` or the CPU.

    Raises:
        ValidationError: a layout :func:`device_index` refuses, or GPUs were allocated
            (``CUDA_VISIBLE_DEVICES``) but CUDA is unusable and ``CYCLONE_CPU_FALLBACK`` is not 1.
    """
    if cuda_usable and device_count > 0:
        index = device_index(local_rank, device_count, local_world_size)
        return DeviceChoice("cuda", index, gpu_name or "cuda", "nccl", capability=capability)
    visible = environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    warning = ""
    if visible and visible not in ("-1", "none", "NoDevFiles"):
        why = "no CUDA device found" if cuda_usable or device_count == 0 else "CUDA unavailable"
        if environ.get(CPU_FALLBACK_VAR, "").strip() != "1":
            raise ValidationError(
                f"this job was given GPUs (CUDA_VISIBLE_DEVICES={visible}) but CUDA is not usable here ({why})",
                hint="check the driver (nvidia-smi) and that torch is a CUDA build (torch.version.cuda); "
                     f"set {CPU_FALLBACK_VAR}=1 only to train on the CPU on purpose",
            )
        warning = f"CUDA_VISIBLE_DEVICES={visible} but CUDA is not usable here ({why}); training on the CPU with gloo"
    return DeviceChoice("cpu", None, cpu_name, "gloo", warning)


def wheel_index(capability: tuple[int, int]) -> str:
    """The PyTorch wheel index (CUDA flavour) whose builds carry kernels for ``capability`` (pure):
    cu126 up to Volta (sm_50..sm_90 incl. sm_70; the cu128/cu130 wheels dropped sm_70),
    cu130 for Blackwell and newer, cu128 in between."""
    if capability < (7, 5):
        return "cu126"
    if capability >= (10, 0):
        return "cu130"
    return "cu128"


def arch_supported(capability: tuple[int, int], arch_list: list[str]) -> bool:
    """Whether a torch built for ``arch_list`` (``torch.cuda.get_arch_list()``) runs on a GPU of
    ``capability`` (pure): a cubin ``sm_XY`` of the same major and a minor <= the GPU's, or PTX
    ``compute_XY`` of an older-or-equal capability (JIT-compiled by the driver)."""
    for arch in arch_list:
        kind, _, digits = arch.partition("_")
        digits = digits.rstrip("af")
        if not digits.isdigit() or len(digits) < 2:
            continue
        cap = (int(digits[:-1]), int(digits[-1]))
        if kind == "sm" and cap[0] == capability[0] and cap[1] <= capability[1]:
            return True
        if kind == "compute" and cap <= capability:
            return True
    return False


def check_arch(capability: tuple[int, int], arch_list: list[str], gpu_name: str, torch_version: str) -> None:
    """Refuse a GPU the installed torch has no kernels for (pure; one line naming the wheel index).

    Raises:
        ValidationError: ``capability`` is not covered by ``arch_list``.
    """
    if not arch_list or arch_supported(capability, arch_list):
        return
    sm = f"sm_{capability[0]}{capability[1]}"
    index = wheel_index(capability)
    raise ValidationError(
        f"torch {torch_version} has no kernels for the {gpu_name} ({sm}); it was built for "
        f"{', '.join(a for a in arch_list if a.startswith('sm_'))}",
        hint=f"install a torch built for {sm}: pip install torch torchvision --index-url "
             f"https://download.pytorch.org/whl/{index}",
    )


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
    capability = None
    if usable and count:
        index = device_index(env.local_rank, count, env.local_world_size)
        name = torch.cuda.get_device_name(index)
        capability = tuple(torch.cuda.get_device_capability(index))
        check_arch(capability, torch.cuda.get_arch_list(), name, torch.__version__)  # type: ignore[arg-type]
    return choose_device(env.local_rank, usable, count, environ, gpu_name=name, cpu_name=cpu_name(),
                         local_world_size=env.local_world_size, capability=capability)  # type: ignore[arg-type]


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


def init_process_group(env: DistEnv, device: DeviceChoice, timeout_s: int, backend: str | None = None) -> bool:
    """Join the process group (TCP rendezvous at master_addr:master_port).

    A world of one process needs no group and gets none (returns False). On CUDA the device
    is selected first. NCCL's asynchronous error handling is torch's own default (mode 3,
    SkipCleanUp: the watchdog tears the process down after ``timeout_s`` without calling
    ``ncclCommAbort``, which torch warns can itself hang); the mode 1 this used to force does call
    it. A ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` the job sets is left as it is. ``backend`` overrides the device's (Horovod's side
    channel is gloo even on GPUs: Horovod moves the gradients, a second NCCL world would only
    take GPU memory and NCCL's watchdog).

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

    backend = backend or device.backend
    if device.kind == "cuda":
        torch.cuda.set_device(device.index)
    kwargs: dict[str, Any] = {}
    if device.kind == "cuda" and backend == "nccl":
        kwargs["device_id"] = torch.device(device.torch_device)
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{_bracket(env.master_addr)}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **kwargs,
    )
    _SIDE.clear()
    if dist.get_backend() != "gloo":  # every rank creates it here, in the same order (new_group is collective)
        _SIDE.append(dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)))
    return True


_SIDE: list[Any] = []


def group_timeout_s(kind: str) -> float | None:
    """The timeout (seconds) of the default process group's backend for device ``kind`` (``"cpu"`` or
    ``"cuda"``): what a group the script made (torchrun + ``init_process_group``, Lightning, Accelerate) waits
    in a collective before it fails. None when no group exists or torch does not say (the backend's options
    are torch's private API: gloo's and NCCL's ``options._timeout`` in torch 2.x)."""
    try:
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        group = dist.distributed_c10d._get_default_group()
        seconds = group._get_backend(torch.device(kind)).options._timeout.total_seconds()
    except Exception:  # a torch without these private members, or no backend for the device: unknown
        return None
    return float(seconds) if seconds > 0 else None


def side_group() -> Any:
    """A gloo group over all ranks for host-side collectives (barriers while rank 0 writes a
    checkpoint, object gathers): the world group itself when it is gloo, else the gloo group
    :func:`init_process_group` made. None (the default group) outside a process group."""
    return _SIDE[0] if _SIDE else None


_BACKGROUND: list[Any] = []  # [(the world group it was made in, the group)]


def background_group() -> Any:
    """A gloo group over all ranks that only a background thread uses (torch.distributed.checkpoint's
    ``async_save`` plans and confirms its writes there), so its collectives never interleave with the
    training's, the stop agreement's or :func:`side_group`'s, which the main thread issues meanwhile.

    Made at the first call in this process group (``new_group`` is a collective: every rank calls it at
    the same point, e.g. its first asynchronous sharded checkpoint) and reused after. Its timeout is
    torch's default for gloo (30 min), not ``train.pg_timeout_s``: the coordinator waits in it for the
    slowest rank's write; a dead peer still fails it at once (its sockets close).
    """
    import torch.distributed as dist

    world = dist.group.WORLD
    if not _BACKGROUND or _BACKGROUND[0][0] is not world:
        _BACKGROUND.clear()
        _BACKGROUND.append((world, dist.new_group(backend="gloo")))
    return _BACKGROUND[0][1]


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
