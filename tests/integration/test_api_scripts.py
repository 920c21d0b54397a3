"""examples/ddp_ck.py through the CLI that runs any script (``cyclone-kit run SCRIPT``, ``sweep``): the API's
records are what ``report`` reads (issue 14 "done when": run ... --nproc 2 writes start/step/end records that
report reads; a strong sweep of ddp_ck.py ends in a scaling.csv with both world sizes and per-device batches)."""

from __future__ import annotations

import csv
import json
import re
import textwrap
from pathlib import Path

import pytest

from tests.helpers.cli import REPO, run_cli

pytestmark = pytest.mark.slow

DDP_CK = REPO / "examples" / "ddp_ck.py"
TIMEOUT_S = 300


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_run_ddp_ck_with_two_ranks_writes_the_records_report_reads(tmp_path: Path) -> None:
    proc = run_cli("run", str(DDP_CK), "--nproc", "2", "--quiet", "--runs-dir", str(tmp_path / "runs"), "--",
                   "--steps", "20", "--batch-size", "32", timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = Path(re.search(r"^run dir: (.+)$", proc.stdout, re.MULTILINE).group(1))
    records = _records(run_dir / "metrics.jsonl")
    kinds = [r["kind"] for r in records]
    assert kinds[0] == "start" and kinds[-1] == "end" and kinds.count("step") == 2  # log_every 10: steps 10, 20
    start, end = records[0], records[-1]
    assert (start["strategy"], start["world_size"], start["per_device_batch_size"], start["global_batch_size"]) == (
        "script", 2, 32, 64)
    assert (end["status"], end["steps"]) == ("completed", 20) and end["samples_per_s"] > 0
    assert "time-to-solution" not in {r.get("strategy") for r in records}, "the script's own metrics, not the shim's"
    report = run_cli("report", str(run_dir), "-o", str(tmp_path / "report"), timeout=TIMEOUT_S)
    assert report.returncode == 0, report.stderr
    with open(tmp_path / "report" / "scaling.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["world_size"], r["per_device_batch_size"], r["strategy"]) for r in rows] == [("2", "32", "script")]


def test_strong_sweep_of_ddp_ck_reports_both_world_sizes(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep.toml"
    sweep.write_text(textwrap.dedent(f"""
        [sweep]
        name = "ddpck"
        mode = "strong"
        global_batch_size = 128
        world_sizes = [1, 2]

        [base]
        name = "ddpck"
        [base.script]
        path = {json.dumps(str(DDP_CK))}
        args = ["--steps", "20", "--batch-size", "{{per_device_batch_size}}"]
        [base.resources]
        profile = "local"
    """))
    proc = run_cli("sweep", str(sweep), "--backend", "local", "--quiet", "--runs-dir", str(tmp_path / "runs"),
                   timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    study = Path(re.search(r"^study dir: (.+)$", proc.stdout, re.MULTILINE).group(1))
    with open(study / "report" / "scaling.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["world_size"], r["per_device_batch_size"], r["global_batch_size"], r["strategy"]) for r in rows] == [
        ("1", "128", "128", "script"), ("2", "64", "128", "script")]
    assert all(float(r["samples_per_s"]) > 0 for r in rows)
