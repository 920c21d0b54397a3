"""The command line of script jobs, as a user types it: refusals are one line, exit 2, nothing written;
``--dry-run`` shows the launch shim with the script and its arguments quoted."""

from __future__ import annotations

import shlex
import textwrap
from pathlib import Path

import pytest

from tests.helpers.cli import REPO, run_cli

PLAIN = REPO / "examples" / "plain_ddp.py"


def _refused(proc, *needles: str) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "HINT" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize(("argv", "needles"), [
    (["submit", "nowhere.py", "--profile", "local"], ("script 'nowhere.py' does not exist",)),
    (["run", "nowhere.py", "--nproc", "2"], ("does not exist",)),
    (["submit", "-m", "no_such_module_ck", "--profile", "local"], ("module 'no_such_module_ck' cannot be found",)),
    (["submit", "jobs/smoke.toml", "--profile", "local", "--", "--lr", "1"], ("no script to give them to",)),
    (["status", "--", "x"], ("only for a script run by submit or run",)),
    (["submit", str(PLAIN), "--profile", "local", "--backend", "submitit"], ("submitit backend runs the built-in",)),
    (["submit", str(PLAIN), "--profile", "local", "--set", "train.lr=0.2"], ("both [train] and [script]",)),
    (["submit", str(PLAIN), "--profile", "local", "--", "--bs", "{per_device_batch_size}"],
     ("uses {per_device_batch_size} but this job does not know it",)),
    (["submit", str(PLAIN), "--profile", "local", "--partition", "gpu", "--ntasks-per-node", "3"],
     ("--ntasks-per-node=3 but --gpus-per-node=4",)),
    (["run", str(PLAIN), "--nproc", "2", "--resume", "/nonexistent"], ("is not a run directory",)),
])
def test_script_refusals_are_one_line_and_write_nothing(argv: list[str], needles: tuple[str, ...],
                                                        tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    _refused(run_cli(*argv, "--runs-dir", str(runs), cwd=tmp_path) if "--" not in argv else
             run_cli(*argv[:argv.index("--")], "--runs-dir", str(runs), *argv[argv.index("--"):], cwd=REPO), *needles)
    assert not runs.exists() or not any(runs.iterdir())


def test_a_script_that_does_not_compile_is_refused_with_its_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\n\nfor x in range(3)\n    print(x)\n")
    _refused(run_cli("submit", str(bad), "--profile", "local", "--runs-dir", str(tmp_path / "runs")),
             f"{bad}, line 3: SyntaxError")
    assert not (tmp_path / "runs").exists()


def test_dry_run_shows_the_shim_running_the_script_with_its_args(tmp_path: Path) -> None:
    proc = run_cli("submit", str(PLAIN), "--profile", "local", "--nodes", "2", "--ntasks-per-node", "2",
                   "--dry-run", "--runs-dir", str(tmp_path), "--", "--steps", "5", "a b; rm -rf ~")
    assert proc.returncode == 0, proc.stderr
    assert "#SBATCH --partition=cpu" in proc.stdout and "#SBATCH --job-name=plain_ddp" in proc.stdout
    words = shlex.split(proc.stdout[proc.stdout.index("-m cyclone_kit.runtime.launch"):])
    # the ranks run the run directory's snapshot of the script, in the folder submit ran in
    assert words[4].endswith("/script/plain_ddp.py") and words[5:] == ["--steps", "5", "a b; rm -rf ~"]
    assert f"# The script: {PLAIN}, as submitted" in proc.stdout and f"cd {REPO}" in proc.stdout
    assert not any(tmp_path.iterdir())


def test_a_spec_file_script_path_is_relative_to_the_spec_file(tmp_path: Path) -> None:
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "train.py").write_text("print('hi')\n")
    (folder / "job.toml").write_text(textwrap.dedent("""
        name = "mine"
        [script]
        path = "train.py"
        args = ["--nodes", "{num_nodes}", "--world", "{world_size}"]
        [resources]
        profile = "local"
        nodes = 2
        ntasks_per_node = 2
    """))
    proc = run_cli("submit", str(folder / "job.toml"), "--dry-run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    words = shlex.split(proc.stdout[proc.stdout.index("-m cyclone_kit.runtime.launch"):])
    assert words[4].endswith("/script/train.py") and words[5:] == ["--nodes", "2", "--world", "4"]
    assert f"# The script: {folder / 'train.py'}, as submitted" in proc.stdout


def test_the_shipped_script_specs_render(tmp_path: Path) -> None:
    job = run_cli("submit", str(REPO / "jobs" / "plain_ddp_script.toml"), "--dry-run", cwd=tmp_path)
    assert job.returncode == 0, job.stderr
    words = shlex.split(job.stdout[job.stdout.index("-m cyclone_kit.runtime.launch"):])
    assert words[4].endswith("/script/plain_ddp.py") and words[5:] == ["--steps", "50", "--batch-size", "64"]
    assert f"# The script: {PLAIN}, as submitted" in job.stdout and f"cd {tmp_path}" in job.stdout
    sweep = run_cli("sweep", str(REPO / "jobs" / "strong_scaling_script.toml"), "--dry-run", cwd=tmp_path)
    assert sweep.returncode == 0, sweep.stderr
    assert sweep.stdout.count("-m cyclone_kit.runtime.launch") == 3
    for batch in ("128", "64", "32"):
        assert f"/script/plain_ddp.py --steps 40 --batch-size {batch}\n" in sweep.stdout
