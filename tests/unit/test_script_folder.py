"""Pure parts of "a user's script as it is, on the cluster" (issue 21): the job's working directory,
the snapshot of the script's folder, torchrun workers per node on CPU nodes, the process-group
verdict, ACCELERATE_USE_CPU, the failure record's first writer and text-or-binary logs."""

from __future__ import annotations

import argparse
import json
import shlex

import pytest

from cyclone_kit.cli.logs import is_text
from cyclone_kit.config.job import ScriptConfig, spec_from_dict
from cyclone_kit.config.jobspec import spec_dict_from_args
from cyclone_kit.config.profile import load_profile
from cyclone_kit.config.script import check_script, importable_files
from cyclone_kit.config.validate import resolve, resolved_spec
from cyclone_kit.core.errors import ValidationError
from cyclone_kit.rundir import failures
from cyclone_kit.rundir.entry import rank_words
from cyclone_kit.runtime import pgcheck
from cyclone_kit.runtime.launch import end_record, time_to_solution_records
from cyclone_kit.submit.render import render_script


# --------------------------------------------------------------------------- working directory
def test_the_working_directory_is_the_submit_folder_unless_told(tmp_path) -> None:
    script = tmp_path / "t.py"
    script.write_text("print(1)\n")
    (tmp_path / "other").mkdir()
    assert check_script(ScriptConfig(path=str(script)), tmp_path).config.chdir == str(tmp_path)
    assert check_script(ScriptConfig(path=str(script), chdir="other"), tmp_path).config.chdir == str(tmp_path / "other")
    with pytest.raises(ValidationError, match="does not exist") as e:
        check_script(ScriptConfig(path=str(script), chdir="missing"), tmp_path)
    assert "--chdir" in e.value.hint


def test_the_batch_script_cds_into_the_quoted_working_directory() -> None:
    hostile = "/work/my proj; rm -rf $(x)/it's"
    spec = spec_from_dict({"name": "s", "script": {"path": "/p/t.py", "chdir": hostile},
                           "resources": {"profile": "local", "nodes": 2}})
    text = render_script(resolve(spec, load_profile("local")), "/runs/s")
    line = next(x for x in text.splitlines() if x.startswith("cd "))
    assert shlex.split(line) == ["cd", hostile]
    assert text.index(line) < text.index("srun ")
    # the built-in trainer is unchanged: no cd (its golden scripts hold)
    builtin = render_script(resolve(spec_from_dict({"resources": {"profile": "local"}}), load_profile("local")), "/r")
    assert "\ncd " not in builtin


def test_chdir_and_live_code_flags_are_for_script_jobs_only(tmp_path) -> None:
    args = argparse.Namespace(spec=None, module=None, script_args=[], overrides=[], chdir=str(tmp_path),
                              live_code=False)
    with pytest.raises(ValidationError, match="--chdir is for a script job"):
        spec_dict_from_args(args)
    args = argparse.Namespace(spec="t.py", module=None, script_args=[], overrides=[], chdir="sub", live_code=True)
    table = spec_dict_from_args(args)["script"]
    assert table["live"] is True and table["chdir"].endswith("/sub") and table["chdir"].startswith("/")


