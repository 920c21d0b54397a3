"""Pure parts of running a user's script: the [script] table, argument placeholders, the script
check, the CLI split at ``--``, the shim's argument parsing, torchrun variables and records."""

from __future__ import annotations

import io
import shlex
from pathlib import Path

import pytest

from cyclone_kit.cli.app import split_script_args
from cyclone_kit.config.job import ScriptConfig, job_name_for, resolve_key, spec_from_dict, spec_to_dict
from cyclone_kit.config.jobspec import is_script_path
from cyclone_kit.config.profile import load_profile
from cyclone_kit.config.script import check_script, compile_check, fill_args, fill_script_args, sha256_hex
from cyclone_kit.config.sweep import expand, sweep_from_dict
from cyclone_kit.config.validate import resolve
from cyclone_kit.core.errors import ValidationError
from cyclone_kit.runtime.env import DistEnv, detect
from cyclone_kit.runtime.launch import (
    TIME_TO_SOLUTION,
    ShimArgs,
    UsageError,
    end_record,
    exit_status,
    parse_args,
    shim_command,
    start_record,
    time_to_solution_records,
    torchrun_variables,
    whole_lines,
)
from cyclone_kit.submit.render import render_script

SHA = "a" * 64


# --------------------------------------------------------------------------- [script] table
def test_script_table_stands_instead_of_train_and_round_trips() -> None:
    spec = spec_from_dict({"name": "mine", "script": {"path": "/x/train.py", "args": ["--lr", "0.1"], "batch_size": 32}})
    assert spec.script == ScriptConfig(path="/x/train.py", args=("--lr", "0.1"), batch_size=32)
    assert spec.per_device_batch_size == 32
    data = spec_to_dict(spec)
    assert "train" not in data and data["script"]["args"] == ["--lr", "0.1"]
    assert spec_from_dict(data) == spec
    builtin = spec_to_dict(spec_from_dict({}))
    assert "script" not in builtin and "train" in builtin  # a built-in job's spec.json is unchanged


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({}, "exactly one of path and module"),
        ({"path": "a.py", "module": "pkg.a"}, "exactly one of path and module"),
        ({"module": "pkg.not-a-name"}, "is not a dotted module name"),
        ({"path": "a.py", "args": ["--n", 3]}, "script.args must be a list of strings"),
        ({"path": "a.py", "batch_size": -1}, "script.batch_size must not be negative"),
        ({"path": "a.py", "sha256": "xyz"}, "is not a SHA-256 hex digest"),
        ({"path": "a.py", "entry": "main"}, "unknown key(s) in [script]: entry"),
    ],
)
def test_script_table_refusals_are_one_line(table: dict, message: str) -> None:
    with pytest.raises(ValidationError) as info:
        spec_from_dict({"script": table})
    assert message in str(info.value) and "HINT" in str(info.value) and "\n" not in str(info.value)


def test_script_and_train_together_are_refused() -> None:
    with pytest.raises(ValidationError, match=r"both \[train\] and \[script\]"):
        spec_from_dict({"train": {"steps": 3}, "script": {"path": "a.py"}})


def test_set_reaches_the_script_table_only_by_its_full_key() -> None:
    assert resolve_key("script.args") == ("script", "args")
    assert resolve_key("batch_size") == ("train", "batch_size")  # unchanged for built-in jobs


def test_placeholders_are_filled_and_other_braces_kept() -> None:
    values = {"per_device_batch_size": 64, "global_batch_size": 128, "world_size": 2, "num_nodes": 1}
    args = ["--batch-size={per_device_batch_size}", "{global_batch_size}", "-n", "{world_size}x{num_nodes}",
            '{"json": 1}', "{other}"]
    assert fill_script_args(args, values) == ("--batch-size=64", "128", "-n", "2x1", '{"json": 1}', "{other}")
    with pytest.raises(ValidationError, match=r"uses \{per_device_batch_size\} but this job does not know it"):
        fill_script_args(["{per_device_batch_size}"], {"world_size": 2})


