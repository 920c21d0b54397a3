"""The submit path's run directory: rendered once for its final name, all or nothing."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cyclone_kit.config.job import spec_from_dict
from cyclone_kit.config.profile import load_profile
from cyclone_kit.config.toolbox import read_toml
from cyclone_kit.config.validate import resolve
from cyclone_kit.core.errors import ValidationError
from cyclone_kit.submit import submission
from tests.helpers.cli import REPO


def _job():
    return resolve(spec_from_dict(read_toml(REPO / "jobs" / "smoke.toml")), load_profile("local"))


def test_the_script_is_rendered_once_for_the_final_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []
    real = submission.render_script

    def counting(job, run_dir, *args, **kwargs):
        calls.append(Path(run_dir))
        return real(job, run_dir, *args, **kwargs)

    monkeypatch.setattr(submission, "render_script", counting)
    run_dir = submission.prepare_run_dir(_job(), tmp_path)
    assert calls == [run_dir]
    assert re.findall(r"^export CYCLONE_RUN_DIR=(.*)$", (run_dir / "job.sbatch").read_text(), re.M) == [str(run_dir)]


def test_a_render_failure_leaves_no_run_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(*_args, **_kwargs):
        raise ValidationError("a value the template refuses", hint="fix it")

    monkeypatch.setattr(submission, "render_script", failing)
    with pytest.raises(ValidationError):
        submission.prepare_run_dir(_job(), tmp_path)
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ issue 30: the dry run is what was scheduled
# For each backend: what `submit --dry-run` prints for a run directory (plan_submission(...).text(), as
# cli/submit.py prints it) is what scheduling that job wrote there and ran, with the scheduler faked
# (no process starts in this tier; tests/slurm and tests/integration compare the real runs).
def _files_as_written(plan) -> None:
    for rel, data in plan.files.items():
        written = (plan.run_dir / rel).read_bytes()
        assert written == (data.encode() if isinstance(data, str) else data), rel


def test_slurm_the_dry_run_is_the_batch_script_sbatch_was_given(tmp_path: Path, monkeypatch) -> None:
    from cyclone_kit.backends.slurm import SlurmBackend
    from cyclone_kit.core.proc import CompletedCommand

    ran: list[tuple[tuple[str, ...], Path | None]] = []
    backend = SlurmBackend()
    monkeypatch.setattr(backend, "_run", lambda argv, cwd=None: (
        ran.append((tuple(argv), cwd)), CompletedCommand(tuple(argv), 0, "4242\n", "", 0.0))[1])
    run_dir, job_id = submission.submit_job(_job(), tmp_path, backend)
    plan = submission.plan_submission(_job(), run_dir, SlurmBackend())
    assert job_id == "4242" and plan.backend == "slurm"
    assert plan.text() == (run_dir / "job.sbatch").read_text()  # the script sbatch was given ...
    assert ran == [(plan.commands[0], run_dir)] and plan.commands[0][-1] == str((run_dir / "job.sbatch").resolve())
    _files_as_written(plan)  # ... and every other file of the plan


def test_submitit_the_dry_run_is_the_batch_script_submitit_wrote(tmp_path: Path, monkeypatch) -> None:
    import submitit.core.utils
    from submitit.slurm import slurm

    from cyclone_kit.backends.submitit_ import SubmititBackend

    class FakeSbatch:  # submitit's own sbatch call, answered without a process
        def __init__(self, argv, **_kwargs):
            self.argv = argv

        def __call__(self):
            return "Submitted batch job 4243\n"

    monkeypatch.setattr(submitit.core.utils, "CommandFunction", FakeSbatch)
    monkeypatch.setattr(slurm.SlurmExecutor, "affinity", classmethod(lambda cls: 2))
    backend = SubmititBackend(executor="slurm")
    run_dir, job_id = submission.submit_job(_job(), tmp_path, backend)
    plan = submission.plan_submission(_job(), run_dir, backend)
    assert job_id == "4243" and plan.parameters["executor"] == "slurm"
    assert plan.text() == (run_dir / "submitit" / "4243_submission.sh").read_text()
    assert " ".join(plan.commands[0]) in plan.text()  # the command every task runs
    assert not (run_dir / "job.sbatch").exists(), "submitit writes its own batch script; the template's is not run"
    _files_as_written(plan)


def test_local_the_dry_run_is_what_the_launcher_ran(tmp_path: Path, monkeypatch) -> None:
    import json
    from types import SimpleNamespace

    from cyclone_kit.backends import local

    launched: list[dict] = []

    def fake_launch(run_dir, nproc, nodes=1, **kwargs):
        launched.append({"run_dir": Path(run_dir), "nproc": nproc, "nodes": nodes, **kwargs})
        return SimpleNamespace(ok=True, job_id="900000009")

    monkeypatch.setattr(local, "launch", fake_launch)
    backend = local.LocalBackend(threads=3, quiet=True, extra_env={"X_EXTRA": "1"})
    run_dir, job_id = submission.submit_job(_job(), tmp_path, backend)
    plan = submission.plan_submission(_job(), run_dir, backend)
    shown = json.loads(plan.text())
    (ran,) = launched
    assert job_id == "900000009" and ran["run_dir"] == run_dir == Path(shown["run_dir"])
    assert (list(ran["command"]), str(ran["cwd"]), ran["threads"]) == (
        shown["command"], shown["cwd"], shown["threads_per_rank"]) == (list(plan.commands[0]), str(plan.cwd), 3)
    assert dict(ran["extra_env"]) == {"X_EXTRA": "1"} and all(r["env"]["X_EXTRA"] == "1" for r in shown["ranks"])
    assert json.loads((run_dir / "spec.json").read_text())["resources"]["cpus_per_task"] == 3
    assert not (run_dir / "job.sbatch").exists()
    _files_as_written(plan)


def test_a_plan_is_a_frozen_value_and_planning_writes_nothing(tmp_path: Path) -> None:
    import dataclasses

    from cyclone_kit.backends.slurm import SlurmBackend

    plan = submission.plan_submission(_job(), tmp_path / "never", SlurmBackend())
    assert not (tmp_path / "never").exists()
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.script = ""  # type: ignore[misc]
    with pytest.raises(TypeError):
        plan.files["spec.json"] = "{}"  # type: ignore[index]


def test_a_write_cut_short_leaves_a_directory_that_is_no_run(tmp_path: Path, monkeypatch) -> None:
    """spec.json (what makes a directory a run) is written last: a write that fails after the batch script
    (a full disk, a kill) leaves no directory that status, report or a resume would take for a run."""
    from cyclone_kit.rundir.layout import RunDir, is_run_dir

    written: list[str] = []
    real = RunDir.write_script

    def failing_after_the_script(self, text):  # type: ignore[no-untyped-def]
        real(self, text)
        written.append("job.sbatch")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(RunDir, "write_script", failing_after_the_script)
    plan = submission.plan_submission(_job(), tmp_path / "run", submission.get_backend("slurm"))
    (tmp_path / "run").mkdir()
    with pytest.raises(OSError):
        submission.write_plan(plan)
    assert written == ["job.sbatch"] and (tmp_path / "run" / "job.sbatch").exists()
    assert not is_run_dir(tmp_path / "run")
