"""Faults around checkpoints and the run directory, in real processes on this machine (issue 22).

* a flipped byte in the newest checkpoint: its checksum fails, the previous one is loaded, and
  the warning is on the console (rank 0's echoed output) and in the run's ``start`` record;
* every checkpoint unreadable on ``run --resume``: refused with the reason, exit 2, nothing
  overwritten (checkpoints, metrics); ``--restart-from-scratch`` starts over when asked;
* a full disk (a small tmpfs mounted here) during a checkpoint and during a metrics write:
  one clear line naming the path and the space needed, the older checkpoints intact and
  loadable, no torn metrics line, and no traceback from the launcher (which says why
  ``failure.json`` could not be written);
* a NaN loss: recorded as "NaN" (not null), warned once, and a stop after K such steps.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import textwrap
from pathlib import Path
from typing import Any

import pytest

from cyclone_kit.runtime import checkpoint as ckpt
from tests.helpers.cli import REPO, run_cli
from tests.helpers.disk import small_disk

pytestmark = pytest.mark.slow

#: Hang guard for one 1-2 rank run of a few steps (~10 s here), not a performance bound.
TIMEOUT_S = 240


def records(run_dir: Path, kind: str | None = None) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").is_file() else []
    recs = [json.loads(line) for line in lines]  # every line must be whole JSON: no torn line
    return [r for r in recs if kind is None or r["kind"] == kind]


def run_dir_of(stdout: str) -> Path:
    return Path(next(line.split(": ", 1)[1] for line in stdout.splitlines() if line.startswith("run dir: ")))


def snapshot(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def smoke(tmp_path: Path, *extra: str) -> tuple[Any, Path]:
    result = run_cli("run", str(REPO / "jobs" / "smoke.toml"), "--nproc", "2", "--runs-dir", str(tmp_path / "runs"),
                     "--set", "train.steps=6", "--set", "train.log_every=1", "--set", "checkpoint.every_steps=2",
                     "--set", "checkpoint.keep=3", "--set", "train.val_samples=64", *extra, cwd=tmp_path,
                     timeout=TIMEOUT_S)
    return result, run_dir_of(result.stdout)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 2-rank smoke run of 8 steps (checkpoints at steps 4, 6 and 8 kept), shared by the tests that damage
    its checkpoints (issue 27: one training run, not one per test). Each test damages its own copy
    (:func:`copy_of`), so a copy resumes as the original would: the run directory's own path is in no file a
    resume reads (spec.json, the checkpoints, metrics.jsonl and progress/ hold none; ``run --resume`` takes the
    path it is given), only in the launcher's records of the first launch (launch.json, rewritten by every
    launch, and the logs)."""
    tmp_path = tmp_path_factory.mktemp("trained")
    first, run_dir = smoke(tmp_path, "--set", "train.steps=8")
    assert first.returncode == 0, first.stdout + first.stderr
    assert [s for s, _ in ckpt.list_checkpoints(run_dir / "checkpoints")] == [8, 6, 4]
    return run_dir


def copy_of(run_dir: Path, tmp_path: Path) -> Path:
    """This test's own copy of the shared run directory, under the same name."""
    copy = tmp_path / "runs" / run_dir.name
    shutil.copytree(run_dir, copy)
    return copy


