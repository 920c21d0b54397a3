"""Hostile names, paths, modules and environment values are quoted or refused, never run.

Every rendered script is *executed* with bash under stub ``srun``/``scontrol``/``module``
commands on PATH; a canary file proves that no payload ran, and the stub ``srun`` records the
arguments it received so we can check the run directory arrived intact as one argument.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from cyclone_kit.config.job import spec_from_dict
from cyclone_kit.config.profile import profile_from_dict
from cyclone_kit.config.validate import resolve
from cyclone_kit.core.errors import ValidationError
from cyclone_kit.submit.render import render_script

PAYLOADS = [
    "dir with spaces",
    "it's quoted",
    "$(touch {canary})",
    "`touch {canary}`",
    "x; touch {canary}",
    "x && touch {canary}",
    "x | touch {canary}",
    "${{IFS}}touch${{IFS}}{canary}",
    "ünïcødé-Κύπρος",
    "a'$(touch {canary})'b",
    "*",
]
REFUSED = ['quote"$(touch {canary})', "line\ntouch {canary}", "back\\slash"]

STUB_SRUN = """#!/bin/bash
printf '%s\\n' "$@" > "$STUB_OUT/srun.args"
env > "$STUB_OUT/srun.env"
"""
#: The job's interpreter at a hostile path: the batch script runs the step watcher with it
#: (``PYTHON -m cyclone_kit.runtime.watchers.jobstep --run-dir DIR -- srun ...``); the stub runs what follows ``--``
#: and fails any other call (the port probe then falls back to its shell arithmetic, as without Python).
STUB_PYTHON = """#!/bin/bash
[ "$2" = cyclone_kit.runtime.watchers.jobstep ] || exit 127
printf '%s\\n' "$@" > "$STUB_OUT/python.args"
while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do shift; done
shift
exec "$@"
"""


def hostile_profile(payload: str):
    return profile_from_dict(
        {
            "modules": [payload, "CUDA/12.1.1"],
            "env": {"HOSTILE": payload, "PLAIN": "1"},
            "partitions": {"gpu": {"nodes": 2, "cpus_per_node": 8, "gpus_per_node": 2, "default": True}},
        },
        "hostile",
    )


@pytest.fixture
def stubs(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    (bin_dir / "srun").write_text(STUB_SRUN)
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho node01\necho node02\n")
    (bin_dir / "module").write_text('#!/bin/bash\nprintf "%s\\n" "$*" >> "$STUB_OUT/module.calls"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return bin_dir, out


def execute(script: str, tmp_path: Path, bin_dir: Path, out: Path) -> subprocess.CompletedProcess:
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "STUB_OUT": str(out), "SLURM_JOB_ID": "4242",
           "PYTHONPATH": str(Path(__file__).resolve().parents[2]),  # this checkout's step watcher
           "SLURM_JOB_NODELIST": "node[01-02]", "SLURM_CPUS_PER_TASK": "4", "HOME": str(tmp_path)}
    return subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True, timeout=30, cwd=tmp_path)


@pytest.mark.parametrize("template", PAYLOADS)
def test_payload_is_quoted_not_run(template, tmp_path, stubs):
    bin_dir, out = stubs
    canary = tmp_path / "CANARY"
    payload = template.format(canary=canary)
    run_dir = tmp_path / "runs" / payload / "job-1"
    spec = spec_from_dict({"name": "hostile", "resources": {"profile": "hostile"}})
    python = tmp_path / "opt" / payload / "python"
    python.parent.mkdir(parents=True)
    python.write_text(STUB_PYTHON)
    python.chmod(0o755)
    script = render_script(resolve(spec, hostile_profile(payload)), run_dir, python=str(python),
                           environ={"CYCLONE_KIT_TEMPLATES": "/nonexistent"})
    result = execute(script, tmp_path, bin_dir, out)
    assert result.returncode == 0, result.stderr
    assert not canary.exists(), f"payload {payload!r} was executed"
    args = (out / "srun.args").read_text().splitlines()
    assert args[-1] == str(run_dir) and args[-2] == "--run-dir"
    assert str(python) in args
    watcher = (out / "python.args").read_text().splitlines()
    assert watcher[:4] == ["-m", "cyclone_kit.runtime.watchers.jobstep", "--run-dir", str(run_dir)], watcher
    env_lines = (out / "srun.env").read_text()
    assert f"HOSTILE={payload}" in env_lines and f"CYCLONE_RUN_DIR={run_dir}" in env_lines
    assert "MASTER_ADDR=node01" in env_lines and "MASTER_PORT=19242" in env_lines
    calls = (out / "module.calls").read_text().splitlines()
    assert calls == ["purge", f"load {payload}", "load CUDA/12.1.1"]


@pytest.mark.parametrize("template", REFUSED)
def test_unquotable_paths_are_refused(template, tmp_path):
    payload = template.format(canary=tmp_path / "CANARY")
    spec = spec_from_dict({"name": "hostile", "resources": {"profile": "local"}})
    from cyclone_kit.config.profile import load_profile

    with pytest.raises(ValidationError) as e:
        render_script(resolve(spec, load_profile("local")), tmp_path / payload)
    assert "HINT" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["a b", "$(touch x)", "`id`", "x;y", "a&&b", "line\nbreak", "ünï", "-rf", ""])
def test_hostile_job_names_refused_by_cli(name, tmp_path, cli):
    result = cli("submit", "--profile", "local", "--name", name, "--runs-dir", str(tmp_path / "runs"), "--dry-run")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "HINT" in lines[0] and "Traceback" not in result.stderr
    assert not (tmp_path / "runs").exists()


def test_hostile_set_values_are_quoted(tmp_path, stubs, cli):
    bin_dir, out = stubs
    canary = tmp_path / "CANARY"
    result = cli("submit", "--profile", "local", "--set", f"train.data_dir=$(touch {canary})",
                 "--set", f"resources.extra_sbatch=['--comment=x; touch {canary}']", "--dry-run",
                 "--runs-dir", str(tmp_path / "runs with space"))
    assert result.returncode == 0, result.stderr
    run = execute(result.stdout, tmp_path, bin_dir, out)
    assert run.returncode == 0 and not canary.exists()
    assert os.path.basename((out / "srun.args").read_text().splitlines()[-1]).startswith("resnet50-synthetic-")