# --------------------------------------------------------------------------- the script check
def test_check_script_resolves_hashes_and_refuses_what_cannot_run(tmp_path: Path) -> None:
    good = tmp_path / "train.py"
    good.write_text("import sys\nprint(sys.argv)\n")
    checked = check_script(ScriptConfig(path="train.py"), tmp_path)
    assert checked.config.path == str(good) and checked.config.sha256 == sha256_hex(good.read_bytes())
    assert checked.copy_name == "script/train.py" and checked.content == good.read_bytes()
    assert not (tmp_path / "__pycache__").exists()  # nothing written next to the user's file

    with pytest.raises(ValidationError, match=r"script 'missing.py' does not exist"):
        check_script(ScriptConfig(path="missing.py"), tmp_path)
    with pytest.raises(ValidationError, match=r"is a directory"):
        check_script(ScriptConfig(path=str(tmp_path)), tmp_path)
    bad = tmp_path / "bad.py"
    bad.write_text("x = 1\ndef f(:\n    pass\n")
    with pytest.raises(ValidationError) as info:
        check_script(ScriptConfig(path=str(bad)), tmp_path)
    assert f"{bad}, line 2: SyntaxError" in str(info.value) and "py_compile" in str(info.value)


def test_compile_check_refuses_nul_bytes() -> None:
    with pytest.raises(ValidationError, match=r"cannot be compiled|SyntaxError"):
        compile_check(b"x = 1\x00\n", "nul.py")


def test_check_script_finds_a_module_and_a_package_main() -> None:
    assert check_script(ScriptConfig(module="json.tool"), ".").source_path.name == "tool.py"
    assert check_script(ScriptConfig(module="venv"), ".").source_path.name == "__main__.py"  # a package
    with pytest.raises(ValidationError, match="module 'no_such_module_ck' cannot be found"):
        check_script(ScriptConfig(module="no_such_module_ck"), ".")


@pytest.mark.parametrize(("script", "name"), [
    (ScriptConfig(path="/a/plain_ddp.py"), "plain_ddp"),
    (ScriptConfig(path="/a/my train!.py"), "my-train-"),
    (ScriptConfig(module="pkg.train_main"), "train_main"),
    (ScriptConfig(path="/a/.hidden.py"), "hidden"),
])
def test_job_name_for(script: ScriptConfig, name: str) -> None:
    assert job_name_for(script) == name


# --------------------------------------------------------------------------- command lines
@pytest.mark.parametrize(("argv", "own", "script"), [
    (["submit", "t.py", "--nodes", "2"], ["submit", "t.py", "--nodes", "2"], None),
    (["submit", "t.py", "--", "--lr", "0.1", "--", "x"], ["submit", "t.py"], ["--lr", "0.1", "--", "x"]),
    (["run", "t.py", "--"], ["run", "t.py"], []),
])
def test_split_script_args(argv: list[str], own: list[str], script: list[str] | None) -> None:
    assert split_script_args(argv) == (own, script)


def test_is_script_path() -> None:
    assert is_script_path("examples/plain_ddp.py") and not is_script_path("jobs/smoke.toml")
    assert not is_script_path(None)


@pytest.mark.parametrize(("argv", "expected"), [
    (["--run-dir", "/r", "t.py", "--lr", "1"], ShimArgs("/r", False, "t.py", None, ("--lr", "1"))),
    (["--run-dir=/r", "--horovod", "-m", "pkg.mod", "-x"], ShimArgs("/r", True, None, "pkg.mod", ("-x",))),
    (["--", "-weird.py", "a"], ShimArgs("/env", False, "-weird.py", None, ("a",))),
    (["t.py", "--run-dir", "/not-ours"], ShimArgs("/env", False, "t.py", None, ("--run-dir", "/not-ours"))),
])
def test_shim_parses_its_options_then_the_script(argv: list[str], expected: ShimArgs) -> None:
    assert parse_args(argv, {"CYCLONE_RUN_DIR": "/env"}) == expected


@pytest.mark.parametrize("argv", [[], ["--run-dir", "/r"], ["-m"], ["--bogus", "t.py"]])
def test_shim_usage_errors(argv: list[str]) -> None:
    with pytest.raises(UsageError):
        parse_args(argv, {})


def test_shim_command() -> None:
    assert shim_command(ScriptConfig(path="/a/t.py", args=("x",)), "/r", python="py") == [
        "py", "-m", "cyclone_kit.runtime.launch", "--run-dir", "/r", "/a/t.py", "x"]
    assert shim_command(ScriptConfig(module="m.n"), "/r", python="py", horovod=True) == [
        "py", "-m", "cyclone_kit.runtime.launch", "--run-dir", "/r", "--horovod", "-m", "m.n"]


def test_rank_command_is_the_shim_for_scripts_only() -> None:
    from cyclone_kit.rundir.entry import rank_argv

    assert rank_argv(spec_from_dict({}), "/r", python="py") == ["py", "-m", "cyclone_kit.runtime", "--run-dir", "/r"]
    spec = spec_from_dict({"script": {"module": "m"}, "resources": {"launcher": "horovod"}})
    assert rank_argv(spec, "/r", python="py") == ["py", "-m", "cyclone_kit.runtime.launch", "--run-dir", "/r", "--horovod",
                                                  "-m", "m"]


@pytest.mark.parametrize(("code", "status"), [(None, 0), (0, 0), (3, 3), (True, 1), ("bye", 1), (256 + 4, 4), (-1, 255)])
def test_exit_status(code: object, status: int) -> None:
    assert exit_status(code) == status


# --------------------------------------------------------------------------- torchrun variables
SRUN_TASK = {
    "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
    "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURM_STEP_NODELIST": "c[1-2]", "SLURM_JOB_NODELIST": "c[1-2]", "SLURMD_NODENAME": "c2",
    "MASTER_ADDR": "c1", "MASTER_PORT": "15123",
}


def test_torchrun_variables_of_an_srun_task_detect_back_to_the_same_rank() -> None:
    env = detect(SRUN_TASK)
    variables = torchrun_variables(env)
    assert variables == {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
                         "GROUP_RANK": "1", "ROLE_RANK": "3", "ROLE_WORLD_SIZE": "4",
                         "MASTER_ADDR": "c1", "MASTER_PORT": "15123"}
    again = detect({**SRUN_TASK, **variables})  # what ck.init() / the script sees: torchrun first
    assert (again.rank, again.world_size, again.local_rank, again.node_rank, again.hostnames, again.job_id) == (
        3, 4, 1, 1, ("c1", "c2"), "77")


# --------------------------------------------------------------------------- records
def test_time_to_solution_records_give_the_wall_time_speedup() -> None:
    env = DistEnv(rank=0, world_size=2, local_world_size=2, launcher="slurm", hostnames=("c1",), job_id="9")
    shim = ShimArgs("/r", False, "/a/t.py", None, ("--x",))
    spec = spec_from_dict({"script": {"path": "/a/t.py", "batch_size": 64, "sha256": SHA}})
    start = start_record(env, shim, spec, "2026-01-01T00:00:00.000+00:00")
    assert (start["world_size"], start["hostnames"], start["sha256"], start["script"]) == (2, ["c1"], SHA, "/a/t.py")
    assert (start["launcher"], start["slurm_job_id"]) == ("slurm", "9")
    # the local launcher's SLURM_JOB_ID is made up: no job id, launcher "local" (as the engine's records say)
    local = start_record(env, shim, spec, "2026-01-01T00:00:00.000+00:00", {"CYCLONE_LAUNCHER": "local"})
    assert (local["launcher"], local["slurm_job_id"]) == ("local", None)
    end = end_record("completed", 0, 4.0, "2026-01-01T00:00:04.000+00:00")
    head, tail = time_to_solution_records(start, end, spec, "t")
    assert head["kind"] == "start" and head["strategy"] == TIME_TO_SOLUTION and head["world_size"] == 2
    assert (head["per_device_batch_size"], head["global_batch_size"]) == (64, 128)
    assert tail["kind"] == "end" and tail["status"] == "completed" and tail["samples_per_s"] == pytest.approx(0.25)
    failed = time_to_solution_records(start, end_record("failed", 3, 4.0, "t"), spec, "t")[1]
    assert failed["status"] == "failed" and failed["samples_per_s"] is None


# --------------------------------------------------------------------------- rendering and sweeps
HOSTILE = ["--name", "a b; rm -rf /", "it's", "$(reboot)", "line\nbreak"]


