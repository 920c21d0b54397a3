"""`submit --backend submitit --dry-run` prints the batch script submitit itself writes (issue 30): the
templates' rendezvous and port check, a plain line about the step watcher it lacks, and valid bash."""

from __future__ import annotations

import subprocess
from pathlib import Path

from cyclone_kit.backends.submitit_ import NO_STEP_WATCHER, sbatch_text
from cyclone_kit.config.job import spec_from_dict
from cyclone_kit.config.profile import load_profile
from cyclone_kit.config.validate import resolve
from tests.helpers.cli import REPO, run_cli

#: The plan of submitit's Slurm executor (``auto`` picks the local one where sbatch is not on PATH: its
#: plan is the local executor's keywords, as JSON, since it writes no batch script).
SLURM_EXECUTOR = {"CYCLONE_SUBMITIT_EXECUTOR": "slurm"}


def _job(**resources: object):
    spec = spec_from_dict({"name": "sj", "train": {"model": "tiny_cnn"}, "resources": {"profile": "local", **resources}})
    return resolve(spec, load_profile("local"))


def test_the_batch_script_has_the_templates_rendezvous_and_says_what_it_lacks(tmp_path: Path) -> None:
    """Issue 30: the port check of the sbatch templates, and a plain line about the missing step watcher."""
    text = sbatch_text(_job(partition="cpu", nodes=2), tmp_path / "run", python="/opt/py 3/bin/python")
    setup = text.split("# setup\n", 1)[1].split("# command\n", 1)[0]
    assert 'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)"' in setup
    assert "'/opt/py 3/bin/python' -m cyclone_kit.core.ports 15000 16000 \"$SLURM_JOB_ID\"" in setup
    assert NO_STEP_WATCHER in setup and setup.index("export MASTER_PORT") < setup.index(NO_STEP_WATCHER)
    command = text.split("# command\n", 1)[1]
    assert f"'/opt/py 3/bin/python' -u -m submitit.core._submit {tmp_path / 'run' / 'submitit'}" in command
    assert subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True).returncode == 0


def test_dry_run_of_the_submitit_backend_prints_submitits_script_not_the_template(tmp_path: Path) -> None:
    proc = run_cli("submit", str(REPO / "jobs" / "smoke.toml"), "--profile", "local", "--partition", "cpu",
                   "--backend", "submitit", "--dry-run", "--runs-dir", str(tmp_path), env=SLURM_EXECUTOR)
    assert proc.returncode == 0, proc.stderr
    assert "-m submitit.core._submit" in proc.stdout and "#SBATCH --wckey=submitit" in proc.stdout
    assert "stepwatch" not in proc.stdout and "cyclone_kit: submitit writes the srun line itself" in proc.stdout
    assert not list(tmp_path.iterdir()), "a dry run writes nothing"


def test_sweep_dry_run_of_the_submitit_backend_prints_submitits_script_for_every_point(tmp_path: Path) -> None:
    proc = run_cli("sweep", str(REPO / "jobs" / "demo_strong.toml"), "--backend", "submitit", "--dry-run",
                   "--runs-dir", str(tmp_path), env=SLURM_EXECUTOR)
    assert proc.returncode == 0, proc.stderr
    points = proc.stdout.split("(written by submitit) ----\n")[1:]
    assert len(points) == 2, proc.stdout[:2000]
    for text in points:
        script = text.split("\n# ---- ", 1)[0]
        assert script.startswith("#!/bin/bash\n") and "-m submitit.core._submit" in script
        assert "cyclone_kit: submitit writes the srun line itself" in script and "stepwatch" not in script
    assert "p0-ws1-n1x1/submitit/<job id>_submission.sh" in proc.stdout
    assert not list(tmp_path.iterdir()), "a dry run writes nothing"
