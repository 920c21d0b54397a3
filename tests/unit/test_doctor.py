"""Table tests for ``cyclone-kit doctor``: the cluster parsers and every pure check.

Inputs are real: tests/unit/slurm_output/ holds byte-exact output of the local Slurm 22.05 test
cluster (``scontrol -o show partition``, ``scontrol -o show node``, ``scontrol show node g1``,
``scontrol show config`` without accounting, and ``sacctmgr --noheader --parsable2 show assoc
where user=root format=Cluster,Account,User,Partition`` with it: the association ``sacctmgr add
cluster`` creates), and tests/unit/doctor_reports{,_gpu}/ hold the rank reports real smoke jobs
wrote (``cyclone-kit doctor --profile local --partition cpu|gpu --nodes 2`` on that cluster).
Failing cases are those real records with one fact changed.
To recapture: run the commands that :mod:`cyclone_kit.slurm.cluster`'s argv builders print, and
copy ``runs/ck-doctor-*/doctor/rank-*.json`` after a doctor run.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from pathlib import Path

import pytest

from cyclone_kit.core.errors import ParseError, ValidationError
from cyclone_kit.doctor import checks as doctor
from cyclone_kit.doctor.checks import Check, HostVersions, ModuleFacts, SmokeResult
from cyclone_kit.doctor.job import doctor_request
from cyclone_kit.slurm import cluster
from cyclone_kit.submit.render import render_script
from tests.helpers.cli import REPO

OUTPUT = Path(__file__).parent / "slurm_output"
REPORTS = Path(__file__).parent / "doctor_reports"
REPORTS_GPU = Path(__file__).parent / "doctor_reports_gpu"
GOLDEN = REPO / "tests" / "golden"


def _output(name: str) -> str:
    return (OUTPUT / name).read_text()


PARTITIONS = {p.name: p for p in cluster.parse_partitions(_output("scontrol_partition_oneline.txt"))}
NODES = cluster.parse_nodes(_output("scontrol_nodes_oneline.txt"))
CPU_NODES = [n for n in NODES if "cpu" in n.partitions]
GPU_NODES = [n for n in NODES if "gpu" in n.partitions]
LOCAL_CPU = doctor_request("local", "cpu", 2, "")
CYCLONE_GPU = doctor_request("cyclone", "gpu", 2, "p163")


# --------------------------------------------------------------------------- parsers
def test_partitions_one_line_and_multi_line_agree() -> None:
    multi = {p.name: p for p in cluster.parse_partitions(_output("scontrol_partition.txt"))}
    assert multi == PARTITIONS
    cpu = PARTITIONS["cpu"]
    assert (cpu.state, cpu.nodelist, cpu.total_nodes, cpu.total_cpus, cpu.max_time_s, cpu.default) == (
        "UP", "c[1-2]", 2, 8, 86400, True)
    assert cpu.hosts == ["c1", "c2"]
    assert PARTITIONS["gpu"].default is False


def test_nodes_cpus_memory_and_gres() -> None:
    by_name = {n.name: n for n in NODES}
    assert sorted(by_name) == ["c1", "c2", "g1", "g2"]
    assert (by_name["c1"].cpus, by_name["c1"].memory_mb, by_name["c1"].gpus, by_name["c1"].gres) == (4, 4000, 0, "")
    assert (by_name["g1"].gpus, by_name["g1"].gres, by_name["g1"].partitions) == (4, "gpu:4", ("gpu",))
    # the multi-line form (`scontrol show node g1`) reads the same
    assert cluster.parse_nodes(_output("scontrol_node_g1.txt")) == [by_name["g1"]]


@pytest.mark.parametrize(("gres", "gpus"), [
    ("gpu:4", 4),
    ("gpu:v100:4", 4),
    ("gpu:v100:4(S:0-1)", 4),
    ("gpu:v100:2(S:0,2),mps:400", 2),
    ("gpu:a100:2,gpu:v100:2", 4),
    ("mps:100", 0),
    ("", 0),
])
def test_gres_gpus(gres: str, gpus: int) -> None:
    assert cluster.gres_gpus(gres) == gpus


def test_unreadable_output_raises_with_the_raw_text() -> None:
    with pytest.raises(ParseError, match="gpu:lots"):
        cluster.gres_gpus("gpu:lots")
    with pytest.raises(ParseError, match="raw output: 'PartitionName=x State=UP'"):
        cluster.parse_partitions("PartitionName=x State=UP")
    with pytest.raises(ParseError, match="MaxTime='soon'"):
        cluster.parse_partitions("PartitionName=x State=UP TotalNodes=1 TotalCPUs=1 MaxTime=soon")
    with pytest.raises(ParseError, match="expected 4"):
        cluster.parse_sacctmgr_assoc("cyclone-local|root\n")


def test_accounting_state_from_config() -> None:
    config = cluster.parse_config(_output("scontrol_config_noacct.txt"))
    assert cluster.accounting_storage(config) == "accounting_storage/none"
    assert not cluster.accounting_enabled(config)
    assert cluster.accounting_enabled({"AccountingStorageType": "accounting_storage/slurmdbd"})
    assert config["ClusterName"] == "cyclone-local"


def test_sacctmgr_associations() -> None:
    rows = cluster.parse_sacctmgr_assoc(_output("sacctmgr_assoc_root.txt"))
    assert cluster.Association("cyclone-local", "root", "root", "") in rows
    assert cluster.accounts_of("root", rows) == ["root"]
    assert cluster.accounts_of("alice", rows) == []


def test_argv_builders_refuse_shell_words() -> None:
    assert cluster.scontrol_show_nodes("g[1-2]") == ["scontrol", "-o", "show", "node", "g[1-2]"]
    assert cluster.sacctmgr_assoc("root")[-2:] == ["user=root", "format=Cluster,Account,User,Partition"]
    for bad in ("cpu; rm -rf /", "", "a b", "$(id)"):
        with pytest.raises(ValidationError):
            cluster.scontrol_show_partition(bad)


# --------------------------------------------------------------------------- static checks
def _static(job, live, nodes, **kw):
    defaults = {"accounting": "accounting_storage/none", "associations": None,
                "associations_error": "accounting storage is disabled", "user": "root", "modules": ModuleFacts()}
    return {c.check: c for c in doctor.static_checks(job, live, nodes, **{**defaults, **kw})}


def test_local_profile_matches_the_local_cluster() -> None:
    checks = _static(LOCAL_CPU, PARTITIONS["cpu"], CPU_NODES)
    assert [name for name, c in checks.items() if c.ok is False] == []
    assert [name for name, c in checks.items() if c.ok] == [
        "partition", "nodes", "nodelist", "cpus", "gpus", "memory", "max_time", "modules"]
    assert checks["account"].ok is None and checks["account"].detail.startswith("not checked")
    assert "3.9 GB" in checks["memory"].detail  # 4 GB in the profile, RealMemory=4000 MB: within 10 %
    assert doctor.request_problems(LOCAL_CPU, PARTITIONS["cpu"], CPU_NODES) == []


def test_cyclone_profile_on_the_local_cluster_names_node_count_and_cores() -> None:
    checks = _static(CYCLONE_GPU, PARTITIONS["gpu"], GPU_NODES)
    failed = {name for name, c in checks.items() if c.ok is False}
    assert failed == {"nodes", "nodelist", "cpus", "memory"}
    assert "says 16 nodes" in checks["nodes"].detail and "the cluster has 2" in checks["nodes"].detail
    assert checks["nodes"].hint == "set nodes = 2 in [partitions.gpu] of profile 'cyclone'"
    assert "says 40 CPUs (cores) per node" in checks["cpus"].detail and "4 on g[1-2]" in checks["cpus"].detail
    assert "4 tasks x 10 CPUs = 40 CPUs per node, the nodes have 4" in checks["cpus"].detail
    assert "set cpus_per_node = 4" in checks["cpus"].hint
    assert checks["gpus"].ok  # 4 fake GPUs per node, as on Cyclone
    assert "not in the profile: g[1-2]" in checks["nodelist"].detail
    assert checks["account"].ok is None  # accounting is off in this capture
    assert checks["modules"].ok is True and checks["modules"].detail == "profile 'cyclone' loads no modules"
    assert doctor.request_problems(CYCLONE_GPU, PARTITIONS["gpu"], GPU_NODES) == ["40 CPUs per node asked, 4 exist"]


def test_missing_partition_fails_and_skips_what_depends_on_it() -> None:
    checks = _static(LOCAL_CPU, None, [])
    assert checks["partition"].ok is False and "does not exist" in checks["partition"].detail
    assert all(checks[n].ok is None for n in ("nodes", "nodelist", "cpus", "gpus", "memory", "max_time"))
    assert doctor.request_problems(LOCAL_CPU, None, []) == ["partition 'cpu' does not exist"]


def test_down_partition_and_too_many_nodes() -> None:
    part = PARTITIONS["cpu"]
    down = cluster.PartitionInfo(**{**part.__dict__, "state": "DOWN"})
    assert doctor.check_partition(LOCAL_CPU, down).ok is False
    one_node = cluster.PartitionInfo(**{**part.__dict__, "total_nodes": 1})
    check = doctor.check_node_count(LOCAL_CPU, one_node)
    assert not check.ok and "--nodes 2 is more than the 1" in check.detail and "use --nodes 1 or fewer" in check.hint


def test_max_time() -> None:
    part = PARTITIONS["cpu"]
    shorter = cluster.PartitionInfo(**{**part.__dict__, "max_time_s": 3600, "max_time": "01:00:00"})
    check = doctor.check_max_time(LOCAL_CPU, shorter)
    assert not check.ok and 'set max_time = "01:00:00"' in check.hint
    unlimited = cluster.PartitionInfo(**{**part.__dict__, "max_time_s": None, "max_time": "UNLIMITED"})
    assert doctor.check_max_time(LOCAL_CPU, unlimited).ok


def test_account_checks() -> None:
    rows = cluster.parse_sacctmgr_assoc(_output("sacctmgr_assoc_root.txt"))
    job_root = doctor_request("local", "cpu", 2, "root")
    assert doctor.check_account(job_root, "accounting_storage/slurmdbd", rows, "", "root").ok
    miss = doctor.check_account(CYCLONE_GPU, "accounting_storage/slurmdbd", rows, "", "root")
    assert miss.ok is False and "no association with account 'p163'" in miss.detail and miss.hint == "use --account root"
    off = doctor.check_account(CYCLONE_GPU, "accounting_storage/none", None, "accounting storage is disabled", "root")
    assert off.ok is None and off.detail == "not checked: accounting storage is disabled"
    required = doctor_request("cyclone", "gpu", 2, "")
    assert doctor.check_account(required, "accounting_storage/none", None, "", "root").ok is False


@pytest.mark.parametrize(("name", "listing", "found"), [
    ("CUDA/12.1.1", "/opt/modules/all:\nCUDA/11.7.0\nCUDA/12.1.1\n", True),
    ("CUDA/12.1.1", "CUDA/12.1.1(default)\n", True),
    ("CUDA", "CUDA/11.7.0\nCUDA/12.1.1\n", True),
    ("CUDA/12.4.0", "CUDA/11.7.0\nCUDA/12.1.1\n", False),
    ("Python/3.10.4-GCCcore-11.3.0", "", False),
])
def test_module_listing(name: str, listing: str, found: bool) -> None:
    assert doctor.module_available(name, listing) is found


def test_module_check_with_and_without_a_module_system() -> None:
    modules = ("Python/3.10.4-GCCcore-11.3.0", "CUDA/12.1.1")
    job = dataclasses.replace(CYCLONE_GPU, profile=dataclasses.replace(CYCLONE_GPU.profile, modules=modules))
    facts = ModuleFacts("lmod", {modules[0]: f"{modules[0]}\n", modules[1]: ""})
    check = doctor.check_modules(job, facts)
    assert check.ok is False and "not available: CUDA/12.1.1" in check.detail and "module spider CUDA" in check.hint
    facts = ModuleFacts("lmod", {m: f"/opt/modules:\n{m}\n" for m in modules})
    assert doctor.check_modules(job, facts).ok
    none = doctor.check_modules(job, ModuleFacts())
    assert none.ok is None and "neither Lmod nor Environment Modules" in none.detail


# --------------------------------------------------------------------------- live checks
def _reports() -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(REPORTS.glob("rank-*.json"))]


HOST = HostVersions(python=_reports()[0]["python"], torch=_reports()[0]["torch"]["version"])


def _result(reports=None, state="COMPLETED", stderr="", finished=True) -> SmokeResult:
    return SmokeResult(job_id="7", state=state, finished=finished, elapsed_s=6, nodelist="c[1-2]",
                       reports=tuple(_reports() if reports is None else reports), stderr=stderr, run_dir="/runs/x")


def _live(result: SmokeResult, job=LOCAL_CPU, host=HOST) -> dict[str, Check]:
    return {c.check: c for c in doctor.live_checks(job, result, host)}


def test_real_reports_pass_every_live_check() -> None:
    checks = _live(_result())
    assert {n: c.ok for n, c in checks.items()} == {n: True for n in doctor.LIVE_CHECKS}
    detail = checks["allreduce"].detail
    assert detail.startswith("gloo, 2 ranks on 2 node(s): sum correct; 8 MiB in ")
    assert "GB/s" in detail and "latency" in detail
    assert "world size 2, ranks 0-1 on c1, c2" in checks["bootstrap"].detail


def test_python_that_never_started_quotes_the_error_line() -> None:
    stderr = ("Fatal Python error: init_fs_encoding: failed to get the Python codec of the filesystem encoding\n"
              "Python runtime state: core initialized\nModuleNotFoundError: No module named 'encodings'\n\n"
              "Current thread 0x00007f (most recent call first):\n  <no Python frame>\n"
              "srun: error: c1: task 0: Exited with exit code 1\n")
    checks = _live(_result(reports=[], state="FAILED", stderr=stderr))
    assert checks["torch_import"].ok is False
    assert checks["torch_import"].detail.endswith("ModuleNotFoundError: No module named 'encodings'")
    assert checks["python"].ok is False and "rank(s) 0-1" in checks["python"].detail
    assert checks["smoke_job"].ok is False and "FAILED" in checks["smoke_job"].detail
    assert all(checks[n].ok is None for n in ("gpus_per_task", "bootstrap", "allreduce", "network"))
    assert doctor.exit_code(list(checks.values())) == 1


@pytest.mark.parametrize(("stderr", "line"), [
    ("/var/spool/slurmd/job01/slurm_script: line 14: /no/venv/bin/activate: No such file or directory\n"
     "srun: error: c1: task 0: Exited with exit code 1\n",
     "/var/spool/slurmd/job01/slurm_script: line 14: /no/venv/bin/activate: No such file or directory"),
    ("cyclone_kit: job 5 on c[1-2] master c1:15005 restart 0\nline 12: module: command not found\n",
     "line 12: module: command not found"),
    ("Traceback (most recent call last):\n  File \"x\", line 1\nImportError: libcudnn.so.9: cannot open shared object\n",
     "ImportError: libcudnn.so.9: cannot open shared object"),
    ("srun: error: c2: task 1: Exited with exit code 1\n", "srun: error: c2: task 1: Exited with exit code 1"),
    # real: a profile whose python does not exist on the nodes
    ("srun: error: c2: task 1: Exited with exit code 2\n"
     "slurmstepd-c2: error: execve(): /nonexistent/bin/python3: No such file or directory\n"
     "srun: error: c1: task 0: Exited with exit code 2\n",
     "slurmstepd-c2: error: execve(): /nonexistent/bin/python3: No such file or directory"),
    ("/venv/lib/python3.11/site-packages/torch/cuda/__init__.py:63: UserWarning: CUDA initialization: no driver\n"
     "RuntimeError: the probe failed\n", "RuntimeError: the probe failed"),
    ("", ""),
])
def test_error_line(stderr: str, line: str) -> None:
    assert doctor.error_line(stderr) == line


def test_torch_import_failure_on_one_rank() -> None:
    reports = copy.deepcopy(_reports())
    reports[1]["torch"] = {"ok": False, "error": "ModuleNotFoundError: No module named 'torch'"}
    del reports[1]["bootstrap"], reports[1]["allreduce"]
    check = doctor.check_torch_import(LOCAL_CPU, _result(reports), HOST)
    assert check.ok is False and check.detail == "import torch failed on rank(s) 1: ModuleNotFoundError: No module named 'torch'"


def test_reports_cut_short_by_a_kill_or_hang() -> None:
    # a rank's report is rewritten after each stage: a killed rank leaves the last stage it finished
    reports = copy.deepcopy(_reports())
    for key in ("torch", "bootstrap", "allreduce", "done"):
        del reports[1][key]
    checks = _live(_result(reports, state="CANCELLED"))
    assert checks["torch_import"].detail == "import torch never finished on rank(s) 1 (killed or hung while importing)"
    reports = copy.deepcopy(_reports())
    reports[0]["bootstrap"] = {k: v for k, v in reports[0]["bootstrap"].items() if k not in ("init_ok", "init_s")}
    del reports[0]["allreduce"], reports[0]["done"]
    checks = _live(_result(reports, state="TIMEOUT"))
    assert checks["bootstrap"].ok is False and "rank(s) 0 never finished joining" in checks["bootstrap"].detail
    reports = copy.deepcopy(_reports())
    reports[1]["allreduce"] = {"backend": "gloo", "world_size": 2}  # killed inside the all-reduce
    del reports[1]["done"]
    checks = _live(_result(reports, state="TIMEOUT"))
    assert checks["allreduce"].ok is False and "never finished on rank(s) 1" in checks["allreduce"].detail
    assert checks["torch_import"].ok and checks["python"].ok


def test_version_mismatch_with_the_submit_host() -> None:
    checks = _live(_result(), host=HostVersions(python="3.9.0", torch="1.12.1"))
    assert checks["python"].ok is False and "the submit host 3.9.0" in checks["python"].detail
    assert checks["torch_import"].ok is False and "the submit host has 1.12.1" in checks["torch_import"].detail


@pytest.mark.parametrize(("a", "b", "same"), [
    ("2.14.1", "2.14.1+cu130", True),
    ("2.14.1+cu130", "2.14.1+cu130", True),
    ("2.14.1+cpu", "2.14.1+cu130", False),
    ("2.14.0", "2.14.1", False),
])
def test_same_version(a: str, b: str, same: bool) -> None:
    assert doctor.same_version(a, b) is same and doctor.same_version(b, a) is same


def test_gpus_per_task_on_fake_gpus() -> None:
    # Real reports of `doctor --profile local --partition gpu --nodes 2`: --gres=gpu:4, 4 tasks per node,
    # each task sees the node's 4 (fake) devices, and torch, finding no driver, sees none.
    job = doctor_request("local", "gpu", 2, "")
    reports = [json.loads(p.read_text()) for p in sorted(REPORTS_GPU.glob("rank-*.json"))]
    assert {r["cuda_visible_devices"] for r in reports} == {"0,1,2,3"}
    checks = _live(_result(reports), job=job)
    assert checks["gpus_per_task"].ok is False
    assert checks["gpus_per_task"].detail == "rank 0: CUDA_VISIBLE_DEVICES=0,1,2,3 but torch sees 0 GPU(s) (ranks 0-7)"
    assert checks["bootstrap"].ok and "world size 8, ranks 0-7 on g1, g2" in checks["bootstrap"].detail
    assert checks["allreduce"].ok and checks["allreduce"].detail.startswith("gloo, 8 ranks on 2 node(s)")
    # with a driver torch would see them all: passes
    for r in reports:
        r["torch"]["cuda_device_count"] = 4
    assert doctor.check_gpus_per_task(job, _result(reports)).ok
    # a task without CUDA_VISIBLE_DEVICES (GPUs not requested the way the cluster expects)
    reports[5]["cuda_visible_devices"] = None
    unset = doctor.check_gpus_per_task(job, _result(reports))
    assert unset.ok is False and "rank 5 has CUDA_VISIBLE_DEVICES=(unset)" in unset.detail


def test_bootstrap_failures() -> None:
    reports = copy.deepcopy(_reports())
    reports[1]["bootstrap"] = {"error": "init_process_group failed: DistStoreError: timed out", "master_connect": "ok"}
    check = doctor.check_bootstrap(LOCAL_CPU, _result(reports))
    assert check.ok is False and check.detail.startswith("rank(s) 1: init_process_group failed")
    reports = copy.deepcopy(_reports())
    reports[1]["host"] = reports[0]["host"]
    reports[0]["bootstrap"]["port_free"] = False
    check = doctor.check_bootstrap(LOCAL_CPU, _result(reports))
    assert "ranks ran on 1 host(s)" in check.detail and "was taken" in check.detail


def test_allreduce_wrong_sum_and_network_variables() -> None:
    reports = copy.deepcopy(_reports())
    reports[1]["allreduce"]["correct"] = False
    assert doctor.check_allreduce(LOCAL_CPU, _result(reports)).ok is False
    reports = copy.deepcopy(_reports())
    for r in reports:
        r["net_env"] = {"NCCL_SOCKET_IFNAME": "ib0"}
    check = doctor.check_network(LOCAL_CPU, _result(reports))
    assert check.ok is False and "NCCL_SOCKET_IFNAME=ib0 but" in check.detail
    for r in reports:
        r["net_env"] = {"NCCL_SOCKET_IFNAME": "^docker,lo", "GLOO_SOCKET_IFNAME": "l"}  # exclusion; prefix of lo
    assert doctor.check_network(LOCAL_CPU, _result(reports)).ok
    reports[0]["net_env"] = {}
    assert "different network variables" in doctor.check_network(LOCAL_CPU, _result(reports)).detail


def test_smoke_job_not_finished_or_refused() -> None:
    waited = doctor.check_smoke_job(LOCAL_CPU, SmokeResult("9", "PENDING", False, reason="Resources", cancelled=True))
    assert waited.ok is False and "--wait-timeout" in waited.hint
    assert waited.detail == "job 9 still PENDING when doctor stopped waiting (reason: Resources); it was cancelled"
    lost = doctor.check_smoke_job(LOCAL_CPU, SmokeResult("9", "RUNNING", False, reason="lost contact with Slurm: x"))
    assert lost.detail == "job 9 still RUNNING when doctor stopped waiting (reason: lost contact with Slurm: x)"
    refused = doctor.check_smoke_job(LOCAL_CPU, SmokeResult("", "", False, reason="sbatch rejected x"))
    assert refused.ok is False and "sbatch refused" in refused.detail
    # a job that never ran is one row, not seven
    assert doctor.live_checks(LOCAL_CPU, SmokeResult("", "", False, reason="sbatch rejected x"), HOST) == [refused]
    assert [c.check for c in doctor.live_checks(LOCAL_CPU, SmokeResult("9", "PENDING", False), HOST)] == ["smoke_job"]


# --------------------------------------------------------------------------- output
def test_output_table_and_json() -> None:
    checks = [Check("a", True, "fine"), Check("b", False, "broken", "fix it"), Check("c", None, "not checked: off")]
    table = doctor.format_table(checks)
    assert table.splitlines() == ["ok    a  fine", "FAIL  b  broken  HINT: fix it", "skip  c  not checked: off",
                                  "1 passed, 1 failed, 1 not checked"]
    assert json.loads(doctor.to_json(checks))[1] == {"check": "b", "ok": False, "detail": "broken", "hint": "fix it"}
    assert doctor.exit_code(checks) == 1
    assert doctor.exit_code([checks[0], checks[2]]) == 0


def test_doctor_script_extends_the_base_template() -> None:
    # the profile's own modules and setup lines go into the smoke job as into any training job
    base = doctor_request("cyclone", "gpu", 2, "p163")
    job = dataclasses.replace(base, profile=dataclasses.replace(
        base.profile, modules=("CUDA/12.1.1",), setup=("source $HOME/venvs/torch/bin/activate",)))
    run_dir = "/scratch/p163/runs/ck-doctor-20260101-000000"
    text = render_script(job, run_dir, python="/opt/venv/bin/python", template="doctor.sbatch.j2",
                         environ={"CYCLONE_KIT_TEMPLATES": "/nonexistent"},
                         extra={"probe_dir": f"{run_dir}/doctor", "probe_timeout_s": 30, "probe_megabytes": 8})
    golden = GOLDEN / "doctor_cyclone_gpu_2nodes.sbatch"
    if os.environ.get("CK_REGEN_GOLDEN") == "1":
        golden.write_text(text)
    assert text == golden.read_text()
    for line in ("#SBATCH --nodes=2", "#SBATCH --gres=gpu:4", "#SBATCH --account=p163", "#SBATCH --time=00:03:00",
                 "module load CUDA/12.1.1", "source $HOME/venvs/torch/bin/activate", "--cpu-bind=cores",
                 "-m cyclone_kit.doctor.probe --out"):
        assert line in text
    assert "--requeue" not in text and "--signal" not in text


