"""``cyclone-kit doctor`` against the real local Slurm cluster (scripts/local-slurm.sh start).

Each smoke job runs the probe on every rank: about 5-10 s here (mostly ``import torch``).
The doctor CLI runs as a user would run it, in a subprocess; every wait inside it is on the
job's state.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cyclone_kit.core.proc import run_command
from cyclone_kit.rundir.network import load_network
from tests.helpers.cli import REPO, run_cli

pytestmark = pytest.mark.slurm

LOCAL_PROFILE = (REPO / "cyclone_kit" / "profiles" / "local.toml").read_text()


#: the CLI in a fresh interpreter, reporting at exit whether anything imported torch into it
_NO_TORCH = ("import sys; from cyclone_kit.cli.app import main; rc = main(sys.argv[1:]); "
             "sys.stderr.write(f'torch in the CLI process: {\"torch\" in sys.modules}\\n'); sys.exit(rc)")


def doctor(*args: str, runs: Path) -> tuple[int, list[dict], str]:
    """Run ``cyclone-kit doctor ARGS --json``; returns (exit code, checks, stderr)."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", _NO_TORCH, "doctor", *args, "--json", "--runs-dir", str(runs)],
                         cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": path})
    assert out.returncode in (0, 1), out.stderr
    assert "torch in the CLI process: False" in out.stderr  # only the job's ranks import torch
    return out.returncode, json.loads(out.stdout), out.stderr


def by_name(checks: list[dict]) -> dict[str, dict]:
    return {c["check"]: c for c in checks}


def test_local_profile_passes_with_a_measured_allreduce(slurm_cluster: dict, tmp_path: Path) -> None:
    rc, checks, stderr = doctor("--profile", "local", "--partition", "cpu", "--nodes", "2", runs=tmp_path)
    failed = [c for c in checks if c["ok"] is False]
    assert rc == 0, failed
    assert all(set(c) == {"check", "ok", "detail", "hint"} for c in checks if c["check"] != "network_figures")
    passed = [c["check"] for c in checks if c["ok"] is True]
    assert len(passed) >= 6
    for name in ("partition", "nodes", "cpus", "smoke_job", "python", "torch_import", "bootstrap", "allreduce", "network"):
        assert name in passed, by_name(checks)[name]
    allreduce = by_name(checks)["allreduce"]["detail"]
    print("allreduce:", allreduce)
    assert allreduce.startswith("gloo, 2 ranks on 2 node(s): sum correct")
    bandwidth = float(allreduce.split("bus bandwidth ")[1].split(" GB/s")[0])
    assert bandwidth > 0
    assert "ranks 0-1 on c1, c2" in by_name(checks)["bootstrap"]["detail"]
    assert "smoke job" in stderr  # progress goes to stderr, JSON alone to stdout
    # the job was the profile's own: rendered from the doctor template that extends base.sbatch.j2
    (run_dir,) = tmp_path.glob("ck-doctor-*")
    script = (run_dir / "job.sbatch").read_text()
    assert "#SBATCH --partition=cpu" in script and "-m cyclone_kit.doctor.probe" in script
    assert sorted(p.name for p in (run_dir / "doctor").glob("rank-*.json")) == ["rank-0.json", "rank-1.json"]
    # the all-reduce sweep across the nodes, fitted and saved (issue 23): --json and network.json agree
    figures = by_name(checks)["network_figures"]
    assert figures["ok"] is True and "inter-node (2 ranks)" in figures["detail"]
    saved = load_network(run_dir)
    assert saved.to_dict() == figures["data"] and saved.level("intra") is None
    inter = saved.level("inter")
    assert [s for s, _ in inter.points][::8] == [4, 1024, 262144, 67108864] and inter.busbw_gbps > 0


def test_two_tasks_per_node_measure_both_network_levels(slurm_cluster: dict, tmp_path: Path) -> None:
    rc, checks, _ = doctor("--profile", "local", "--partition", "cpu", "--nodes", "2", "--ntasks-per-node", "2",
                           runs=tmp_path)
    assert rc == 0, [c for c in checks if c["ok"] is False]
    (run_dir,) = tmp_path.glob("ck-doctor-*")
    saved = load_network(run_dir)
    assert saved.level("intra").ranks == 2 and saved.level("intra").nodes == 1
    assert saved.level("inter").ranks == 2 and saved.level("inter").nodes == 2


def test_text_output_has_one_row_per_check(slurm_cluster: dict, tmp_path: Path) -> None:
    out = run_cli("doctor", "--profile", "cyclone", "--partition", "gpu", "--nodes", "2", "--static-only",
                  "--runs-dir", str(tmp_path), timeout=120)
    assert out.returncode == 1, out.stderr
    rows = out.stdout.splitlines()
    assert rows[0].startswith("ok    partition")
    assert any(r.startswith("FAIL  nodes") and "HINT: set nodes = 2" in r for r in rows)
    assert rows[-1].endswith("not checked")
    assert not list(tmp_path.iterdir())  # --static-only submits nothing


