"""The smoke job's per-rank probe: ``python -m cyclone_kit.doctor.probe --out DIR``.

Runs on every rank of ``cyclone-kit doctor``'s smoke job (templates/doctor.sbatch.j2) and writes
``DIR/rank-<R>.json``, rewritten after each stage so that a rank that dies or hangs still leaves
what it found:

1. ``start``: python version, host, the Slurm task variables, CUDA_VISIBLE_DEVICES and the GPU
   variables, the network interface variables in effect and the interfaces this node has;
2. ``torch``: ``import torch`` (the error line when it fails) and the GPUs torch sees;
3. ``bootstrap``: the rank detection every training rank uses (:func:`cyclone_kit.runtime.env.detect`),
   MASTER_ADDR resolution, MASTER_PORT still free on rank 0, then the process group (gloo on
   CPU, nccl on GPU) with a timeout;
4. ``allreduce``: a correctness check, the latency of a 4-byte all-reduce and the bus bandwidth
   of a large one (``2 (n-1)/n x bytes / time``, as nccl-tests reports it);
5. ``sweep``: all-reduce times from 4 B to 64 MiB (256 MiB on GPUs), doubling, on each network
   level separately: ``intra`` (the ranks of the first node, when it has two or more) and
   ``inter`` (one rank per node, when there are two nodes or more). Each size is the median of
   several timed all-reduces; the submit host fits latency and bus bandwidth per level
   (:func:`cyclone_kit.rundir.network.fit_alpha_beta`) into the doctor's ``network.json``.

The judging happens on the submit host (:mod:`cyclone_kit.doctor.checks`); this module only measures.
Exit status 0 when every stage worked, else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cyclone_kit.core.ports import can_bind
from cyclone_kit.launchers.containers import CONTAINER_VARIABLE

#: variables that choose the network interface or transport of gloo / NCCL / MPI.
NET_VARS = (
    "GLOO_SOCKET_IFNAME",
    "NCCL_SOCKET_IFNAME",
    "TP_SOCKET_IFNAME",
    "NCCL_IB_HCA",
    "NCCL_IB_DISABLE",
    "NCCL_NET",
    "NCCL_P2P_DISABLE",
    "NCCL_SHM_DISABLE",
    "NCCL_NET_GDR_LEVEL",
    "NCCL_DEBUG",
    "UCX_NET_DEVICES",
    "OMPI_MCA_btl_tcp_if_include",
    "FI_PROVIDER",
)
#: Slurm's per-task variables the report keeps.
SLURM_VARS = (
    "SLURM_JOB_ID",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_NTASKS",
    "SLURM_NNODES",
    "SLURM_JOB_NODELIST",
    "SLURM_STEP_NODELIST",
    "SLURM_TASKS_PER_NODE",
    "SLURMD_NODENAME",
    "SLURM_CPUS_PER_TASK",
    "SLURM_GPUS_ON_NODE",
    "SLURM_JOB_GPUS",
    "SLURM_STEP_GPUS",
    "GPU_DEVICE_ORDINAL",
)
_LATENCY_ITERS = 20
_BANDWIDTH_ITERS = 5
#: the sweep's largest all-reduce: 64 MiB on CPU, 256 MiB on GPUs.
SWEEP_MAX_BYTES = {"cpu": 64 * 2**20, "cuda": 256 * 2**20}


def sweep_sizes(max_bytes: int) -> list[int]:
    """4 B, 8 B, ... doubling up to ``max_bytes`` (pure)."""
    sizes, size = [], 4
    while size <= max_bytes:
        sizes.append(size)
        size *= 2
    return sizes


def sweep_iters(size: int) -> int:
    """Timed all-reduces per size: more for small messages, whose times are noisier (pure)."""
    return 20 if size <= 2**20 else 10 if size <= 16 * 2**20 else 5


def level_members(hosts_by_rank: list[str]) -> dict[str, list[int]]:
    """Ranks of each network level from every rank's host name, in rank order (pure).

    ``intra``: the ranks on rank 0's host (when two or more); ``inter``: the lowest rank of each
    host (when two hosts or more).
    """
    hosts: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts_by_rank):
        hosts.setdefault(host, []).append(rank)
    first = hosts[hosts_by_rank[0]] if hosts_by_rank else []
    levels = {}
    if len(first) >= 2:
        levels["intra"] = first
    if len(hosts) >= 2:
        levels["inter"] = sorted(ranks[0] for ranks in hosts.values())
    return levels


def error_line(exc: BaseException) -> str:
    """``TypeName: message`` on one line, as the last line of a traceback reads."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())


