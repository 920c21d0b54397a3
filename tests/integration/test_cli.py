"""The CLI as a user runs it: dry-run output, speed-critical imports, profiles, exit codes."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers.cli import REPO

HEAVY = ("torch", "pandas", "matplotlib", "numpy", "submitit")


def imported_modules(*argv: str) -> set[str]:
    code = ("import sys, runpy, contextlib, io\n"
            f"sys.argv = ['cyclone_kit', *{list(argv)!r}]\n"
            "out = io.StringIO()\n"
            "with contextlib.redirect_stdout(out):\n"
            "    try:\n        runpy.run_module('cyclone_kit', run_name='__main__')\n"
            "    except SystemExit:\n        pass\n"
            "print(' '.join(sorted(sys.modules)))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    return set(result.stdout.split())


def test_login_node_commands_import_nothing_heavy():
    for argv in (["--help"], ["submit", "--nodes", "4", "--dry-run"], ["profiles"], ["profiles", "cyclone"]):
        mods = imported_modules(*argv)
        assert "cyclone_kit.cli.app" in mods
        assert not {m for m in mods if m.split(".")[0] in HEAVY}, argv


def test_default_dry_run_is_a_4_node_cyclone_gpu_script(cli, tmp_path):
    result = cli("submit", "--nodes", "4", "--dry-run", "--runs-dir", str(tmp_path / "runs"))
    assert result.returncode == 0, result.stderr
    s = result.stdout
    for line in ["#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=4", "#SBATCH --gres=gpu:4",
                 "#SBATCH --cpus-per-task=10", "#SBATCH --partition=gpu", "export MASTER_ADDR", "export MASTER_PORT",
                 "srun "]:
        assert line in s
    assert not (tmp_path / "runs").exists(), "--dry-run must write nothing"
    script = tmp_path / "x.sbatch"
    script.write_text(s)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


def test_flags_override_spec_and_set(cli, tmp_path):
    result = cli("submit", str(REPO / "jobs" / "smoke.toml"), "--profile", "local", "--nodes", "2",
                 "--ntasks-per-node", "2", "--set", "resources.nodes=1", "--time", "5", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "#SBATCH --nodes=2" in result.stdout and "#SBATCH --time=00:05:00" in result.stdout


def test_profiles_list_and_show(cli):
    listing = cli("profiles")
    assert listing.returncode == 0 and "cyclone" in listing.stdout and "local" in listing.stdout
    shown = cli("profiles", "cyclone")
    assert shown.returncode == 0 and "V100" in shown.stdout and "gpu" in shown.stdout


def test_real_submit_requires_account_on_cyclone(cli, tmp_path):
    result = cli("submit", "--nodes", "1", "--runs-dir", str(tmp_path / "runs"))
    assert result.returncode == 2 and "--account" in result.stderr and len(result.stderr.splitlines()) == 1
    assert not (tmp_path / "runs").exists()


def test_help_lists_commands(cli):
    result = cli("--help")
    assert result.returncode == 0
    for command in ("submit", "profiles"):
        assert command in result.stdout