def test_a_flipped_byte_in_the_newest_checkpoint_resumes_from_the_previous_one_with_a_warning(
        trained: Path, tmp_path: Path) -> None:
    run_dir = copy_of(trained, tmp_path)
    folder = run_dir / "checkpoints"
    assert [s for s, _ in ckpt.list_checkpoints(folder)] == [8, 6, 4]
    newest = ckpt.checkpoint_path(folder, 8)
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x10  # one bit, in the middle of the tensors
    newest.write_bytes(bytes(data))
    # Resume into a longer run: from step 6 (the damaged step-8 file is skipped), on to 10.
    spec = json.loads((run_dir / "spec.json").read_text())
    spec["train"]["steps"] = 10
    (run_dir / "spec.json").write_text(json.dumps(spec))
    again = run_cli("run", "--resume", str(run_dir), "--nproc", "2", cwd=tmp_path, timeout=TIMEOUT_S)
    assert again.returncode == 0, again.stdout + again.stderr
    warning = next(line for line in again.stdout.splitlines() if "skipping damaged checkpoint" in line)
    assert newest.name in warning and "checksum mismatch" in warning
    assert f"resumed from {ckpt.checkpoint_path(folder, 6)} at step 6" in again.stdout
    start = records(run_dir, "start")[-1]
    assert start["start_step"] == 6 and start["resumed_from"] == "ckpt-000000006.pt"
    assert start["skipped_checkpoints"][0]["path"] == newest.name
    assert "checksum mismatch" in start["skipped_checkpoints"][0]["reason"]
    assert [r["step"] for r in records(run_dir, "step")] == [*range(1, 9), 7, 8, 9, 10]
    status = run_cli("status", str(run_dir), cwd=tmp_path)
    assert "skipped damaged checkpoint ckpt-000000008.pt" in status.stdout, status.stdout


def test_every_checkpoint_unreadable_on_resume_is_refused_with_exit_2_and_nothing_overwritten(
        trained: Path, tmp_path: Path) -> None:
    run_dir = copy_of(trained, tmp_path)
    folder = run_dir / "checkpoints"
    for _, path in ckpt.list_checkpoints(folder):
        path.write_bytes(path.read_bytes()[:-64])  # torn at the end, as by a full disk
    before, metrics = snapshot(folder), (run_dir / "metrics.jsonl").read_bytes()
    refused = run_cli("run", "--resume", str(run_dir), "--nproc", "2", cwd=tmp_path, timeout=TIMEOUT_S)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    line = refused.stderr.splitlines()[0]  # the root cause first; the rank's whole line (with the HINT) below it
    assert line.startswith("error: ") and "ResumeRefused: refusing to start over at step 0" in line, line
    assert all(f"{name}: checksum mismatch" in line for name in ("ckpt-000000008.pt", "ckpt-000000006.pt",
                                                                   "ckpt-000000004.pt")), line  # each one's reason
    assert "Traceback" not in refused.stderr
    assert "HINT: repair or restore a checkpoint there; or start over at step 0 with cyclone-kit run --resume" in (
        refused.stderr) and "--restart-from-scratch" in refused.stderr
    assert snapshot(folder) == before and (run_dir / "metrics.jsonl").read_bytes() == metrics
    # Asked for: it starts over at step 0 and trains the whole run again.
    scratch = run_cli("run", "--resume", str(run_dir), "--nproc", "1", "--restart-from-scratch", cwd=tmp_path,
                      timeout=TIMEOUT_S)
    assert scratch.returncode == 0, scratch.stdout + scratch.stderr
    assert records(run_dir, "start")[-1]["start_step"] == 0 and records(run_dir, "end")[-1]["status"] == "completed"


# ------------------------------------------------------------------------ a full disk
#: The API script of the disk-full tests: one checkpoint, then another writer fills the disk,
#: then a checkpoint (``ckpt``) or a metrics line (``metrics``) that cannot fit.
FILLER = """
    import os, sys, torch
    import cyclone_kit as ck
    where = sys.argv[1]
    ck.init(log_every=1)
    state = {"w": torch.arange(20000, dtype=torch.float32)}  # ~80 KB a checkpoint
    ck.log_step(1, samples=4, loss=1.0)
    ck.save_checkpoint({**state, "step": 1}, blocking=True)  # on disk before the other writer fills it
    with open(os.path.join(os.environ["FILL_DIR"], "filler"), "ab", buffering=0) as f:  # another writer takes the rest
        try:
            while True:
                f.write(b"x" * 4096)
                f.flush()
        except OSError:
            pass
    if where == "ckpt":  # written in the background (checkpoint.async_write): its failure surfaces at ck.finish()
        ck.save_checkpoint({**state, "step": 2})
    elif where == "ckpt-next":  # ... or at the next save, which waits for it first
        ck.save_checkpoint({**state, "step": 2})
        ck.save_checkpoint({**state, "step": 3})
    elif where == "ckpt-sync":  # checkpoint.async_write = false: the save itself fails
        ck.save_checkpoint({**state, "step": 2}, blocking=True)
    else:  # the metrics file's last block has room for a few lines more: log until it is full too
        for step in range(2, 10000):
            ck.log_step(step, samples=4, loss=0.5)
    ck.finish()
"""