class Report:
    """The rank's findings, written atomically to ``DIR/rank-<R>.json`` after every stage."""

    def __init__(self, out_dir: Path, rank_id: str) -> None:
        self.path = Path(out_dir) / f"rank-{rank_id}.json"
        self.data: dict[str, Any] = {}

    def save(self, stage: str) -> None:
        """Record ``stage`` as reached and rewrite the file (temp file + rename)."""
        self.data["stage"] = stage
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(self.data, indent=1, sort_keys=True))
        os.replace(tmp, self.path)


def local_facts(environ: Mapping[str, str]) -> dict[str, Any]:
    """What this rank can see without torch: python, host, Slurm, GPU and network variables."""
    try:
        interfaces = sorted(name for _, name in socket.if_nameindex())
    except OSError:
        interfaces = []
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 0
    return {
        "python": platform.python_version(),
        "executable": sys.executable,
        "host": socket.gethostname(),
        "slurm": {k: environ[k] for k in SLURM_VARS if k in environ},
        "cuda_visible_devices": environ.get("CUDA_VISIBLE_DEVICES"),
        "net_env": {k: environ[k] for k in NET_VARS if k in environ},
        "interfaces": interfaces,
        "cpus": cpus,
        "master_addr": environ.get("MASTER_ADDR", ""),
        "master_port": environ.get("MASTER_PORT", ""),
        # the container runtime this rank runs in, as its runtime passed it ('' outside one)
        "container": environ.get(CONTAINER_VARIABLE, ""),
    }


def _connect(addr: str, port: int, timeout: float = 2.0) -> str:
    """``"ok"`` when a TCP connection to addr:port opens, else the error."""
    try:
        with socket.create_connection((addr, port), timeout=timeout):
            return "ok"
    except OSError as e:
        return error_line(e)


def _timed(fn: Any, iters: int, sync: Any) -> float:
    """Median seconds of ``fn()`` over ``iters`` runs (``sync`` waits for the device)."""
    times = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def probe(out_dir: Path, environ: Mapping[str, str], *, timeout_s: float, megabytes: float) -> int:
    """Run every stage on this rank and write its report; returns the exit status."""
    rank_id = environ.get("SLURM_PROCID", str(os.getpid()))
    report = Report(out_dir, rank_id)
    report.data.update(local_facts(environ))
    report.save("start")

    try:
        import torch
    except BaseException as e:
        report.data["torch"] = {"ok": False, "error": error_line(e)}
        report.save("torch")
        return 1
    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    report.data["torch"] = {"ok": True, "version": torch.__version__, "cuda": torch.version.cuda or "",
                            "cuda_device_count": cuda_count}
    report.save("torch")

    boot: dict[str, Any] = {}
    report.data["bootstrap"] = boot
    try:
        from cyclone_kit.runtime.env import detect

        env = detect(environ)
    except Exception as e:
        boot["error"] = f"rank detection failed: {error_line(e)}"
        report.save("bootstrap")
        return 1
    boot.update(rank=env.rank, local_rank=env.local_rank, world_size=env.world_size, num_nodes=env.num_nodes,
                launcher=env.launcher, master_addr=env.master_addr, master_port=env.master_port)
    try:
        boot["master_ip"] = socket.getaddrinfo(env.master_addr, env.master_port, type=socket.SOCK_STREAM)[0][4][0]
    except OSError as e:
        boot["error"] = f"MASTER_ADDR {env.master_addr!r} does not resolve: {error_line(e)}"
        report.save("bootstrap")
        return 1
    if env.rank == 0:
        boot["port_free"] = can_bind(env.master_port)
    backend = "nccl" if cuda_count else "gloo"
    boot["backend"] = backend
    report.save("bootstrap")

    import datetime

    import torch.distributed as dist

    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", env.local_rank % cuda_count)
        torch.cuda.set_device(device)
    started = time.perf_counter()
    try:
        dist.init_process_group(backend, init_method=f"tcp://{env.master_addr}:{env.master_port}", rank=env.rank,
                                world_size=env.world_size, timeout=datetime.timedelta(seconds=timeout_s))
        boot["init_ok"] = True
        boot["world_size_seen"] = dist.get_world_size()
    except Exception as e:
        boot["init_ok"] = False
        boot["error"] = f"init_process_group failed: {error_line(e)}"
        if env.rank != 0:
            boot["master_connect"] = _connect(env.master_addr, env.master_port)
        report.save("bootstrap")
        return 1
    finally:
        boot["init_s"] = round(time.perf_counter() - started, 4)
    report.save("bootstrap")

    result: dict[str, Any] = {"backend": backend, "world_size": env.world_size}
    report.data["allreduce"] = result
    try:
        def sync() -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        one = torch.full((1,), float(env.rank + 1), device=device)
        dist.all_reduce(one)
        expected = env.world_size * (env.world_size + 1) / 2
        result["sum"] = float(one.item())
        result["expected"] = expected
        result["correct"] = abs(result["sum"] - expected) < 1e-6
        small = torch.ones(1, device=device)
        for _ in range(3):
            dist.all_reduce(small)
        result["latency_s"] = _timed(lambda: dist.all_reduce(small), _LATENCY_ITERS, sync)
        numel = max(1, int(megabytes * 1024 * 1024 / 4))
        big = torch.ones(numel, dtype=torch.float32, device=device)
        dist.all_reduce(big)
        seconds = _timed(lambda: dist.all_reduce(big), _BANDWIDTH_ITERS, sync)
        size = numel * 4
        n = env.world_size
        result.update(bytes=size, time_s=seconds, algbw_gbps=size / seconds / 1e9,
                      busbw_gbps=(2 * (n - 1) / n) * size / seconds / 1e9 if n > 1 else size / seconds / 1e9)
        report.save("allreduce")
        report.data["sweep"] = sweep_levels(env.rank, device, sync)
        dist.barrier()
        dist.destroy_process_group()  # a gloo group alive at exit may abort the process (torch 2.14)
    except Exception as e:
        result["error"] = error_line(e)
        report.save("allreduce")
        return 1
    report.data["done"] = True
    report.save("sweep")
    return 0 if result["correct"] else 1


