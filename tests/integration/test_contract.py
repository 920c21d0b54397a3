"""The metrics contract end to end: what the runtime writes is what the analysis reads, field for field.

A real 2-rank run (local launcher, real gloo process group, tiny CNN) writes ``metrics.jsonl``
and the per-rank summaries; every record must carry the fields :mod:`cyclone_kit.rundir.contract`
declares, and :func:`cyclone_kit.analysis.ingest.load_runs` must give back each of those values
unchanged. The synthetic-study generator is held to the same contract.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from cyclone_kit.analysis.ingest import load_runs
from cyclone_kit.analysis.synthetic import SyntheticRun, run_records
from cyclone_kit.backends.srun_emulator import launch
from cyclone_kit.config.job import spec_from_dict, spec_to_dict
from cyclone_kit.config.toolbox import read_toml
from cyclone_kit.rundir import contract
from cyclone_kit.rundir.layout import RunDir

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]

#: start-record field -> runs-table column (versions are split into three columns).
START_TO_RUNS = {
    "run_id": "run_id", "world_size": "world_size", "num_nodes": "num_nodes", "local_world_size": "local_world_size",
    "per_device_batch_size": "per_device_batch_size", "global_batch_size": "global_batch_size", "model": "model",
    "dataset": "dataset", "precision": "precision", "strategy": "strategy", "launcher": "launcher",
    "device": "device", "device_name": "device_name", "slurm_job_id": "slurm_job_id", "time": "start_time",
    "git_commit": "git_commit", "restart_count": "restart_count",
}


def _same(a: Any, b: Any) -> bool:
    if a is None or (isinstance(a, float) and math.isnan(a)):
        return b is None or (isinstance(b, float) and math.isnan(b))
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(float(a), float(b), rel_tol=1e-12)
    return a == b


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> RunDir:
    rd = RunDir(tmp_path_factory.mktemp("contract") / "run")
    data = read_toml(REPO / "jobs" / "smoke.toml")
    data["train"] = {**data["train"], "steps": 12, "log_every": 2, "synthetic_samples": 384, "val_samples": 64}
    data["checkpoint"] = {**data["checkpoint"], "every_steps": 0}
    rd.path.mkdir(parents=True)
    rd.write_spec(json.dumps(spec_to_dict(spec_from_dict(data))))
    result = launch(rd.path, 2, 1, threads=1, extra_env={"CUDA_VISIBLE_DEVICES": ""})
    assert result.ok, (rd.rank_log(0, "err").read_text(), rd.rank_log(1, "err").read_text())
    return rd


def test_every_record_the_runtime_writes_carries_the_contract_fields(real_run: RunDir) -> None:
    records = [json.loads(line) for line in real_run.metrics.read_text().splitlines()]
    kinds = [r["kind"] for r in records]
    assert set(kinds) == set(contract.KINDS), kinds
    for rec in records:
        assert rec["schema"] == contract.SCHEMA and contract.missing_fields(rec) == (), rec
    start = records[0]
    assert start["launcher"] in contract.LAUNCHERS and set(start["versions"]) == set(contract.VERSION_FIELDS)
    for path in real_run.rank_summaries():
        assert set(json.loads(path.read_text())) >= set(contract.RANK_SUMMARY_FIELDS)


def test_what_the_runtime_writes_is_what_the_analysis_reads(real_run: RunDir) -> None:
    records = [json.loads(line) for line in real_run.metrics.read_text().splitlines()]
    data = load_runs(real_run.path, warn=False)
    assert data.warnings == ()
    (row,) = data.runs.to_dict("records")
    start = next(r for r in records if r["kind"] == "start")
    end = [r for r in records if r["kind"] == "end"][-1]
    for field in contract.START_FIELDS:
        if field == "versions":
            for name in contract.VERSION_FIELDS:
                assert row[f"{name}_version"] == start["versions"][name], name
        elif field == "hostnames":
            assert row["hostnames"] == ",".join(start["hostnames"])
        else:
            assert _same(start[field], row[START_TO_RUNS[field]]), field
    assert (row["status"], row["steps"], row["end_time"]) == (end["status"], end["steps"], end["time"])
    assert _same(row["samples_per_s"], end["samples_per_s"]) and _same(row["wall_time_s"], end["wall_time_s"])

    steps = [r for r in records if r["kind"] == "step"]
    read_steps = data.steps.to_dict("records")
    assert len(read_steps) == len(steps) > 0
    for written, read in zip(steps, read_steps, strict=True):
        assert all(_same(written[f], read[f]) for f in contract.STEP_FIELDS), (written, read)

    epochs = [r for r in records if r["kind"] == "epoch"]
    read_epochs = data.epochs.to_dict("records")
    assert len(read_epochs) == len(epochs) > 0
    for written, read in zip(epochs, read_epochs, strict=True):
        assert all(_same(written[f], read[f]) for f in contract.EPOCH_FIELDS), (written, read)

    summaries = [json.loads(p.read_text()) for p in real_run.rank_summaries()]
    read_ranks = data.ranks.sort_values("rank").to_dict("records")
    assert len(read_ranks) == len(summaries) == 2
    for written, read in zip(summaries, read_ranks, strict=True):
        assert all(_same(written[f], read[f]) for f in contract.RANK_SUMMARY_FIELDS), (written, read)
        assert all(_same(written[f], read[f]) for f in contract.RANK_SUMMARY_CPU_FIELDS), (written, read)


def test_synthetic_studies_are_generated_through_the_same_contract() -> None:
    records = run_records(SyntheticRun(4, 400.0, statuses=("preempted", "completed")))
    for rec in records:
        assert contract.missing_fields(rec) == (), rec
    assert {r["launcher"] for r in records if r["kind"] == "start"} <= set(contract.LAUNCHERS)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
