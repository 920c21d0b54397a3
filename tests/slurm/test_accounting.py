"""Slurm accounting (slurmdbd + MariaDB) on the local cluster: what sacct and sacctmgr report.

Needs ``scripts/local-slurm.sh start --with-accounting``; without it every test here is skipped
with that reason (CK_REQUIRE_ACCOUNTING=1 makes them fail instead, as in CI).
"""

from __future__ import annotations

import getpass
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from cyclone_kit.backends.slurm import SlurmBackend
from cyclone_kit.core.proc import run_command
from cyclone_kit.slurm import cluster, hostlist
from cyclone_kit.slurm.states import JobState
from tests.helpers.cli import run_cli

pytestmark = pytest.mark.slurm

Submit = Callable[..., tuple[str, Path]]
#: hang guard only (a broken job or slurmdbd): a busy controller or a job still completing is waited for
HANG_S = 300


def sacct_record(job_id: str, timeout: float = HANG_S) -> dict[str, str]:
    """The job's allocation record once slurmdbd has all of it.

    The record is written in pieces after the job ends: seen on this cluster, a 2-node job's row
    read ``COMPLETED|2|c1`` with its End time set for about half a second before its NodeList
    became ``c[1-2]``. So wait until End is set, the NodeList has NNodes hosts and AllocTRES counts
    them too (anyone reading sacct right after a job, e.g. for device-hours, must do the same).
    """
    fields = ("JobID", "State", "NNodes", "NodeList", "ElapsedRaw", "Start", "End", "AllocTRES")
    deadline = time.monotonic() + timeout
    while True:
        out = run_command(["sacct", "--noheader", "--parsable2", "--allocations", f"--jobs={job_id}",
                           f"--format={','.join(fields)}"]).stdout
        rows = [dict(zip(fields, line.split("|"), strict=True)) for line in out.splitlines() if line.strip()]
        row = next((r for r in rows if r["JobID"] == job_id), None)
        if row is not None and row["End"] not in ("Unknown", "") and _settled(row):
            return row
        if time.monotonic() > deadline:
            pytest.fail(f"sacct has no finished record of job {job_id} after {timeout} s: {out!r}")
        time.sleep(0.2)


def _settled(row: dict[str, str]) -> bool:
    nodes = int(row["NNodes"])
    hosts = hostlist.expand(row["NodeList"]) if row["NodeList"] not in ("", "None assigned") else []
    return len(hosts) == nodes and tres(row["AllocTRES"]).get("node") == str(nodes)


def tres(text: str) -> dict[str, str]:
    """``cpu=2,mem=1000M,node=2,billing=2`` as a dict."""
    return dict(item.split("=", 1) for item in text.split(",") if "=" in item)


def test_sacct_records_allocation_and_elapsed(slurm_accounting: str, backend: SlurmBackend, submit: Submit) -> None:
    started = time.time()
    job_id, _ = submit("srun hostname", name="acct", nodes="2", ntasks_per_node="1", cpus_per_task="2")
    info = backend.wait(job_id, timeout=HANG_S)
    assert info.state is JobState.COMPLETED
    row = sacct_record(job_id)
    assert (row["State"], row["NNodes"], row["NodeList"]) == ("COMPLETED", "2", "c[1-2]")
    alloc = tres(row["AllocTRES"])
    assert (alloc["node"], alloc["cpu"]) == ("2", "4")  # 2 nodes x 1 task x 2 CPUs
    # ElapsedRaw is End - Start in whole seconds, and the job ran inside the test's own window
    start = time.mktime(time.strptime(row["Start"], "%Y-%m-%dT%H:%M:%S"))
    end = time.mktime(time.strptime(row["End"], "%Y-%m-%dT%H:%M:%S"))
    assert int(row["ElapsedRaw"]) == int(end - start)
    assert started - 1 <= start <= end <= time.time() + 1


def test_sacct_reports_gpus_of_a_gpu_job(slurm_accounting: str, backend: SlurmBackend, submit: Submit) -> None:
    # Device-hours from sacct (issue 15) need the GPUs in AllocTRES; Slurm counts gres/gpu there only
    # when slurm.conf lists it in AccountingStorageTRES (fatal without slurmdbd, so only with accounting).
    config = cluster.parse_config(run_command(cluster.scontrol_show_config()).stdout)
    if "gres/gpu" not in config.get("AccountingStorageTRES", ""):
        message = ("AccountingStorageTRES lacks gres/gpu, so sacct cannot count GPUs: scripts/local-slurm.sh "
                   "--with-accounting must write AccountingStorageTRES=gres/gpu into slurm.conf")
        if os.environ.get("CK_REQUIRE_ACCOUNTING") == "1":
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    job_id, _ = submit("srun true", name="acctgpu", partition="gpu", nodes="1", gres="gpu:2")
    assert backend.wait(job_id, timeout=HANG_S).state is JobState.COMPLETED
    alloc = tres(sacct_record(job_id)["AllocTRES"])
    print("AllocTRES of a --gres=gpu:2 job:", alloc)
    assert alloc.get("gres/gpu") == "2", alloc


def test_doctor_checks_the_account_association(slurm_accounting: str, tmp_path: Path) -> None:
    user = getpass.getuser()
    mine = cluster.accounts_of(user, cluster.parse_sacctmgr_assoc(run_command(cluster.sacctmgr_assoc(user)).stdout))
    assert mine, f"sacctmgr lists no account for {user}; `sacctmgr -i add cluster` creates root's"
    ok = run_cli("doctor", "--profile", "local", "--account", mine[0], "--static-only", "--json", timeout=HANG_S)
    account = next(c for c in json.loads(ok.stdout) if c["check"] == "account")
    assert (ok.returncode, account["ok"]) == (0, True), account
    bad = run_cli("doctor", "--profile", "local", "--account", "p163", "--static-only", "--json", timeout=HANG_S)
    account = next(c for c in json.loads(bad.stdout) if c["check"] == "account")
    assert bad.returncode == 1 and account["ok"] is False
    assert "no association with account 'p163'" in account["detail"] and account["hint"] == f"use --account {mine[0]}"
