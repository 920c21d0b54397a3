"""Helpers of the engine tests: a spec in a run directory, N real gloo ranks of the trainer, their records."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from cyclone_kit.config.job import spec_from_dict, spec_to_dict
from cyclone_kit.config.toolbox import read_toml
from cyclone_kit.runtime import checkpoint as ck

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "jobs" / "smoke.toml"
#: The per-run hang guard of the rank processes (seconds).
TIMEOUT_S = 240


def free_port() -> int:
    """A free TCP port for a rendezvous on this host, as the product's local launcher picks it (below the kernel's
    ephemeral range, which other processes' connections take from at any moment)."""
    from cyclone_kit.core.ports import free_local_port

    return free_local_port()


def write_spec(run_dir: Path, checkpoint: dict[str, Any] | None = None, **train: Any) -> Path:
    """jobs/smoke.toml with ``train`` (and ``checkpoint``) overrides, resolved to run_dir/spec.json."""
    data = read_toml(SMOKE)
    data["train"] = {**data["train"], **train}
    data["checkpoint"] = {**data.get("checkpoint", {}), **(checkpoint or {})}
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "spec.json"
    path.write_text(json.dumps(spec_to_dict(spec_from_dict(data))))
    return path


def clean_env() -> dict[str, str]:
    drop = ("SLURM_", "OMPI_", "PMI_", "SUBMITIT_", "TORCHELASTIC_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)
           and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}


def start_ranks(run_dir: Path, world: int, env: dict[str, str] | None = None) -> list[subprocess.Popen[str]]:
    """Start ``world`` ranks of the runtime on run_dir (torchrun-style environment, plus ``env``)."""
    port = free_port()
    procs = []
    extra = dict(env or {})
    for rank in range(world):
        env = {**clean_env(), **extra}
        if world > 1:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, "-m", "cyclone_kit.runtime", "--run-dir", str(run_dir)],
                                      env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def finish(procs: list[subprocess.Popen[str]], timeout: float = TIMEOUT_S) -> list[tuple[int, str, str]]:
    """Wait for every rank (killing all on timeout); returns (exit code, stdout, stderr) per rank."""
    deadline = time.monotonic() + timeout
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def run_ranks(run_dir: Path, world: int) -> list[tuple[int, str, str]]:
    results = finish(start_ranks(run_dir, world))
    for rank, (code, out, err) in enumerate(results):
        assert code == 0, f"rank {rank} exited {code}\n{out}\n{err}"
    return results


def records(run_dir: Path, kind: str | None = None) -> list[dict[str, Any]]:
    """The records of ``run_dir``'s metrics file so far (of ``kind``): [] before the file exists, and a
    line still being written is skipped, so a test can poll it while the run goes on."""
    path = run_dir / "metrics.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # the line being written
        if kind is None or rec["kind"] == kind:
            out.append(rec)
    return out


def final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    state, _ = ck.load_latest(run_dir / "checkpoints")
    return state["model"]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def horovod_missing() -> str | None:
    try:
        import horovod.torch  # noqa: F401
    except Exception as exc:  # ImportError, or OSError from a broken extension
        return (f"'import horovod.torch' failed ({type(exc).__name__}: {exc}); "
                "build it with scripts/build-horovod.sh")
    return None