def test_cyclone_profile_against_the_local_cluster_fails_on_nodes_and_cores(slurm_cluster: dict, tmp_path: Path) -> None:
    rc, checks, _ = doctor("--profile", "cyclone", "--partition", "gpu", "--nodes", "2", "--account", "p163",
                           runs=tmp_path)
    assert rc == 1
    checks = by_name(checks)
    assert checks["nodes"]["ok"] is False
    assert "says 16 nodes" in checks["nodes"]["detail"] and "the cluster has 2" in checks["nodes"]["detail"]
    assert checks["cpus"]["ok"] is False
    assert "says 40 CPUs (cores) per node" in checks["cpus"]["detail"] and "4 on g[1-2]" in checks["cpus"]["detail"]
    assert checks["gpus"]["ok"] is True
    # the request cannot fit (40 CPUs per node asked, 4 exist): no job pends forever
    assert checks["smoke_job"]["ok"] is None and "40 CPUs per node asked, 4 exist" in checks["smoke_job"]["detail"]
    assert not list(tmp_path.glob("ck-doctor-*"))
    assert checks["account"]["ok"] in (None, False)  # not checked without accounting; no p163 association with it


def test_setup_that_breaks_python_fails_the_import_check_quoting_the_error(slurm_cluster: dict, tmp_path: Path) -> None:
    profile = tmp_path / "broken.toml"
    profile.write_text(LOCAL_PROFILE.replace('name = "local"', 'name = "broken"').replace(
        "setup = []", 'setup = ["export PYTHONHOME=/nonexistent/broken-by-setup"]'))
    rc, checks, _ = doctor("--profile", str(profile), "--partition", "cpu", "--nodes", "2", runs=tmp_path / "runs")
    assert rc == 1
    checks = by_name(checks)
    (run_dir,) = (tmp_path / "runs").glob("ck-doctor-*")
    stderr_lines = {" ".join(line.split()) for p in (run_dir / "logs").glob("*.err") for line in p.read_text().splitlines()}
    assert "ModuleNotFoundError: No module named 'encodings'" in stderr_lines  # what python itself printed
    imp = checks["torch_import"]
    assert imp["ok"] is False
    assert imp["detail"] == "rank(s) 0-1 never got to import torch: ModuleNotFoundError: No module named 'encodings'"
    assert imp["hint"]
    assert checks["python"]["ok"] is False and checks["smoke_job"]["ok"] is False
    assert checks["partition"]["ok"] is True  # the static checks still pass: only the setup is broken


def test_partition_missing_from_the_cluster(slurm_cluster: dict, tmp_path: Path) -> None:
    profile = tmp_path / "other.toml"
    profile.write_text(LOCAL_PROFILE.replace("[partitions.gpu]", "[partitions.bigmem]"))
    rc, checks, _ = doctor("--profile", str(profile), "--partition", "bigmem", "--nodes", "1", runs=tmp_path)
    assert rc == 1
    checks = by_name(checks)
    assert checks["partition"]["ok"] is False and "'bigmem' does not exist" in checks["partition"]["detail"]
    assert checks["smoke_job"]["ok"] is None


def test_a_job_that_never_starts_is_cancelled_at_the_wait_timeout(slurm_cluster: dict, tmp_path: Path) -> None:
    # SBATCH_TIMELIMIT (which beats #SBATCH --time) above the partition's MaxTime: Slurm accepts the job
    # and it pends (PartitionTimeLimit) however long doctor waits.
    out = run_cli("doctor", "--profile", "local", "--partition", "cpu", "--nodes", "1", "--wait-timeout", "1", "--json",
                  "--runs-dir", str(tmp_path), env={"SBATCH_TIMELIMIT": "2-00:00:00"}, timeout=120)
    assert out.returncode == 1, out.stderr
    smoke = by_name(json.loads(out.stdout))["smoke_job"]
    assert smoke["ok"] is False
    assert "still PENDING when doctor stopped waiting (reason: PartitionTimeLimit); it was cancelled" in smoke["detail"]
    assert "--wait-timeout" in smoke["hint"]
    (run_dir,) = tmp_path.glob("ck-doctor-*")
    job_id = (run_dir / "job_id").read_text().strip()
    state = run_command(["squeue", "--noheader", "--states=all", f"--jobs={job_id}", "--format=%T"]).stdout.strip()
    assert state == "CANCELLED"


def test_a_job_sbatch_refuses_is_one_row_and_leaves_no_run_dir(slurm_cluster: dict, tmp_path: Path) -> None:
    # SBATCH_GRES (which beats the script's directives) asks GPUs of the cpu partition: sbatch refuses.
    out = run_cli("doctor", "--profile", "local", "--partition", "cpu", "--nodes", "1", "--json",
                  "--runs-dir", str(tmp_path), env={"SBATCH_GRES": "gpu:1"}, timeout=120)
    assert out.returncode == 1, out.stderr
    checks = json.loads(out.stdout)
    assert checks[-1]["check"] == "smoke_job" and checks[-1]["ok"] is False
    assert checks[-1]["detail"].startswith("sbatch refused the smoke job: sbatch rejected")
    assert "node configuration is not available" in checks[-1]["detail"]
    assert [c["check"] for c in checks].count("python") == 0
    assert not list(tmp_path.glob("ck-doctor-*"))
