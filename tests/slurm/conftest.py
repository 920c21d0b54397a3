"""Fixtures for tests against a real Slurm cluster (the local one: scripts/local-slurm.sh start).

The tests never start the cluster themselves (the Makefile does). When it is not up, they are
skipped with the reason printed; with CK_REQUIRE_SLURM=1 they fail instead, so CI cannot pass
by skipping.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cyclone_kit.backends.slurm import SlurmBackend
from cyclone_kit.core.errors import CycloneError
from cyclone_kit.core.proc import run_command

#: the nodes scripts/local-slurm.sh configures
NODES = ("c1", "c2", "g1", "g2")
#: how long to wait for nodes busy with other people's jobs (or a previous test's job still
#: completing: KillWait, epilog) to become idle; a hang guard, sized for a machine 5x slower
_IDLE_WAIT_S = 120


def _not_ready(reason: str) -> None:
    message = f"local Slurm cluster not ready: {reason}. Start it with: sudo scripts/local-slurm.sh start"
    print(message)
    if os.environ.get("CK_REQUIRE_SLURM") == "1":
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def slurm_cluster() -> dict[str, str]:
    """Node name -> state, once sinfo answers and every node of the test cluster is idle."""
    if shutil.which("sinfo") is None:
        _not_ready("sinfo is not installed")
    # `scontrol ping` answers at once; sinfo retries a dead controller for about 10 s.
    ping = run_command(["scontrol", "ping"], check=False, timeout=15)
    if "is UP" not in ping.stdout:
        _not_ready(next(iter((ping.stdout + ping.stderr).strip().splitlines()), "scontrol ping failed"))
    deadline = time.monotonic() + _IDLE_WAIT_S
    while True:
        result = run_command(["sinfo", "--noheader", "--Node", "--format=%N %t"], check=False, timeout=15)
        if not result.ok:
            _not_ready(f"sinfo failed: {' '.join(result.stderr.split()) or result.returncode}")
        states = dict(line.split(None, 1) for line in result.stdout.splitlines() if line.strip())
        states = {node: state.strip() for node, state in states.items()}
        missing = [n for n in NODES if n not in states]
        if missing:
            _not_ready(f"nodes {', '.join(missing)} unknown to sinfo (another cluster?)")
        busy = {n: states[n] for n in NODES if states[n] != "idle"}
        if not busy:
            return states
        # mix/alloc/completing pass; down or drained nodes will not come back by themselves.
        if time.monotonic() > deadline or any(s.rstrip("*~#").startswith(("down", "drain", "fail")) for s in busy.values()):
            _not_ready(f"nodes not idle: {busy}")
        time.sleep(0.5)


@pytest.fixture(scope="session")
def slurm_accounting(slurm_cluster: dict[str, str]) -> str:
    """The AccountingStorageType, once slurmdbd records jobs (``sacct`` and ``sacctmgr`` answer).

    Tests that need sacct take this fixture: without accounting they are skipped with the reason
    and the command that starts the cluster with it; with CK_REQUIRE_ACCOUNTING=1 (CI) they fail.
    """
    from cyclone_kit.slurm import cluster

    config = run_command(cluster.scontrol_show_config(), check=False, timeout=15)
    storage = cluster.accounting_storage(cluster.parse_config(config.stdout))
    probe = run_command(["sacct", "--noheader", "--allocations", "--jobs=1"], check=False, timeout=15)
    reason = ""
    if not cluster.accounting_enabled(cluster.parse_config(config.stdout)):
        reason = f"Slurm accounting is disabled (AccountingStorageType={storage})"
    elif not probe.ok:
        reason = f"sacct fails: {' '.join(probe.stderr.split()) or probe.returncode}"
    if reason:
        message = f"{reason}. Start the cluster with: sudo scripts/local-slurm.sh start --with-accounting"
        print(message)
        if os.environ.get("CK_REQUIRE_ACCOUNTING") == "1":
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return storage


@pytest.fixture
def backend(slurm_cluster: dict[str, str]) -> Iterator[SlurmBackend]:
    """A SlurmBackend; every job a test submits through :func:`submit` is cancelled afterwards."""
    yield SlurmBackend(timeout=30)


@pytest.fixture
def submit(backend: SlurmBackend, tmp_path: Path) -> Iterator[Callable[..., tuple[str, Path]]]:
    """submit(body, **sbatch_options) -> (job_id, run_dir): write a batch script and sbatch it."""
    submitted: list[str] = []

    def _submit(body: str, name: str = "job", **options: str) -> tuple[str, Path]:
        run_dir = tmp_path / name
        run_dir.mkdir()
        header = [f"#SBATCH --job-name=ck-test-{name}", "#SBATCH --output=out.txt", "#SBATCH --time=00:05:00"]
        header += [f"#SBATCH --{key.replace('_', '-')}={value}" for key, value in options.items()]
        script = run_dir / "job.sbatch"
        script.write_text("#!/bin/bash\n" + "\n".join(header) + "\nset -eu\n" + body + "\n")
        job_id = backend.submit(script, run_dir)
        submitted.append(job_id)
        return job_id, run_dir

    yield _submit
    for job_id in submitted:
        with contextlib.suppress(CycloneError):  # already gone
            backend.cancel(job_id)
