"""doctor's smoke job goes through the slurm backend's plan (issue 30): what is written and submitted is the
plan that :func:`cyclone_kit.doctor.job.smoke_plan` shows (sbatch faked; tests/slurm/test_doctor_slurm runs it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cyclone_kit.backends.slurm import SlurmBackend
from cyclone_kit.core.errors import SlurmError
from cyclone_kit.doctor import job as doctor_job

PYTHON = "/opt/py/bin/python3"


def test_the_smoke_job_scheduled_is_the_plan_shown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = doctor_job.doctor_request("local", "cpu", 1, "")
    scheduled = []

    def fake_schedule(self: SlurmBackend, plan):
        scheduled.append(plan)
        for rel, data in plan.files.items():  # written before it is scheduled, exactly as planned
            assert (plan.run_dir / rel).read_text() == data, rel
        raise SlurmError("sbatch rejected the script: no", hint="fix it")

    monkeypatch.setattr(SlurmBackend, "schedule", fake_schedule)
    result = doctor_job.run_smoke_job(job, tmp_path, wait_timeout_s=1, python=PYTHON)
    (plan,) = scheduled
    shown = doctor_job.smoke_plan(job, plan.run_dir, python=PYTHON)
    assert shown.text() == plan.text() == plan.files["job.sbatch"] and shown.commands == plan.commands
    assert set(plan.files) == {"job.sbatch", "doctor/README"}  # no spec.json: the directory is not a training run
    assert "cyclone_kit.doctor.probe" in plan.text() and PYTHON in plan.text()
    assert plan.commands[0][0] == "sbatch" and str((plan.run_dir / "job.sbatch").resolve()) in plan.commands[0]
    assert plan.run_dir.parent == tmp_path.absolute() and plan.run_dir.name.startswith(doctor_job.JOB_NAME)
    assert "sbatch rejected the script" in result.reason and not result.finished and result.job_id == ""
    assert not [p for p in tmp_path.iterdir() if not p.name.startswith(".")]  # a refused job leaves no run dir
