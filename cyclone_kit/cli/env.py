"""``env``: print the rank bootstrap this process would get (the first thing to run on a hang)."""

from __future__ import annotations

import argparse
import json
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cyclone_kit.runtime.dist import DeviceChoice
    from cyclone_kit.runtime.env import DistEnv


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``env``."""
    p = sub.add_parser(
        "env",
        help="show the detected rank, world size, rendezvous and device",
        description="Detect the distributed environment (torchrun, Slurm srun task, Open MPI, MPICH/PMI, "
        "submitit or a single process) from the current environment variables, as every rank of a "
        "training run does, and print it. Run it with srun inside a job to see what each task gets.",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Detect the DistEnv and device; print them as text or one JSON object."""
    from cyclone_kit.runtime.dist import cpus_per_task
    from cyclone_kit.runtime.env import detect

    env = detect(os.environ)
    device = _device(env)
    record = {
        **env.to_dict(),
        "host": env.host or socket.gethostname(),
        "device": device.torch_device,
        "device_kind": device.kind,
        "device_name": device.name,
        "backend": device.backend,
        "cpus_per_task": cpus_per_task(os.environ),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    if device.warning:
        record["warning"] = device.warning
    if args.json:
        print(json.dumps(record, sort_keys=False))
        return 0
    width = max(len(k) for k in record)
    for key, value in record.items():
        shown = ",".join(value) if isinstance(value, list) else ("-" if value is None else value)
        print(f"{key:<{width}}  {shown}")
    return 0


def _device(env: DistEnv) -> DeviceChoice:
    """The device choice; imports torch only where a GPU could exist."""
    from cyclone_kit.runtime.dist import choose_device, probe_device

    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    maybe_gpu = (visible not in ("", "-1")) or Path("/dev/nvidiactl").exists()
    if maybe_gpu:
        return probe_device(env, os.environ)
    return choose_device(env.local_rank, False, 0, os.environ)
