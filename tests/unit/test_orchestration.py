"""Issue 13's shapes: the RunDir layout, the Backend protocol, the one failure record, the port formula."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from cyclone_kit.backends import BACKENDS, get_backend
from cyclone_kit.backends.base import Backend, JobHandle, handle_of
from cyclone_kit.core.errors import ValidationError
from cyclone_kit.core.ports import PORT_BASE, PORT_SPAN, candidate_ports, job_port
from cyclone_kit.rundir import contract, failures
from cyclone_kit.rundir.layout import RunDir, StudyDir
from cyclone_kit.rundir.summary import read_run
from cyclone_kit.runtime.env import default_port
from cyclone_kit.slurm.states import JobState


# ------------------------------------------------------------------------ RunDir
def test_run_dir_names_every_path_and_records_a_submission(tmp_path: Path) -> None:
    rd = RunDir.create(tmp_path, "demo", '{"name": "demo"}\n', when=0)
    assert rd.path.name == "demo-19700101-000000" and rd.logs.is_dir() and rd.is_run_dir()
    assert (rd.spec.name, rd.script.name, rd.metrics.name, rd.failure.name) == (
        "spec.json", "job.sbatch", contract.METRICS_FILE, "failure.json")
    assert rd.error_record(3).relative_to(rd.path) == Path("ranks/error-rank-00003.json")
    assert rd.rank_summary(3).relative_to(rd.path) == Path("ranks/rank-00003.json")
    assert rd.rank_log(1, "err").relative_to(rd.path) == Path("logs/rank-1.err")
    assert (rd.job_id(), rd.backend(), handle_of(rd.path)) == (None, None, None)
    rd.write_submission("4242", "slurm")
    rec = read_run(rd.path)
    assert (rec.name, rec.job_id, rec.backend, rec.end_status, rec.root_cause) == ("demo", "4242", "slurm", None, None)
    handle = handle_of(rd.path)
    assert handle == "4242" and (handle.backend, handle.run_dir) == ("slurm", rd.path)
    study = StudyDir(tmp_path / "s")
    assert (study.sweep.name, study.submitted.name, study.report_script.name) == (
        "sweep.json", "submitted.json", "report.sbatch")


def test_run_dir_creation_is_all_or_nothing(tmp_path: Path) -> None:
    with pytest.raises(TypeError):
        RunDir.create(tmp_path, "bad", "{}", {"x.json": object()})  # type: ignore[dict-item]
    assert list(tmp_path.iterdir()) == []


def test_set_threads_rewrites_only_cpus_per_task(tmp_path: Path) -> None:
    rd = RunDir.create(tmp_path, "t", json.dumps({"name": "t", "resources": {"cpus_per_task": 8, "nodes": 1}}))
    rd.set_threads(2)
    assert rd.read_spec()["resources"] == {"cpus_per_task": 2, "nodes": 1}


# ------------------------------------------------------------------------ Backend protocol
@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_backend_implements_the_whole_protocol(name: str) -> None:
    backend = get_backend(name)
    assert isinstance(backend, Backend) and backend.name == name
    for method in ("submit_run", "status", "cancel", "log_files"):
        assert callable(getattr(backend, method)), method


def test_a_finished_local_run_answers_status_from_its_run_directory(tmp_path: Path) -> None:
    rd = RunDir.create(tmp_path, "loc", '{"name": "loc"}')
    rd.metrics.write_text(json.dumps(contract.end_record("completed", 3, 1.0, 1.0, "t")) + "\n")
    rd.write_submission("900000001", "local")
    (rd.logs / "rank-0.out").write_text("hi\n")
    handle = handle_of(rd.path)
    backend = get_backend(handle.backend)
    info = backend.status(handle)
    # no scheduler gave the run an id: status shows none ("-"), not the launcher's invented one (issue 29 item 4)
    assert (info.job_id, info.name, info.state) == ("-", "loc", JobState.COMPLETED)
    assert backend.log_files(handle) == [rd.logs / "rank-0.out"]
    with pytest.raises(ValidationError, match="foreground"):
        backend.cancel(handle)
    with pytest.raises(ValidationError, match="cannot wait"):
        backend.submit_run(object(), rd.path, after=["1"])


def test_job_handle_is_its_id() -> None:
    h = JobHandle("123_4", "submitit", "/r")
    assert h == "123_4" and f"{h}" == "123_4" and h.job_id == "123_4" and h.run_dir == Path("/r")


# ------------------------------------------------------------------------ failure record
def test_both_writers_produce_the_same_versioned_schema(tmp_path: Path) -> None:
    death = failures.death_record(1, "c1", 100, -signal.SIGKILL, "2026-01-01T00:00:00.000+00:00", "77")
    failures.record_death(tmp_path / "a", death)
    watchdog_doc = json.loads((tmp_path / "a" / "failure.json").read_text())
    local_doc = failures.failure_doc(written_by="local", cause="rank_failed", root_cause="rank 1 ...", rank=1,
                                     host="c1", pid=100, exit_code=-9, ranks=[{"rank": 1}])
    assert set(watchdog_doc) == set(local_doc)
    assert watchdog_doc["schema"] == local_doc["schema"] == failures.SCHEMA
    assert (watchdog_doc["rank"], watchdog_doc["signal"], watchdog_doc["first"]["rank"]) == (1, "SIGKILL", 1)
    assert local_doc["signal"] == "SIGKILL"
    assert failures.root_cause(tmp_path / "a") == "rank 1 on host c1 (pid 100) killed by SIGKILL"
    with pytest.raises(ValueError):
        failures.failure_doc(written_by="local", cause="oops", root_cause="x")


def test_a_death_replaces_a_survivors_lost_connection_but_not_a_real_error(tmp_path: Path) -> None:
    """A survivor quicker to record "Connection closed by peer" than the dead rank's watchdog its
    SIGKILL: the death is the root cause. A real first error (a ValueError) is kept."""
    def survivor(run_dir: Path, message: str) -> None:
        (run_dir / "ranks").mkdir(parents=True)
        rec = {"rank": 0, "host": "c1", "type": "RuntimeError" if "peer" in message else "ValueError",
               "message": message, "traceback": "", "time": "2026-01-01T00:00:00.500+00:00"}
        (run_dir / "ranks" / "error-rank-00000.json").write_text(json.dumps(rec))
        assert failures.record_rank_failure(run_dir, 0, written_by="rank")

    death = failures.death_record(1, "c2", 100, -signal.SIGKILL, "2026-01-01T00:00:00.600+00:00", "77")
    survivor(tmp_path / "a", "[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:5000")
    failures.record_death(tmp_path / "a", death)
    assert failures.root_cause(tmp_path / "a") == "rank 1 on host c2 (pid 100) killed by SIGKILL"
    survivor(tmp_path / "b", "bad batch")
    failures.record_death(tmp_path / "b", death)
    assert "ValueError: bad batch" in (failures.root_cause(tmp_path / "b") or "")


def test_root_cause_skips_a_clean_stop_and_falls_back_to_error_records(tmp_path: Path) -> None:
    clean = failures.failure_doc(written_by="local", cause="interrupted", root_cause="interrupted",
                                 ranks=[{"rank": 0, "exit_code": 0}])
    failures.write_failure(tmp_path, clean)
    assert failures.root_cause(tmp_path) is None
    other = tmp_path / "b"
    failures.write_error_record(other, 2, "g1", RuntimeError("boom"), "tb")
    assert failures.root_cause(other) == "rank 2 on g1: RuntimeError: boom"


def test_signal_and_rank_helpers() -> None:
    assert (failures.signal_name(-9), failures.signal_name(0), failures.signal_label(99)) == ("SIGKILL", None, "signal 99")
    assert failures.rank_guess({"SLURM_PROCID": "3", "RANK": "x"}) == 3 and failures.rank_guess({}) == 0


# ------------------------------------------------------------------------ one port formula
def test_templates_and_runtime_share_the_port_formula() -> None:
    for job in (0, 7, 12345, 16000 + 5):
        assert next(candidate_ports(PORT_BASE, PORT_SPAN, job)) == job_port(job) == default_port(str(job), "0")
    assert default_port("12345", "1") == job_port(12345, 1) != job_port(12345, 0)