@pytest.mark.parametrize("launcher", ["srun", "torchrun", "horovod"])
def test_every_launcher_runs_the_shim_with_quoted_args(launcher: str) -> None:
    profile = load_profile("local")
    gpus = {"partition": "gpu", "gpus_per_node": 2} if launcher == "torchrun" else {}
    spec = spec_from_dict({"name": "s", "script": {"path": "/p q/t.py", "args": HOSTILE},
                           "resources": {"profile": "local", "nodes": 2, "launcher": launcher, **gpus}})
    text = render_script(resolve(spec, profile), "/runs/s 1")
    line = next(x for x in text.split("\n    ") if "cyclone_kit.runtime.launch" in x)
    words = shlex.split(text[text.index("-m cyclone_kit.runtime.launch"):])
    assert words[:4] == ["-m", "cyclone_kit.runtime.launch", "--run-dir", "/runs/s 1"]
    rest = words[4:]
    if launcher == "horovod":
        assert rest[0] == "--horovod"
        rest = rest[1:]
    assert rest[: 1 + len(HOSTILE)] == ["/runs/s 1/script/t.py", *HOSTILE], line  # the snapshot runs
    assert "cyclone_kit.runtime " not in text and "cyclone_kit.runtime\n" not in text  # the shim, not the trainer


def test_submit_fills_placeholders_from_the_layout() -> None:
    spec = spec_from_dict({"script": {"path": "/t.py", "batch_size": 32,
                                      "args": ["--bs", "{per_device_batch_size}", "--gbs", "{global_batch_size}",
                                               "--n", "{world_size}", "--nodes", "{num_nodes}"]},
                           "resources": {"profile": "local", "nodes": 2, "ntasks_per_node": 2}})
    job = fill_args(resolve(spec, load_profile("local")))
    assert job.spec.script is not None
    assert job.spec.script.args == ("--bs", "32", "--gbs", "128", "--n", "4", "--nodes", "2")


def test_strong_sweep_of_a_script_divides_the_global_batch() -> None:
    sweep = sweep_from_dict({
        "sweep": {"name": "s", "mode": "strong", "global_batch_size": 128, "world_sizes": [1, 2]},
        "base": {"script": {"path": "/t.py", "args": ["--batch-size", "{per_device_batch_size}"]},
                 "resources": {"profile": "local"}},
    })
    runs = expand(sweep, load_profile("local"))
    assert [(r.world_size, r.per_device_batch_size, r.record()["global_batch_size"]) for r in runs] == [
        (1, 128, 128), (2, 64, 128)]
    assert [r.job.spec.script.args for r in runs] == [("--batch-size", "128"), ("--batch-size", "64")]


def test_weak_sweep_of_a_script_needs_its_batch() -> None:
    data = {"sweep": {"name": "s", "mode": "weak", "world_sizes": [1, 2]},
            "base": {"script": {"path": "/t.py"}, "resources": {"profile": "local"}}}
    with pytest.raises(ValidationError, match="needs the per-device batch"):
        sweep_from_dict(data)
    data["base"]["script"]["batch_size"] = 16
    assert [r.per_device_batch_size for r in expand(sweep_from_dict(data), load_profile("local"))] == [16, 16]


class _Raw(io.RawIOBase):
    """A raw stream that records each system-call-sized write."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:  # type: ignore[override]
        self.writes.append(bytes(data))
        return len(data)


def test_the_shim_sends_each_printed_line_with_its_newline_in_one_write() -> None:
    # as under PYTHONUNBUFFERED=1: text and newline went out in two writes, where a peer's line could land
    raw = _Raw()
    stream = io.TextIOWrapper(raw, encoding="utf-8", write_through=True)
    print("rank 2 of 4", file=stream)
    assert raw.writes == [b"rank 2 of 4", b"\n"]
    raw.writes.clear()
    whole_lines(stream)
    print("rank 3 of 4", file=stream)
    print("50%", end="", file=stream, flush=True)   # a progress line still leaves at its flush
    assert raw.writes == [b"rank 3 of 4\n", b"50%"]
    whole_lines(object())   # a replaced stream without reconfigure is left as it is