# --------------------------------------------------------------------------- snapshot
def test_the_snapshot_holds_what_the_script_can_import_from_its_folder(tmp_path) -> None:
    for rel in ("train.py", "model.py", "pkg/__init__.py", "pkg/sub/deep.py", "pkg/README.md", "notpkg/x.py",
                ".hidden/h.py", "venv/pyvenv.cfg", "venv/__init__.py", "pkg/__pycache__/c.py", "data.csv"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    assert importable_files(tmp_path) == ["model.py", "pkg/__init__.py", "pkg/sub/deep.py", "train.py"]
    checked = check_script(ScriptConfig(path=str(tmp_path / "train.py")), tmp_path)
    assert sorted(checked.files()) == ["script/model.py", "script/pkg/__init__.py", "script/pkg/sub/deep.py",
                                       "script/train.py"]
    live = check_script(ScriptConfig(path=str(tmp_path / "train.py"), live=True), tmp_path)
    assert sorted(live.files()) == ["script/train.py"]  # the record's copy only


def test_a_snapshot_over_its_bound_is_refused_with_the_way_out(tmp_path) -> None:
    for i in range(4):
        (tmp_path / f"m{i}.py").write_text("x = 1\n")
    with pytest.raises(ValidationError, match="more than 3 Python files") as e:
        importable_files(tmp_path, max_files=3)
    assert "--live-code" in e.value.hint
    with pytest.raises(ValidationError, match="0 MiB"):
        importable_files(tmp_path, max_bytes=10)


def test_ranks_run_the_snapshot_unless_live() -> None:
    spec = spec_from_dict({"script": {"path": "/src/t.py", "args": ["-x"]}})
    assert rank_words(spec, "/r")[-2:] == ["/r/script/t.py", "-x"]
    live = spec_from_dict({"script": {"path": "/src/t.py", "args": ["-x"], "live": True}})
    assert rank_words(live, "/r")[-2:] == ["/src/t.py", "-x"]
    module = spec_from_dict({"script": {"module": "pkg.train"}})
    assert rank_words(module, "/r")[-2:] == ["-m", "pkg.train"]


# --------------------------------------------------------------------------- torchrun workers on CPU nodes
def test_torchrun_takes_workers_per_node_on_cpu_nodes() -> None:
    spec = spec_from_dict({"script": {"path": "/t.py"},
                           "resources": {"profile": "local", "nodes": 2, "launcher": "torchrun", "ntasks_per_node": 2}})
    job = resolve(spec, load_profile("local"))
    assert (job.ntasks_per_node, job.procs_per_node, job.world_size) == (1, 2, 4)
    text = render_script(job, "/r")
    assert "--nproc-per-node=2" in text and "#SBATCH --ntasks-per-node=1" in text
    assert resolved_spec(job).resources.ntasks_per_node == 2  # spec.json says what the flag meant


def test_torchrun_workers_need_a_core_each() -> None:
    spec = spec_from_dict({"script": {"path": "/t.py"},
                           "resources": {"profile": "local", "launcher": "torchrun", "ntasks_per_node": 3,
                                         "cpus_per_task": 2}})
    with pytest.raises(ValidationError, match="3 torchrun workers per node but --cpus-per-task=2"):
        resolve(spec, load_profile("local"))


# --------------------------------------------------------------------------- process group verdict
@pytest.mark.parametrize(("launched", "formed", "used", "said"), [
    (1, None, None, ""), (4, 4, None, ""), (4, 4, 12, ""), (4, None, None, "4 ranks ran as 4 independent copies"),
    (4, 1, None, "4 ranks ran as 4 independent copies"),
    (4, 2, 5, "4 ranks formed process groups of 2, not one of world 4"),
    # accelerate without ACCELERATE_USE_CPU on CPU nodes: the group of 4 is formed, then never used
    (4, 4, 0, "4 ranks ran as 4 independent copies: they formed a process group of world 4 but never communicated"),
])
def test_verdict(launched: int, formed: int | None, used: int | None, said: str) -> None:
    text = pgcheck.verdict(launched, formed, used)
    assert text.startswith(said) and bool(text) == bool(said)


def test_accelerate_is_told_to_use_the_cpu_on_nodes_without_gpus_unless_set() -> None:
    env: dict[str, str] = {}
    assert pgcheck.cpu_accelerate_default(env, gpus=False) and env == {"ACCELERATE_USE_CPU": "1"}
    env = {"ACCELERATE_USE_CPU": "0"}
    assert not pgcheck.cpu_accelerate_default(env, gpus=False) and env == {"ACCELERATE_USE_CPU": "0"}
    env = {}
    assert not pgcheck.cpu_accelerate_default(env, gpus=True) and env == {}
    assert pgcheck.gpus_present(["/dev/nvidia0"]) and not pgcheck.gpus_present([])


def test_the_finding_reaches_the_end_and_time_to_solution_records() -> None:
    warning = pgcheck.verdict(4, None)
    end = end_record("completed", 0, 8.0, "t1", process_group_world=None, warning=warning)
    assert end["warning"] == warning and end["process_group_world"] is None
    assert "warning" not in end_record("completed", 0, 8.0, "t1", process_group_world=4)
    start = {"world_size": 4, "num_nodes": 2, "local_world_size": 2, "launcher": "slurm", "hostnames": ["c1", "c2"],
             "slurm_job_id": "7", "pid": 1, "time": "t0", "restart_count": 0}
    spec = spec_from_dict({"script": {"path": "/t.py", "samples_per_run": 6000}})
    head, tail = time_to_solution_records(start, end, spec, "t")
    assert head["samples_per_run"] == 6000 and tail["warning"] == warning


# --------------------------------------------------------------------------- failure.json: first writer wins
def test_the_first_failing_rank_writes_failure_json_and_later_ones_do_not(tmp_path) -> None:
    failures.write_error_record(tmp_path, 2, "c2", ValueError("boom on rank two"), "Traceback ...")
    failures.write_error_record(tmp_path, 0, "c1", RuntimeError("connection closed by peer"), "Traceback ...")
    assert failures.record_rank_failure(tmp_path, 2, written_by="rank", job_id="9")
    assert not failures.record_rank_failure(tmp_path, 0, written_by="watchdog", job_id="9")
    doc = json.loads((tmp_path / "failure.json").read_text())
    assert doc["written_by"] == "rank" and doc["rank"] == 2 and doc["root_cause"] == "rank 2 on c2: ValueError: boom on rank two"
    assert failures.root_cause(tmp_path) == doc["root_cause"]


def test_a_non_zero_exit_without_a_record_is_named_by_the_fallback(tmp_path) -> None:
    fallback = failures.death_record(1, "c1", 42, 3, "t", "9")
    assert failures.record_rank_failure(tmp_path, 1, written_by="watchdog", exit_code=3, fallback=fallback)
    assert failures.root_cause(tmp_path) == "rank 1 on c1: exited with code 3, ExitedWithoutRecord: the rank process " \
                                            "exited with code 3 without writing an error record"


# --------------------------------------------------------------------------- logs: text only
@pytest.mark.parametrize(("head", "text"), [
    (b"epoch 1 loss 0.3\n\x1b[32mok\x1b[0m\n", True), (b"", True), ("π ≈ 3.14\n".encode(), True),
    (b"\x18\x00\x00\x00\x00\x00\x00\x00\xa3\x7f\x4b\x0f brain.Event", False), (bytes(range(1, 32)) * 8, False),
])
def test_is_text(head: bytes, text: bool) -> None:
    assert is_text(head) is text

