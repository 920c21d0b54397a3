"""Helpers of the engine tests: a spec in a run directory, N real gloo ranks of the trainer, their records."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import torch

from cyclone_kit.config.job import spec_from_dict, spec_to_dict
from cyclone_kit.config.toolbox import read_toml
from cyclone_kit.core import prefork
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


class ForkedRank(prefork.Forked):
    """A rank forked by :mod:`cyclone_kit.core.prefork` (as the local launcher starts the trainer's ranks), with
    :class:`subprocess.Popen`'s ``communicate``: its stdout and stderr go to temporary files, read (as text)
    once it has ended."""

    def __init__(self, pid: int, out: IO[bytes], err: IO[bytes]) -> None:
        super().__init__(pid)
        self._out, self._err = out, err

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        texts = []
        for f in (self._out, self._err):
            f.seek(0)
            texts.append(f.read().decode(errors="replace"))
            f.close()
        return texts[0], texts[1]


def popen_ranks(target: list[str], envs: list[dict[str, str]], cwd: Path = REPO) -> list[Any]:
    """One process per environment running ``python TARGET`` (``[-m, MODULE, ARGS...]`` or ``[SCRIPT, ARGS...]``):
    forked from one process that imported torch (:mod:`cyclone_kit.core.prefork`, what the local launcher does
    for the trainer), or fresh ``subprocess.Popen`` ones with ``CYCLONE_PREFORK=0``. Popen-like, text output."""
    return popen_group([(target, env) for env in envs], cwd)


def popen_group(starts: list[tuple[list[str], dict[str, str]]], cwd: Path = REPO, stdin: list[int] | None = None,
                preload: Sequence[str] = prefork.PRELOAD) -> list[Any]:
    """:func:`popen_ranks` for processes with targets of their own (several runs' ranks), all forked from one
    process. What a library reads at import (``TORCH_DISTRIBUTED_DEBUG``: torch.distributed) is the first
    environment's: group only processes that agree on it. ``stdin``: each process's stdin, a descriptor of
    this process (a pipe's read end, which the caller may close once this returns); default: ``/dev/null``
    when forked, this process's stdin when not. ``preload``: what the forking process imports (the launcher's
    by default)."""
    files = [(tempfile.TemporaryFile(), tempfile.TemporaryFile()) for _ in starts]  # noqa: SIM115 (closed by communicate)
    inputs = stdin if stdin is not None else [None] * len(starts)
    ranks = []
    for (target, env), (out, err), fd in zip(starts, files, inputs, strict=True):
        module, script = (target[1], None) if target[0] == "-m" else (None, target[0])
        ranks.append(prefork.RankStart(args=tuple(target[2:] if module else target[1:]), env=env, module=module,
                                       script=script, cwd=str(cwd), stdout=out.fileno(), stderr=err.fileno(),
                                       stdin=fd, new_session=False))
    forked = prefork.spawn(ranks, cwd=str(cwd), preload=preload)
    if forked is not None:
        return [ForkedRank(proc.pid, out, err) for proc, (out, err) in zip(forked, files, strict=True)]
    for out, err in files:
        out.close()
        err.close()
    return [subprocess.Popen([sys.executable, *target], env=env, cwd=cwd, stdin=fd, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for (target, env), fd in zip(starts, inputs, strict=True)]


def rank_envs(world: int, extra: dict[str, str] | None = None) -> list[dict[str, str]]:
    """The torchrun-style environments of ``world`` ranks on this host (none for a world of one), plus ``extra``."""
    port = free_port()
    envs = []
    for rank in range(world):
        env = {**clean_env(), **(extra or {})}
        if world > 1:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        envs.append(env)
    return envs


def start_ranks(run_dir: Path, world: int, env: dict[str, str] | None = None) -> list[Any]:
    """Start ``world`` ranks of the runtime on run_dir (torchrun-style environment, plus ``env``), forked as the
    local launcher forks them (:func:`popen_ranks`)."""
    return popen_ranks(["-m", "cyclone_kit.runtime", "--run-dir", str(run_dir)], rank_envs(world, env))


def start_runs(runs: list[tuple[Path, int]], env: dict[str, str] | None = None) -> list[Any]:
    """:func:`start_ranks` for several runs at once (each ``(run_dir, world)``), all their ranks forked from one
    process (:func:`popen_group`): one import of torch for the lot. The ranks in the order of ``runs``."""
    return popen_group([(["-m", "cyclone_kit.runtime", "--run-dir", str(run_dir)], rank_env)
                        for run_dir, world in runs for rank_env in rank_envs(world, env)])


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


def all_ok(results: list[tuple[int, str, str]]) -> list[tuple[int, str, str]]:
    """``results`` (of :func:`finish`), after asserting that every rank exited 0 (its output in the message)."""
    for rank, (code, out, err) in enumerate(results):
        assert code == 0, f"rank {rank} exited {code}\n{out}\n{err}"
    return results


def per_run(items: list[Any], worlds: list[int]) -> list[list[Any]]:
    """A flat list of ranks (or their results) cut back into runs of ``worlds`` ranks each, in order."""
    assert len(items) == sum(worlds), (len(items), worlds)
    starts = [sum(worlds[:i]) for i in range(len(worlds))]
    return [items[at:at + world] for at, world in zip(starts, worlds, strict=True)]


def run_ranks(run_dir: Path, world: int) -> list[tuple[int, str, str]]:
    return all_ok(finish(start_ranks(run_dir, world)))


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
