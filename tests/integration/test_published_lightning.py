"""Lightning's own MNIST examples, byte for byte as published, through `cyclone-kit run` (issue 29).

Both build their data path from ``__file__`` (two and three folders up, in Lightning's repository
layout: tests/data/published); each runs from the folder its author runs it from, under the default
snapshot of the code. What must hold: the data is found where the author put it (nothing is
downloaded, no stray folder appears), both ranks form one process group (Lightning's Trainer with
``devices=2``; Fabric's ``Fabric()`` with no arguments and no ``fabric run``), and the run's records
and ``status`` say it completed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.cli import jsonl_records, run_cli, run_dir_of
from tests.helpers.published import BACKBONE, FABRIC, SHORT_FABRIC, SHORT_TRAINER, lightning_checkout, tree

pytestmark = pytest.mark.slow
#: hang guard of a run (not a performance bound): each took ~10 s here
HANG_S = 600


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    return lightning_checkout(tmp_path / "pytorch-lightning")


def _check_run(proc, checkout: Path, before: set[str], made: set[str]) -> Path:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    run_dir = run_dir_of(proc.stdout)
    logs = "".join(p.read_text(errors="replace") for p in (run_dir / "logs").glob("*"))
    assert "independent copies" not in out, out[-3000:]
    assert "Downloading" not in logs and "download" not in out.lower(), logs[-3000:]
    records = jsonl_records(run_dir / "metrics.jsonl")
    (start,), (end,) = ([r for r in records if r["kind"] == k] for k in ("start", "end"))
    assert start["world_size"] == 2 and end["status"] == "completed" and end["process_group_world"] == 2, records
    assert (start["launcher"], start["slurm_job_id"]) == ("local", None), "no job id that no scheduler gave"
    new = tree(checkout) - before
    assert {p.split("/")[-1] for p in new} <= made, f"unexpected files in the checkout: {sorted(new)}"
    assert not [p for p in (run_dir / "script").rglob("*") if p.name in ("Datasets", "data", "MNIST")], \
        "the snapshot must not hold a data folder: the scripts found theirs next to the published files"
    status = run_cli("status", str(run_dir), timeout=HANG_S)
    assert status.returncode == 0, status.stdout + status.stderr
    return run_dir


@pytest.mark.timeout(HANG_S + 60)
def test_lightning_backbone_example_trains_on_two_ranks_with_its_data_next_to_its_file(checkout: Path,
                                                                                        tmp_path: Path) -> None:
    folder, script = checkout / BACKBONE[0], BACKBONE[1]
    before = tree(checkout)
    proc = run_cli("run", script, "--nproc", "2", "--runs-dir", str(tmp_path / "runs"), "--",
                   *SHORT_TRAINER, "--trainer.devices=2", cwd=folder, timeout=HANG_S)
    run_dir = _check_run(proc, checkout, before, made={
        "lightning_logs", "version_0", "checkpoints", "config.yaml", "hparams.yaml", "metrics.csv"}
        | {p.name for p in (folder / "lightning_logs").rglob("*.ckpt")})
    # One Trainer world of 2, not two copies: one logger version, and the test and predict loops ran.
    assert sorted(p.name for p in (folder / "lightning_logs").iterdir()) == ["version_0"]
    out = proc.stdout + "".join(p.read_text(errors="replace") for p in (run_dir / "logs").glob("*.out"))
    assert "test_loss" in out and "tensor([[" in out, out[-3000:]


@pytest.mark.timeout(HANG_S + 60)
def test_fabric_image_classifier_trains_on_two_ranks_without_fabric_run(checkout: Path, tmp_path: Path) -> None:
    folder, script = checkout / FABRIC[0], FABRIC[1]
    before = tree(checkout)
    proc = run_cli("run", script, "--nproc", "2", "--runs-dir", str(tmp_path / "runs"), "--", *SHORT_FABRIC,
                   cwd=folder, timeout=HANG_S)
    run_dir = _check_run(proc, checkout, before, made=set())
    out = proc.stdout + "".join(p.read_text(errors="replace") for p in (run_dir / "logs").glob("*.out"))
    assert "Train Epoch: 1 [0/60000 (0%)]" in out and "Test set: Average loss:" in out, out[-3000:]
