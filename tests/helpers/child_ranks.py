"""N real gloo ranks of a small child script (``python -c SCRIPT RANK PORT ...``) and their environment."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping

#: Hang guard for a child rank (not a performance bound): tiny children take ~10 s here.
RANK_TIMEOUT_S = 240


def free_port() -> int:
    """A free TCP port for a rendezvous on this host, as the product's local launcher picks it (below the kernel's
    ephemeral range, which other processes' connections take from at any moment)."""
    from cyclone_kit.core.ports import free_local_port

    return free_local_port()


def child_env(**extra: str) -> dict[str, str]:
    """This environment without any launcher's variables, one thread, no GPU, plus ``extra``."""
    drop = ("SLURM_", "OMPI_", "PMI_", "SUBMITIT_", "TORCHELASTIC_", "HOROVOD_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)
           and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": "", **extra}


def run_child_ranks(script: str, world: int, *args: str, env: Mapping[str, str] | None = None) -> list[str]:
    """Run ``python -c script RANK PORT *args`` as ``world`` ranks; their stdouts (each must exit 0)."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r), str(port), *args], env=dict(env or child_env()),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    outs = []
    try:
        for r, p in enumerate(procs):
            out, err = p.communicate(timeout=RANK_TIMEOUT_S)
            assert p.returncode == 0, f"rank {r} exited {p.returncode}: {err[-3000:]}"
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs
