"""Issue 29 item 3: what a script's rank sees of torchrun's variables (``script.dist_env``; pure parts)."""

from __future__ import annotations

import argparse
import os

import pytest

from cyclone_kit.config.job import ScriptConfig, spec_from_dict, spec_to_dict
from cyclone_kit.config.jobspec import script_flag_values
from cyclone_kit.core.errors import ValidationError
from cyclone_kit.runtime import pgcheck
from cyclone_kit.runtime.env import DistEnv, detect
from cyclone_kit.runtime.launch import (
    TORCHRUN_VARIABLES,
    ShimArgs,
    dist_env_choice,
    exports_torchrun_variables,
    fabric_variables,
    missing_variable_hint,
    prepare_rank,
    requires_torchrun_variables,
)

SHIM = ShimArgs(None, False, "t.py", None, ())
#: What `cyclone-kit run --nproc 1` gives its one rank (the local launcher's srun-like variables).
ONE_TASK = {"SLURM_JOB_ID": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
            "SLURM_STEP_ID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_NODELIST": "localhost",
            "SLURM_JOB_NODELIST": "localhost", "SLURM_STEP_TASKS_PER_NODE": "1", "SLURM_TASKS_PER_NODE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29600", "CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.parametrize(("env", "dist_env", "exported"), [
    (DistEnv(), "auto", False),                                            # python SCRIPT: none
    (DistEnv(launcher="slurm"), "auto", False),                            # a one-task srun job: Slurm's only
    (DistEnv(world_size=2, local_world_size=2), "auto", True),             # a world of two: torchrun's
    (DistEnv(launcher="torchrun"), "auto", True),                          # real torchrun --nproc 1 keeps its own
    (DistEnv(), "torchrun", True),                                         # the choice: as torchrun --nproc 1
])
def test_the_rule_gives_a_world_of_one_no_torchrun_variables_unless_chosen(env: DistEnv, dist_env: str,
                                                                            exported: bool) -> None:
    assert exports_torchrun_variables(env, dist_env) is exported


def test_a_one_task_rank_sees_what_python_script_sees_and_the_choice_gives_torchrun_s(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pgcheck, "_HELD", {})
    environ = dict(ONE_TASK)
    env = prepare_rank(SHIM, environ, "auto")
    assert env.world_size == 1
    assert not set(TORCHRUN_VARIABLES) & set(environ), environ  # MASTER_* of the launcher taken out too
    assert int(environ.get("RANK", -1)) == -1  # nanoGPT's test: not ddp
    chosen = dict(ONE_TASK)
    prepare_rank(SHIM, chosen, "torchrun")
    assert (chosen["RANK"], chosen["WORLD_SIZE"], chosen["LOCAL_RANK"], chosen["MASTER_PORT"]) == ("0", "1", "0", "29600")
    assert detect(chosen).launcher == "torchrun"


def test_a_world_of_two_gets_torchrun_s_variables_by_default() -> None:
    environ = {**ONE_TASK, "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2",
               "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_TASKS_PER_NODE": "2"}
    prepare_rank(SHIM, environ, "auto")
    assert (environ["RANK"], environ["WORLD_SIZE"], environ["LOCAL_RANK"]) == ("1", "2", "1")


def test_the_held_variables_come_back_for_an_init_process_group_that_reads_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(pgcheck, "_HELD", {})
    pgcheck.hold_world_of_one({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "1234"})
    pgcheck._give_held(("gloo",), {"store": object(), "rank": 0, "world_size": 1})  # a store: not read
    assert "RANK" not in os.environ
    pgcheck._give_held(("gloo",), {"init_method": "env://"})
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_PORT"]) == ("0", "1", "1234")
    assert pgcheck._HELD == {}


@pytest.mark.parametrize(("args", "kwargs", "reads"), [
    ((), {}, True), (("gloo",), {"init_method": "env://"}, True), (("gloo", "tcp://h:1"), {}, False),
    (("gloo",), {"store": object()}, False), (("gloo", None, None, 1, 0, object()), {}, False),
])
def test_reads_environment(args: tuple, kwargs: dict, reads: bool) -> None:
    assert pgcheck.reads_environment(args, kwargs) is reads


def test_dist_env_is_in_the_spec_the_flag_and_the_environment() -> None:
    spec = spec_from_dict({"name": "s", "script": {"path": "/a/t.py", "dist_env": "torchrun"}})
    assert spec.script.dist_env == "torchrun" and spec_to_dict(spec)["script"]["dist_env"] == "torchrun"
    assert dist_env_choice(spec, {}) == "torchrun"
    assert dist_env_choice(None, {"CYCLONE_DIST_ENV": "torchrun"}) == "torchrun"
    assert dist_env_choice(None, {}) == "auto"
    assert ScriptConfig(path="/a/t.py").dist_env == "auto"
    with pytest.raises(ValidationError, match=r"script\.dist_env .mpi. is not one of auto, torchrun"):
        ScriptConfig(path="/a/t.py", dist_env="mpi")
    flags = argparse.Namespace(chdir=None, live_code=False, dist_env="torchrun")
    assert script_flag_values(flags, True) == {"dist_env": "torchrun"}
    with pytest.raises(ValidationError, match="--dist-env is for a script job"):
        script_flag_values(flags, False)


def test_a_missing_variable_at_world_one_names_the_choice() -> None:
    assert "--dist-env torchrun" in missing_variable_hint(KeyError("LOCAL_RANK"), 1, "auto")
    assert missing_variable_hint(KeyError("LOCAL_RANK"), 2, "auto") == ""
    assert missing_variable_hint(KeyError("LOCAL_RANK"), 1, "torchrun") == ""
    assert missing_variable_hint(KeyError("HOME"), 1, "auto") == ""


@pytest.mark.parametrize(("source", "requires"), [
    ('import os\ngpu = int(os.environ["LOCAL_RANK"])\n', True),              # pytorch/examples' multigpu_torchrun.py
    ('from os import environ\nrank = int(environ["RANK"])\n', True),
    ("import os\nddp = int(os.environ.get('RANK', -1)) != -1\nif ddp:\n    r = int(os.environ['RANK'])\n", False),  # nanoGPT
    ('import os\ntry:\n    r = os.environ["RANK"]\nexcept KeyError:\n    r = 0\n', False),
    ('import os\ndef setup():\n    return int(os.environ["LOCAL_RANK"])\n', True),   # in a function: still a need
    ('import os\nif "RANK" in os.environ:\n    pass\n', False),              # torchvision's references
    ('import os\nos.environ["RANK"] = "0"\n', False),                         # a write is no read
    ('import os\nx = os.environ["HOME"]\n', False),
    ("def broken(:\n", False),
])
def test_a_script_that_reads_a_torchrun_variable_with_no_default_requires_them(source: str, requires: bool) -> None:
    assert requires_torchrun_variables(source) is requires
    assert exports_torchrun_variables(DistEnv(), "auto", requires) is requires  # a world of one then gets them


def test_a_one_task_rank_of_a_torchrun_only_script_gets_torchrun_s_variables(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(pgcheck, "_HELD", {})
    script = tmp_path / "t.py"
    script.write_text('import os\nlocal_rank = int(os.environ["LOCAL_RANK"])\n')
    environ = dict(ONE_TASK)
    prepare_rank(ShimArgs(None, False, str(script), None, ()), environ, "auto")
    assert (environ["RANK"], environ["WORLD_SIZE"], environ["LOCAL_RANK"]) == ("0", "1", "0")


def test_a_fabric_script_gets_fabric_run_s_variables_and_a_launching_one_no_cli_mark() -> None:
    two_nodes = DistEnv(world_size=2, local_world_size=1, num_nodes=2)
    plain = "from lightning.fabric import Fabric\nfabric = Fabric()\n"
    assert fabric_variables(plain, two_nodes, {}) == {"LT_DEVICES": "1", "LT_NUM_NODES": "2", "LT_CLI_USED": "1"}
    launching = plain + "fabric.launch()\n"
    assert fabric_variables(launching, two_nodes, {}) == {"LT_DEVICES": "1", "LT_NUM_NODES": "2"}
    assert fabric_variables(plain, two_nodes, {"LT_DEVICES": "4"}) == {"LT_NUM_NODES": "2", "LT_CLI_USED": "1"}
    assert fabric_variables("import torch\n", two_nodes, {}) == {}  # no Fabric: nothing
    assert fabric_variables(plain, DistEnv(), {}) == {}              # a world of one: as python SCRIPT
