"""submitit's local executor runs the training callable on 2 local ranks; the same metrics come out."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cyclone_kit.backends.submitit_ import SubmititBackend
from cyclone_kit.config.job import load_spec
from cyclone_kit.config.profile import load_profile
from cyclone_kit.config.validate import resolve, spec_json
from cyclone_kit.core.errors import RankFailure, ValidationError
from cyclone_kit.rundir.layout import create_run_dir
from tests.helpers.cli import REPO, run_cli

pytestmark = pytest.mark.slow


def _prepare(tmp_path: Path, **train: object) -> tuple[object, Path]:
    import dataclasses

    spec = load_spec(REPO / "jobs" / "smoke.toml")
    spec = dataclasses.replace(spec, train=dataclasses.replace(spec.train, **train))
    job = resolve(spec, load_profile("local"))
    return job, create_run_dir(tmp_path, spec.name, {"spec.json": spec_json(job)})


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, list[Path]]:
    """One ``submit --backend submitit`` run on the local executor (2 ranks) that two tests assert on (issue 27)."""
    runs = tmp_path_factory.mktemp("submitit-cli")
    result = run_cli("submit", str(REPO / "jobs" / "smoke.toml"), "--backend", "submitit", "--runs-dir",
                     str(runs), "--set", "train.steps=5", timeout=240,
                     env={"CYCLONE_SUBMITIT_EXECUTOR": "local", "PATH": os.environ["PATH"]})
    run_dirs = [p for p in runs.iterdir() if p.is_dir()]
    return result, run_dirs


def _the_run(cli_run: tuple[object, list[Path]]) -> Path:
    result, run_dirs = cli_run
    assert result.returncode == 0, result.stderr
    (run_dir,) = run_dirs
    return run_dir


def test_local_executor_trains_two_ranks(cli_run: tuple[object, list[Path]]) -> None:
    # the local executor's own records, on the CLI's run below (submit_run's local path also runs in
    # test_local_executor_failure_raises_rank_failure)
    run_dir = _the_run(cli_run)
    job_id = (run_dir / "job_id").read_text().strip()
    assert job_id.isdigit() and (run_dir / "submitit_job").read_text().strip() == job_id
    records = _records(run_dir)
    start = next(r for r in records if r["kind"] == "start")
    assert (start["world_size"], start["launcher"]) == (2, "submitit")
    assert [r for r in records if r["kind"] == "end"][-1]["status"] == "completed"
    logs = sorted(p.name for p in (run_dir / "submitit").glob("*_log.*"))
    assert f"{job_id}_0_log.out" in logs and f"{job_id}_1_log.err" in logs


def test_local_executor_failure_raises_rank_failure(tmp_path: Path) -> None:
    job, run_dir = _prepare(tmp_path, steps=5)
    (run_dir / "spec.json").write_text("{ not json")
    with pytest.raises(RankFailure, match=r"submitit local job \d+ failed"):
        SubmititBackend(executor="local").submit_run(job, run_dir)


def test_local_executor_refuses_several_nodes(tmp_path: Path) -> None:
    import dataclasses

    job, run_dir = _prepare(tmp_path, steps=5)
    with pytest.raises(ValidationError, match="runs on one node"):
        SubmititBackend(executor="local").submit_run(dataclasses.replace(job, nodes=2), run_dir)


def test_submit_cli_with_the_local_submitit_executor(cli_run: tuple[object, list[Path]]) -> None:
    run_dir = _the_run(cli_run)
    assert (run_dir / "backend").read_text().strip() == "submitit"
    assert next(r for r in _records(run_dir) if r["kind"] == "start")["world_size"] == 2