@pytest.mark.parametrize("where", ["ckpt", "ckpt-next", "ckpt-sync", "metrics"])
def test_a_full_disk_gives_one_clear_line_and_leaves_the_older_checkpoint_intact(tmp_path: Path, where: str) -> None:
    script = tmp_path / "fill.py"
    script.write_text(textwrap.dedent(FILLER))
    with small_disk(tmp_path / "disk", 2048) as disk:
        result = run_cli("run", str(script), "--nproc", "1", "--runs-dir", str(disk / "runs"), "--", where,
                         cwd=tmp_path, env={"FILL_DIR": str(disk)}, timeout=TIMEOUT_S)
        out = result.stdout + result.stderr
        assert result.returncode == 1, out
        assert "Traceback" not in result.stderr, result.stderr
        run_dir = run_dir_of(result.stdout)
        in_ckpt = where.startswith("ckpt")
        target = ckpt.checkpoint_path(run_dir / "checkpoints", 2) if in_ckpt else run_dir / "metrics.jsonl"
        line = result.stderr.splitlines()[0]  # the root cause, from the rank's own line (it could write no record)
        assert line.startswith("error: rank 0 on host") and "no space left on the device" in line, line
        assert f"writing {'checkpoint' if in_ckpt else 'metrics'} {target}: it needs" in line, line
        assert "HINT: free space" in result.stderr
        if in_ckpt:  # the same line whether the checkpoint was written in the background or not
            assert "the older checkpoints are intact" in line
            assert "KiB" in line.split("it needs", 1)[1].split(",")[0]  # the ~80 KB the checkpoint takes
        # The launcher could not write failure.json either: it says so instead of a traceback.
        assert "failure record not written" in result.stderr and "failure.json" in result.stderr
        # The older checkpoint is whole and verifies; no half-written file is left.
        assert [s for s, _ in ckpt.list_checkpoints(run_dir / "checkpoints")] == [1]
        assert ckpt.verify_checkpoint(ckpt.checkpoint_path(run_dir / "checkpoints", 1))
        assert not list((run_dir / "checkpoints").glob(".ckpt-*"))
        text = (run_dir / "metrics.jsonl").read_text()
        assert text.endswith("\n") and [r["kind"] for r in records(run_dir)][:2] == ["start", "step"]  # all whole


# ------------------------------------------------------------------------ a loss that is not finite
NAN_LOSS = """
    import math, sys
    import cyclone_kit as ck
    ck.init(log_every=1, max_nonfinite_steps=int(sys.argv[1]))
    for step in range(1, 9):
        ck.log_step(step, samples=4, loss=1.0 if step < 4 else math.nan)
    ck.finish()
"""


def test_a_nan_loss_is_recorded_as_such_warned_once_and_stops_after_k_steps(tmp_path: Path) -> None:
    script = tmp_path / "nan.py"
    script.write_text(textwrap.dedent(NAN_LOSS))
    result = run_cli("run", str(script), "--nproc", "1", "--runs-dir", str(tmp_path / "runs"), "--", "3",
                     cwd=tmp_path, timeout=TIMEOUT_S)
    run_dir = run_dir_of(result.stdout)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.count("the loss is not finite") == 1
    assert "the loss was not finite for 3 step(s) in a row up to step 6" in result.stderr
    steps = records(run_dir, "step")
    assert [r["loss"] for r in steps] == [1.0, 1.0, 1.0, "NaN", "NaN", "NaN"]
    assert [r.get("nonfinite_steps", 0) for r in steps] == [0, 0, 0, 1, 1, 1]
    kept_going = run_cli("run", str(script), "--nproc", "1", "--runs-dir", str(tmp_path / "runs"), "--", "0",
                         cwd=tmp_path, timeout=TIMEOUT_S)
    assert kept_going.returncode == 0, kept_going.stdout + kept_going.stderr
    assert [r["loss"] for r in records(run_dir_of(kept_going.stdout), "step")][-1] == "NaN"
