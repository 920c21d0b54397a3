"""A study asks its backend, never its name, how the points run (issue 30): ``Backend.foreground``,
``for_study`` (the local launcher's threads per point) and ``run_here`` (a point run here, its outcome)."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from cyclone_kit.backends import BACKENDS, get_backend
from cyclone_kit.backends.base import Finished
from cyclone_kit.config.job import spec_from_dict
from cyclone_kit.config.profile import load_profile
from cyclone_kit.config.toolbox import read_toml
from cyclone_kit.config.validate import resolve
from cyclone_kit.core.errors import ValidationError
from cyclone_kit.rundir.layout import StudyDir
from cyclone_kit.submit import study as lib
from tests.helpers.cli import REPO


def _job():
    return resolve(spec_from_dict(read_toml(REPO / "jobs" / "smoke.toml")), load_profile("local"))


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_backend_says_whether_it_runs_jobs_here(name: str) -> None:
    backend = get_backend(name, **({"executor": "slurm"} if name == "submitit" else {}))
    assert backend.foreground is (name == "local")
    assert backend.for_study().name == name
    if not backend.foreground:
        with pytest.raises(ValidationError, match="not in the foreground"):
            backend.run_here(SimpleNamespace(parameters={"executor": "slurm"}))


def test_submitits_local_executor_runs_here() -> None:
    assert get_backend("submitit", executor="local").foreground is True


def test_a_study_point_on_the_local_launcher_gets_its_cpus_per_task_as_threads(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from cyclone_kit.backends import local

    monkeypatch.setattr(local, "available_cores", lambda: 64)
    job = dataclasses.replace(_job(), cpus_per_task=3)
    shared = max(1, 64 // job.world_size)
    plain = get_backend("local").plan(job, tmp_path)
    point = lib.study_backend("local").plan(job, tmp_path)
    assert plain.parameters["threads_per_rank"] == shared and shared > 3
    assert point.parameters["threads_per_rank"] == 3
    assert json.loads(point.files["spec.json"])["resources"]["cpus_per_task"] == 3
    assert point.summary == f"{job.world_size} rank(s), 3 thread(s) each"
    monkeypatch.setattr(local, "available_cores", lambda: 1)  # fewer cores than asked: the cores shared, at least 1
    assert lib.study_backend("local").plan(job, tmp_path).parameters["threads_per_rank"] == 1


class _Here:
    """A backend that runs its jobs here, with the outcomes given (nothing starts)."""

    name = "here"
    batch_script = False
    foreground = True

    def __init__(self, *outcomes: Finished) -> None:
        self.outcomes = list(outcomes)
        self.ran: list[tuple[Path, object]] = []
        self.scheduled = 0

    def for_study(self) -> _Here:
        return self

    def plan(self, job, run_dir, *, script=None, after=()):
        return SimpleNamespace(run_dir=Path(run_dir), summary=f"{job} here")

    def run_here(self, plan, *, echo=None) -> Finished:
        self.ran.append((plan.run_dir.name, echo))
        return self.outcomes.pop(0)

    def schedule(self, plan):
        self.scheduled += 1
        raise AssertionError("a foreground study runs its points with run_here")


def _runs(*names: str) -> list[SimpleNamespace]:
    return [SimpleNamespace(name=n, world_size=2, job=f"job-{n}") for n in names]


def _submitted(study: StudyDir) -> dict:
    return json.loads(study.submitted.read_text())


def test_a_foreground_study_runs_every_point_here_and_reports_a_failure(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    backend = _Here(Finished("1", True, 1.25), Finished("2", False, 0.5, report="rank 1 failed first: boom"),
                    Finished("3", True, 2.0))
    monkeypatch.setattr(lib, "get_backend", lambda name: backend)
    study, out, err, echo = StudyDir(tmp_path), io.StringIO(), io.StringIO(), io.StringIO()
    sweep = SimpleNamespace(serial=False, report=True)
    outcome = lib.submit_study(sweep, _runs("p0", "p1", "p2"), study, "here", echo=echo, out=out, err=err)
    assert (outcome.foreground, outcome.failed, outcome.interrupted, backend.scheduled) == (True, 1, False, 0)
    assert backend.ran == [("p0", echo), ("p1", echo), ("p2", echo)]
    assert [(e["job_id"], e["status"], e["wall_time_s"]) for e in outcome.entries] == [
        ("1", "completed", 1.25), ("2", "failed", 0.5), ("3", "completed", 2.0)]
    assert "== p0: job-p0 here\n== p0: completed in 1.2 s\n" in out.getvalue()
    assert err.getvalue() == "rank 1 failed first: boom\n"
    doc = _submitted(study)
    assert (doc["backend"], [e["name"] for e in doc["runs"]]) == ("here", ["p0", "p1", "p2"])


def test_ctrl_c_during_a_point_stops_the_study(tmp_path: Path) -> None:
    backend = _Here(Finished("1", True, 1.0), Finished("2", False, 0.3, interrupted=True), Finished("3", True, 1.0))
    study, err = StudyDir(tmp_path), io.StringIO()
    outcome = lib.run_here(_runs("p0", "p1", "p2"), study, backend, err=err)
    assert outcome.interrupted and outcome.failed == 0 and [n for n, _ in backend.ran] == ["p0", "p1"]
    assert err.getvalue() == f"error: interrupted during p1; the study is incomplete: {study.path}\n"
    assert [e["status"] for e in _submitted(study)["runs"]] == ["completed", "failed"]
