"""The local launcher's pure parts: rank environments, host lists, failure records (no processes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cyclone_kit.backends.local import local_job
from cyclone_kit.backends.local_env import (
    clean_environment,
    fake_hosts,
    nodelist_string,
    rank_environments,
    tasks_per_node_string,
    threads_per_rank,
)
from cyclone_kit.backends.srun_emulator import LaunchResult, RankExit, failure_record, root_cause_line, signal_name
from cyclone_kit.config.job import spec_from_dict
from cyclone_kit.core.errors import ValidationError
from cyclone_kit.runtime.env import detect


@pytest.mark.parametrize(("nodes", "hosts", "nodelist"), [
    (1, ["localhost"], "localhost"),
    (2, ["127.0.0.1", "127.0.0.2"], "127.0.0.[1-2]"),
    (4, ["127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4"], "127.0.0.[1-4]"),
])
def test_fake_hosts_resolve_to_loopback(nodes: int, hosts: list[str], nodelist: str) -> None:
    assert fake_hosts(nodes) == hosts
    assert nodelist_string(hosts) == nodelist


@pytest.mark.parametrize(("per_node", "nodes", "text"), [(1, 1, "1"), (2, 1, "2"), (2, 3, "2(x3)")])
def test_tasks_per_node_string(per_node: int, nodes: int, text: str) -> None:
    assert tasks_per_node_string(per_node, nodes) == text


@pytest.mark.parametrize(("nproc", "cores", "threads"), [(1, 2, 2), (2, 2, 1), (4, 2, 1), (3, 16, 5)])
def test_threads_share_the_cores(nproc: int, cores: int, threads: int) -> None:
    assert threads_per_rank(nproc, cores) == threads


@pytest.mark.parametrize(("nproc", "nodes"), [(4, 1), (4, 2), (6, 3), (1, 1)])
def test_every_rank_environment_is_detected_as_srun_would_set_it(nproc: int, nodes: int) -> None:
    envs = rank_environments(nproc, nodes, job_id="900000001", master_port=23456, threads=1, run_dir="/r")
    per_node = nproc // nodes
    seen = []
    for rank, env in enumerate(envs):
        dist = detect(env)
        seen.append((dist.rank, dist.local_rank, dist.node_rank))
        assert (dist.world_size, dist.num_nodes, dist.local_world_size) == (nproc, nodes, per_node)
        assert (dist.master_addr, dist.master_port) == ("127.0.0.1", 23456)
        assert env["SLURMD_NODENAME"] == fake_hosts(nodes)[rank // per_node]
    assert seen == [(r, r % per_node, r // per_node) for r in range(nproc)]


def test_enclosing_launcher_variables_do_not_leak() -> None:
    base = {"PATH": "/bin", "SLURM_JOB_ID": "5", "SLURM_PROCID": "3", "RANK": "1", "LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_RANK": "2", "PMI_RANK": "2", "SUBMITIT_EXECUTOR": "slurm", "MASTER_PORT": "1",
            "TORCHELASTIC_RUN_ID": "x", "HOME": "/root"}
    assert clean_environment(base) == {"PATH": "/bin", "HOME": "/root"}
    (env,) = rank_environments(1, 1, job_id="900000002", master_port=2, threads=1, run_dir="/r", base=base)
    assert env["SLURM_JOB_ID"] == "900000002" and "RANK" not in env and env["PATH"] == "/bin"


@pytest.mark.parametrize(("nproc", "nodes"), [(3, 2), (0, 1), (2, 0)])
def test_uneven_layouts_are_refused(nproc: int, nodes: int) -> None:
    with pytest.raises(ValidationError, match="--nproc") as info:
        rank_environments(nproc, nodes, job_id="1", master_port=1, threads=1, run_dir="/r")
    assert info.value.hint


def test_signal_names() -> None:
    assert (signal_name(-9), signal_name(-15), signal_name(1), signal_name(None)) == ("SIGKILL", "SIGTERM", None, None)


def test_failure_record_names_the_first_failure_and_its_error(tmp_path: Path) -> None:
    (tmp_path / "ranks").mkdir()
    (tmp_path / "ranks" / "error-rank-00001.json").write_text(
        '{"rank": 1, "host": "127.0.0.2", "type": "RuntimeError", "message": "Connection closed by peer", "traceback": ""}')
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rank-1.err").write_text("".join(f"line {i}\n" for i in range(30)))
    first = RankExit(1, "127.0.0.2", 42, 1, 3.25)
    other = RankExit(0, "127.0.0.1", 41, -15, 3.5, stopped=True)
    result = LaunchResult("900000003", tmp_path, (other, first), first, False, 4.0, 0.25)
    doc = failure_record(result)
    assert doc["summary"] == ("rank 1 on host 127.0.0.2 (pid 42) exit code 1 after 3.2 s: "
                              "RuntimeError: Connection closed by peer")
    assert (doc["rank"], doc["host"], doc["exit_code"], doc["signal"]) == (1, "127.0.0.2", 1, None)
    assert doc["stderr_tail"] == [f"line {i}" for i in range(10, 30)]
    assert doc["ranks"][0]["stopped_by_launcher"] is True and doc["ranks"][0]["signal"] == "SIGTERM"
    line = root_cause_line(RankExit(2, "localhost", 7, -9, 1.0))
    assert line == "rank 2 on host localhost (pid 7) killed by SIGKILL after 1.0 s"


def test_local_job_has_no_profile_checks() -> None:
    spec = spec_from_dict({"name": "j", "resources": {"profile": "cyclone", "partition": "gpu", "nodes": 16}})
    job = local_job(spec, 4, 2, threads=1)
    assert (job.world_size, job.nodes, job.ntasks_per_node, job.gpus_per_node, job.cpus_per_task) == (4, 2, 2, 0, 1)
    assert (job.spec.resources.nodes, job.spec.resources.gpus_per_node, job.spec.resources.profile) == (2, 0, "cyclone")
    with pytest.raises(ValidationError, match="does not split evenly"):
        local_job(spec, 3, 2)
