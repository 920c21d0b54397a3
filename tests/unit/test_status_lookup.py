"""Why a job waits (pure), what a status/logs target names, and a user's cancel recorded in the run directory."""

from __future__ import annotations

import json

import pytest

from cyclone_kit.backends import lookup
from cyclone_kit.core.errors import ValidationError
from cyclone_kit.rundir.layout import RunDir, StudyDir
from cyclone_kit.slurm.states import JobState, explain_state


@pytest.mark.parametrize(("state", "reason", "restarts", "expected"), [
    (JobState.PENDING, "JobHeldUser", 0, "job 44 is PENDING (JobHeldUser): held by its owner; `scontrol release 44`"),
    (JobState.PENDING, "JobHeldAdmin", 0, "job 44 is PENDING (JobHeldAdmin): held by an administrator"),
    (JobState.PENDING, "Dependency", 0, "job 44 is PENDING (Dependency): waits until the jobs it depends on"),
    (JobState.PENDING, "Resources", None, "job 44 is PENDING (Resources): waits for free nodes"),
    (JobState.PENDING, "BeginTime", 1, "job 44 is PENDING (BeginTime): requeued 1 time(s); Slurm holds a requeued "
                                       "job until its begin time"),
    (JobState.PENDING, "JobHeldUser", 2, "job 44 is PENDING (JobHeldUser): requeued 2 time(s) and held by its owner"),
    (JobState.REQUEUED, "", None, "job 44 is REQUEUED: requeued again; it then resumes"),
    (JobState.PENDING, "job requeued in held state", 1,
     "job 44 is PENDING (job requeued in held state): requeued 1 time(s) and held; `scontrol release 44`"),
    (JobState.PENDING, "SomethingNew", 0, "job 44 is PENDING (SomethingNew)"),
])
def test_explain_state_says_why_a_job_waits(state, reason, restarts, expected):
    line = explain_state("44", state, reason, restarts)
    assert line is not None and line.startswith(expected), line
    assert "\n" not in line


@pytest.mark.parametrize("state", [JobState.RUNNING, JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED])
def test_explain_state_is_silent_for_jobs_that_started(state):
    assert explain_state("44", state, "None", 0) is None


def test_cancel_request_applies_to_the_job_it_named(tmp_path):
    rd = RunDir.create(tmp_path, "c", "{}\n")
    rd.write_submission("7", "slurm")
    assert rd.stop_status() == "preempted"
    rd.write_cancel_request("7")
    assert rd.cancel_requested() and rd.stop_status() == "cancelled"
    rd.write_submission("8", "slurm")  # resubmitted later: a new job is not cancelled by the old request
    assert not rd.cancel_requested() and rd.stop_status() == "preempted"


def _study(tmp_path, report_id="900"):
    study = StudyDir(RunDir.create(tmp_path, "st", "{}\n").path)  # any directory; replaced by the study's files
    (study.path / "spec.json").unlink()
    study.sweep.write_text(json.dumps({"study": "st", "points": []}))
    for name, job_id in (("p1", "101"), ("p2", "102")):
        rd = study.run(name)
        rd.logs.mkdir(parents=True)
        rd.write_spec(json.dumps({"name": "smoke"}))
        rd.write_submission(job_id, "slurm")
    study.submitted.write_text(json.dumps({"runs": [{"name": "p1", "run_dir": "p1", "job_id": "101"},
                                                    {"name": "p2", "run_dir": "p2", "job_id": "102"}],
                                           "report": {"job_id": report_id, "output": "report"}}))
    return study


def test_targets_resolve_runs_studies_report_jobs_and_bare_ids(tmp_path):
    study = _study(tmp_path)
    assert lookup.resolve_target(str(study.path), tmp_path) == lookup.Target("study", study.path)
    assert lookup.resolve_target(str(study.run("p1").path), tmp_path) == lookup.Target("run", study.run("p1").path)
    assert lookup.resolve_target("102", tmp_path) == lookup.Target("run", study.run("p2").path, "102")
    assert lookup.resolve_target("900", tmp_path) == lookup.Target("report", study.path, "900")
    assert lookup.resolve_target("555", tmp_path) == lookup.Target("job", None, "555")
    assert [rd.path.name for rd in study.point_dirs()] == ["p1", "p2"]
    assert study.report_job_id() == "900"
    with pytest.raises(ValidationError, match="no run or study"):
        lookup.log_sources(lookup.Target("job", None, "555"))
    with pytest.raises(ValidationError, match="does not exist"):
        lookup.resolve_target(str(tmp_path / "nope"), tmp_path)
    sources = lookup.log_sources(lookup.resolve_target(str(study.path), tmp_path))
    assert [s.label for s in sources] == ["run p1", "run p2", f"report of {study.path.name}"]


@pytest.mark.parametrize(("launch", "shim_end", "facts"), [
    ({"nodelist": "localhost", "wall_time_s": 12.4, "ranks": [{"rank": 0, "host": "localhost"},
                                                               {"rank": 1, "host": "localhost"}]},
     None, (1, "localhost", 12, "2 ranks on localhost")),
    ({"nodelist": "127.0.0.[1-2]", "ranks": [{"rank": 0, "host": "127.0.0.1"}, {"rank": 1, "host": "127.0.0.2"}]},
     {"wall_time_s": 0.3}, (2, "127.0.0.[1-2]", 1, "2 ranks on 127.0.0.1, 127.0.0.2")),  # rank 0's wall time
    ({"ranks": [{"rank": 0, "host": "localhost"}]}, None, (1, "localhost", 0, "1 rank on localhost")),
    (None, None, (0, "", 0, "")),
])
def test_launch_facts_of_a_local_run(launch: dict | None, shim_end: dict | None, facts: tuple) -> None:
    from cyclone_kit.backends.local import launch_facts

    assert launch_facts(launch, shim_end) == facts
