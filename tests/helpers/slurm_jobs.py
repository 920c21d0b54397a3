"""Helpers of the Slurm tier: submit the smoke job, find a job's processes, read its records, wait for events."""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cyclone_kit.backends.slurm import SlurmBackend
from cyclone_kit.core.errors import CycloneError
from tests.helpers.cli import REPO, run_cli

SMOKE = str(REPO / "jobs" / "smoke.toml")
#: Hang guard for a CLI call or a wait of the Slurm tier (seconds; never a performance bound).
HANG_S = 300.0


def submit_smoke(runs_dir: Path, *args: str, sets: tuple[str, ...] = (),
                 env: dict[str, str] | None = None) -> tuple[str, Path]:
    """``python -m cyclone_kit submit jobs/smoke.toml --profile local --partition cpu ARGS``; (job id, run dir).

    ``env`` is added to submit's environment, which sbatch passes on to the job's ranks (e.g. the
    ``PYTHONPATH`` of :func:`tests.helpers.slow_parts.slow_parts_env`).
    """
    argv = ["submit", SMOKE, "--profile", "local", "--partition", "cpu", "--runs-dir", str(runs_dir), *args]
    for item in sets:
        argv += ["--set", item]
    result = run_cli(*argv, timeout=HANG_S, env=env)
    assert result.returncode == 0, result.stderr
    return parse_submit_output(result.stdout)


def parse_submit_output(stdout: str) -> tuple[str, Path]:
    """(job id, run dir) from submit's "submitted job N" and "run dir: PATH" lines."""
    job = re.search(r"^submitted job (\d+)$", stdout, re.M)
    run_dir = re.search(r"^run dir: (.+)$", stdout, re.M)
    assert job and run_dir, stdout
    return job.group(1), Path(run_dir.group(1))


def proc_info(pid: int) -> tuple[list[bytes], list[str], int, str] | None:
    """(environment entries, argv, parent pid, state) of a live process, or None."""
    try:
        base = Path("/proc") / str(pid)
        environ = (base / "environ").read_bytes().split(b"\0")
        argv = (base / "cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
        stat = (base / "stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return environ, argv, int(fields[1]), fields[0]


def job_processes(job_id: str) -> dict[int, dict[str, Any]]:
    """Live processes (not zombies) whose environment says SLURM_JOB_ID=<job_id>: pid -> info.

    Info: ``procid`` (SLURM_PROCID or None), ``argv``, ``ppid``.
    """
    needle = f"SLURM_JOB_ID={job_id}".encode()
    found: dict[int, dict[str, Any]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        info = proc_info(int(entry.name))
        if info is None or needle not in info[0] or info[3] == "Z":
            continue
        procid = next((e.split(b"=", 1)[1].decode() for e in info[0] if e.startswith(b"SLURM_PROCID=")), None)
        found[int(entry.name)] = {"procid": procid, "argv": info[1], "ppid": info[2]}
    return found


def rank_pids(job_id: str) -> dict[int, int]:
    """Rank -> pid of the process that trains (``-m cyclone_kit.runtime``; the innermost one when
    a watchdog runs the rank as its child)."""
    procs = job_processes(job_id)
    trainers = {pid: p for pid, p in procs.items()
                if p["procid"] is not None and "cyclone_kit.runtime" in p["argv"]
                and p["argv"][p["argv"].index("cyclone_kit.runtime") - 1] == "-m"}
    leaves = {pid: p for pid, p in trainers.items() if not any(q["ppid"] == pid for q in trainers.values())}
    return {int(p["procid"]): pid for pid, p in leaves.items()}


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    """The complete lines of metrics.jsonl (a line being written is skipped)."""
    path = run_dir / "metrics.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, poll: float = 0.1) -> Any:
    """Poll until ``predicate()`` is truthy; return its value (fail after ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(poll)


def steps_logged(run_dir: Path) -> int:
    """The highest step number in metrics.jsonl so far (0 before the first step record)."""
    return max((r["step"] for r in read_records(run_dir) if r.get("kind") == "step"), default=0)


def finish_job(backend: SlurmBackend, job_id: str, timeout: float = HANG_S) -> Any:
    """Wait for the job to end (its last JobInfo); cancel it if it is still active after all (a failed wait)."""
    try:
        return backend.wait(job_id, timeout=timeout)
    finally:
        with contextlib.suppress(CycloneError):
            if backend.status(job_id).state.is_active:
                backend.cancel(job_id)


def cancel_quietly(backend: SlurmBackend, job_id: str) -> None:
    """Cancel a job left running by a failed test (a finished job is left alone)."""
    with contextlib.suppress(CycloneError):
        backend.cancel(job_id)


def rank_lines(text: str, prefix: str) -> list[tuple[int, int, str]]:
    """(rank, world size, host) of every ``PREFIX: rank R of W on HOST`` line of ``text``, sorted."""
    return sorted((int(r), int(w), h) for r, w, h in re.findall(rf"^{prefix}: rank (\d+) of (\d+) on (\S+)", text, re.M))


def worker_outputs(run_dir: Path, job_id: str) -> list[str]:
    """The stdout of every torchrun worker of the job's first segment, one text per worker: read from
    torchrun's own file per worker (``logs/workers/<job id>_*/attempt_0/<local rank>/stdout.log``), never
    from the job log, where the workers of one node share a pipe."""
    from cyclone_kit.rundir.layout import RunDir

    return [p.read_text(errors="replace")
            for p in sorted(RunDir(run_dir).worker_logs.glob(f"{job_id}_*/attempt_0/*/stdout.log"))]