def sweep_levels(rank: int, device: Any, sync: Any) -> dict[str, Any]:
    """Time all-reduces of every :func:`sweep_sizes` size on each network level this rank belongs to.

    Every rank creates every level's group (``new_group`` is collective); the members of a level
    sweep while the others wait at a barrier. Returns ``{"levels": {level: {ranks, hosts, points}},
    "skipped": {level: why}}`` with this rank's (bytes, median seconds) points.
    """
    import torch
    import torch.distributed as dist

    layout: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(layout, socket.gethostname())
    members = level_members([str(h) for h in layout])
    out: dict[str, Any] = {"levels": {}, "skipped": {}}
    if "intra" not in members:
        out["skipped"]["intra"] = "one rank per node: no two ranks share a node"
    if "inter" not in members:
        out["skipped"]["inter"] = "one node: no all-reduce crosses nodes"
    sizes = sweep_sizes(SWEEP_MAX_BYTES[device.type if device.type in SWEEP_MAX_BYTES else "cpu"])
    for level in ("intra", "inter"):
        if level not in members:
            continue
        ranks = members[level]
        group = dist.new_group(ranks)
        if rank in ranks:
            buffer = torch.ones(sizes[-1] // 4, dtype=torch.float32, device=device)
            points = []
            for size in sizes:
                view = buffer[: size // 4]
                dist.all_reduce(view, group=group)  # warm-up: connections, buffers
                points.append([size, _timed(lambda v=view, g=group: dist.all_reduce(v, group=g), sweep_iters(size), sync)])
            del buffer
            out["levels"][level] = {"ranks": ranks, "hosts": sorted({str(layout[r]) for r in ranks}), "points": points}
        dist.barrier()
    return out


def main(argv: list[str] | None = None) -> int:
    """Parse ``--out DIR [--timeout S] [--megabytes M]`` and probe this rank."""
    parser = argparse.ArgumentParser(prog="python -m cyclone_kit.doctor.probe", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder the rank reports go to")
    parser.add_argument("--timeout", type=float, default=30, help="seconds to wait for the other ranks")
    parser.add_argument("--megabytes", type=float, default=8, help="size of the bandwidth all-reduce")
    args = parser.parse_args(argv)
    try:
        return probe(args.out, os.environ, timeout_s=args.timeout, megabytes=args.megabytes)
    except Exception:
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main())
