"""Kill one node's share of one Slurm job on the local test cluster, as if the node lost its processes.

Only the job's own processes are touched: the tasks whose environment says ``SLURM_JOB_ID=<job>``
and ``SLURMD_NODENAME=<node>`` (the rank, its watchdog), and the job's step daemons
(``slurmstepd: [<job>.<step>]``, not the batch step) started by that node's slurmd. The node's
slurmd keeps running (it answers at once: the node never goes DOWN), and other jobs are left alone.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
from pathlib import Path


def _proc(pid: int) -> tuple[list[bytes], list[str], int] | None:
    base = Path("/proc") / str(pid)
    try:
        environ = (base / "environ").read_bytes().split(b"\0")
        argv = (base / "cmdline").read_bytes().decode(errors="replace").split("\0")
        stat = (base / "stat").read_text()
    except OSError:
        return None
    return environ, argv, int(stat.rsplit(")", 1)[1].split()[1])


def _started_by(pid: int, node: str) -> bool:
    """True when an ancestor of ``pid`` is the slurmd of ``node`` (``slurmd ... -N node``)."""
    seen = 0
    while pid > 1 and seen < 20:
        info = _proc(pid)
        if info is None:
            return False
        args = info[1]
        if any(a.endswith("slurmd") for a in args) and any(a == "-N" and b == node for a, b in itertools.pairwise(args)):
            return True
        pid, seen = info[2], seen + 1
    return False


def node_processes(job_id: str, node: str) -> list[int]:
    """The pids of ``job_id``'s step daemons and tasks on ``node`` (never its batch step, never slurmd)."""
    found = []
    job_var, node_var = f"SLURM_JOB_ID={job_id}".encode(), f"SLURMD_NODENAME={node}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        info = _proc(int(entry.name))
        if info is None:
            continue
        environ, argv, ppid = info
        head = argv[0] if argv else ""
        if head.startswith(f"slurmstepd: [{job_id}.") and not head.endswith(("batch]", "extern]")):
            if _started_by(ppid, node):
                found.append(int(entry.name))
        elif job_var in environ and node_var in environ and any(e.startswith(b"SLURM_STEP_ID=") for e in environ):
            found.append(int(entry.name))
    return sorted(found)


def kill_node_processes(job_id: str, node: str) -> list[int]:
    """SIGKILL the job's processes on ``node`` (the step daemon first: nothing reports the deaths)."""
    pids = node_processes(job_id, node)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids
