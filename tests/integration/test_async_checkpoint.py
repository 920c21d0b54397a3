"""Asynchronous checkpoints (``checkpoint.async_write``, the default), in a real process through the public API.

The moments are made, never waited out: the script holds its background write on a gate (a
``threading.Event`` in front of :func:`cyclone_kit.runtime.checkpoint.save_checkpoint`) and lets
it go only once the test's condition holds (its state mutated; the next save waiting for it,
read from the main thread's stack). The engine's side (a SIGKILL during a background write, the
stop checkpoint complete at exit, the resumed trajectory) is in test_signals.py and test_ddp.py;
a background write that finds the disk full, in test_checkpoint_faults.py. Three saves in the
background, one blocking; ``ck.finish()`` returns with the last background write in place.

FSDP's sharded checkpoints (``checkpoint.sharded`` with ``async_write``) and a pipeline's (its stages'
tensors), written in the background on every rank: a rank SIGKILLed while its shard write is held
(:mod:`tests.helpers.slow_parts`: the fsync of its shard file waits for a file the test never writes) leaves
no checkpoint that loads
as good, and the run resumes from the one before, on the same trajectory. The uninterrupted run and its
resume from a copy: test_strategies.py.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from cyclone_kit.runtime import checkpoint as ckpt
from tests.helpers.cli import REPO, jsonl_records
from tests.helpers.ranks import all_ok, finish, per_run, popen_group, rank_envs, records, start_runs, write_spec
from tests.helpers.slow_parts import hold_files, slow_parts_env
from tests.helpers.slurm_jobs import wait_for

pytestmark = pytest.mark.slow

#: Hang guard for one single-rank script of three saves (~5 s here), not a performance bound.
TIMEOUT_S = 240

SCRIPT = """
    import json, sys, threading, time
    import torch
    import cyclone_kit as ck
    from cyclone_kit.runtime import checkpoint as ckmod

    gate, threads = threading.Event(), {}
    original = ckmod.save_checkpoint

    def gated(folder, state, step, keep):  # the background write starts only when the script says so
        threads[step] = threading.current_thread() is threading.main_thread()
        if not threads[step]:
            gate.wait()
        return original(folder, state, step, keep)

    ckmod.save_checkpoint = gated

    def release_when_the_next_save_waits():
        main, code = threading.main_thread().ident, ckmod.BackgroundWriter.wait.__code__
        while True:
            frame = sys._current_frames().get(main)
            while frame is not None and frame.f_code is not code:
                frame = frame.f_back
            if frame is not None:
                return gate.set()
            time.sleep(0.001)

    ck.init(run_dir=sys.argv[1], log_every=1)
    model = torch.nn.Linear(64, 8)
    history = [1]
    ck.log_step(1, samples=4, loss=1.0)
    first = ck.save_checkpoint({"model": model.state_dict(), "history": history, "step": 1})
    returned_before_written = not first.exists()
    with torch.no_grad():  # later "optimizer steps" and bookkeeping, while the write is held
        model.weight.add_(1.0)
        model.bias.zero_()
    history.append(2)
    threading.Thread(target=release_when_the_next_save_waits).start()
    ck.log_step(2, samples=4, loss=1.0)
    ck.save_checkpoint({"model": model.state_dict(), "history": history, "step": 2})  # waits for the held write
    ck.log_step(3, samples=4, loss=1.0)
    third = ck.save_checkpoint({"model": model.state_dict(), "step": 3}, blocking=True)
    complete_on_return = third.exists() and ckmod.digest_path(third).exists()
    last = ck.save_checkpoint({"model": model.state_dict(), "step": 4})  # in the background, right before the end
    ck.finish()  # finishes the write: the file is complete here, not only at interpreter exit
    print("RESULT " + json.dumps({"returned_before_written": returned_before_written,
                                  "complete_on_return": complete_on_return,
                                  "complete_after_finish": ckmod.verify_checkpoint(last),
                                  "main_thread": {str(k): v for k, v in threads.items()}}), flush=True)
"""


def test_background_write_copies_the_state_waits_for_the_previous_write_and_says_so(tmp_path: Path) -> None:
    script = tmp_path / "saves.py"
    script.write_text(textwrap.dedent(SCRIPT))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "spec.json").write_text(json.dumps({"checkpoint": {"keep": 4}}))  # ck.init reads [checkpoint]
    proc = subprocess.run([sys.executable, str(script), str(run_dir)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=TIMEOUT_S, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):])
    # steps 1 and 2 were written by the background thread, step 3 (blocking=True) by the caller
    assert result["main_thread"] == {"1": False, "2": False, "3": True, "4": False}, result
    assert result["returned_before_written"] and result["complete_on_return"], result
    assert result["complete_after_finish"], "ck.finish() returns once the last background write is in place"
    folder = run_dir / "checkpoints"
    one = ckpt.load_checkpoint(ckpt.checkpoint_path(folder, 1))["user_state"]
    two = ckpt.load_checkpoint(ckpt.checkpoint_path(folder, 2))["user_state"]
    # what was mutated after the first save returned (while its write was held) is not in its file
    assert one["history"] == [1] and two["history"] == [1, 2]
    assert torch.equal(two["model"]["weight"], one["model"]["weight"] + 1.0)
    assert one["model"]["bias"].abs().sum() > 0 and not two["model"]["bias"].any()
    # the second save waited for the first write: the console and the end record say so
    assert "cyclone_kit: checkpoint of step 2 waited" in proc.stdout and "for the write of step 1" in proc.stdout
    end = [r for r in jsonl_records(run_dir / "metrics.jsonl") if r["kind"] == "end"][-1]
    assert end["status"] == "completed" and end["checkpoints_async"] == 3, end
    assert end["checkpoint_waits"] >= 1 and end["checkpoint_wait_s"] > 0 and end["checkpoint_snapshot_s"] > 0, end
    assert [s for s, _ in ckpt.list_checkpoints(folder)] == [4, 3, 2, 1]
    assert not list(folder.glob(".ckpt-*")), "no temporary file left"


LOCAL_FIRST = """
    import sys, torch
    import cyclone_kit as ck
    ck.init(run_dir=sys.argv[1])
    w = torch.arange(1000, dtype=torch.float32)
    for step in (1, 2, 3):
        ck.save_checkpoint({"w": w + step, "step": step}, blocking=step == 2)
    ck.finish()
"""


def test_a_node_local_first_copy_is_copied_into_the_run_and_verified(tmp_path: Path) -> None:
    script = tmp_path / "local.py"
    script.write_text(textwrap.dedent(LOCAL_FIRST))
    run_dir, local = tmp_path / "run", tmp_path / "node-local"
    run_dir.mkdir()
    (run_dir / "spec.json").write_text(json.dumps({"checkpoint": {"keep": 2, "local_dir": str(local)}}))
    proc = subprocess.run([sys.executable, str(script), str(run_dir)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=TIMEOUT_S, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    shared = run_dir / "checkpoints"
    assert [s for s, _ in ckpt.list_checkpoints(shared)] == [3, 2], "checkpoint.keep applies in the run directory"
    assert [s for s, _ in ckpt.list_checkpoints(local / run_dir.name)] == [3], "the newest is kept on the node"
    for _, path in ckpt.list_checkpoints(shared):
        assert ckpt.verify_checkpoint(path)  # its own checksum file, written before the rename
    state, path = ckpt.load_latest(shared)
    assert path.parent == shared and torch.equal(state["user_state"]["w"], torch.arange(1000.0) + 3)
    assert ckpt.file_sha256(path) == ckpt.file_sha256(ckpt.checkpoint_path(local / run_dir.name, 3))


def _segments(run_dir: Path) -> list[dict[int, float]]:
    """The step losses of each segment of ``run_dir`` (split at its start records), in order."""
    segments: list[dict[int, float]] = [{}]  # [{}] before the first start record
    for rec in records(run_dir):
        if rec["kind"] == "start" and (len(segments) > 1 or segments[0]):
            segments.append({})
        elif rec["kind"] == "step":
            segments[-1][rec["step"]] = rec["loss"]
    return segments


#: The strategies whose sharded checkpoints a rank is killed in the middle of (one run each).
SHARDED = ("fsdp", "pipeline")
EVERY, TOTAL = 2, 8  #: checkpoints every 2 steps of 8


@dataclasses.dataclass
class KilledRun:
    run: Path  #: its run directory
    alive_when_held: bool  #: both ranks were running when rank 1's shard write of step 4 was held
    complete_when_held: list[int]  #: the complete checkpoints then
    dcp_when_held: bool  #: step 4's shard folder existed then
    pt_in_flight: bool  #: step 4's .pt existed once training was past step 4 (the held write still in flight)
    killed: list[tuple[int, str, str]]  #: the first segment's ranks' (exit code, stdout, stderr)
    left: list[str]  #: the files of its checkpoint folder once both had ended
    complete_left: list[int]  #: its complete checkpoints then
    latest: tuple[int, Any, Path]  #: the step, model entry and path of the newest one that loaded then
    resumed: list[tuple[int, str, str]]  #: the same of the resumed segment


@pytest.fixture(scope="module")
def killed_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, KilledRun]:
    """One 2-rank run per strategy of :data:`SHARDED`, rank 1 SIGKILLed while its shard write of step 4 is held,
    then resumed. The two first segments' 4 ranks are forked from one process, and so are the two resumes'
    (issue 27: two imports of torch, not four): slow_parts' sitecustomize runs once, in the process they are
    forked from, and each rank holds in the folder its own environment names (``CK_SLOW_PARTS_HOLD_DIR``; both
    runs hold the same write, docs/TESTING.md item 29). Each run has its own spec, run directory, hold folder
    and rendezvous, and only its own rank 1 is killed; each run's moments are acted on as soon as they come (one
    polling loop for both), as they were when each run had its process of its own."""
    base = tmp_path_factory.mktemp("killed-during-write")
    runs = {strategy: base / strategy for strategy in SHARDED}
    starts = []
    for strategy, run in runs.items():
        layout = (dict(pipeline_stages=2, microbatches=2, pipeline_schedule="gpipe") if strategy == "pipeline"
                  else {})
        write_spec(run, checkpoint={"every_steps": EVERY, "keep": 3, "async_write": True,
                                    **({"sharded": True} if strategy == "fsdp" else {})},
                   strategy=strategy, batch_size=32, log_every=1, synthetic_samples=640, steps=TOTAL,
                   val_samples=64, **layout)
        env = slow_parts_env(base / f"slow-{strategy}", hold_shard=2, hold_shard_rank=1)
        starts += [(["-m", "cyclone_kit.runtime", "--run-dir", str(run)], rank_env) for rank_env in rank_envs(2, env)]
    procs = dict(zip(runs, per_run(popen_group(starts), [2] * len(runs)), strict=True))
    holds = {strategy: hold_files(base / f"slow-{strategy}") for strategy in runs}
    seen: dict[str, dict[str, object]] = {strategy: {} for strategy in runs}

    def act() -> bool:
        """Take each run one moment further (held: note what is on disk; past step 4: note, kill rank 1). What is
        noted is named as :class:`KilledRun`'s fields; ``done``: nothing more to wait for in that run."""
        for strategy, run in runs.items():
            ranks, now, ckpts = procs[strategy], seen[strategy], run / "checkpoints"
            if "done" in now:
                continue
            if "alive_when_held" not in now:
                if holds[strategy].writing_shard(1) or any(p.poll() is not None for p in ranks):
                    now.update(alive_when_held=all(p.poll() is None for p in ranks),
                               complete_when_held=[s for s, _ in ckpt.list_checkpoints(ckpts)],
                               dcp_when_held=(ckpts / "ckpt-000000004.dcp").is_dir())
                    if not now["alive_when_held"]:
                        now["done"] = True  # nothing to wait for: the test says what happened
                continue
            # Asynchronous: both ranks train on while rank 1's write of step 4 is held (step 6's checkpoint waits).
            if max(_segments(run)[0], default=0) >= 2 * EVERY + 1:
                now["pt_in_flight"] = ckpt.checkpoint_path(ckpts, 2 * EVERY).exists()
                ranks[1].kill()  # SIGKILL
                now["done"] = True
        return all("done" in now for now in seen.values())

    try:
        wait_for(act, TIMEOUT_S, "rank 1's shard write of step 4 held in every run, training past it, the kill")
        killed = dict(zip(runs, per_run(finish([p for ranks in procs.values() for p in ranks]),
                                        [2] * len(runs)), strict=True))
    finally:
        for ranks in procs.values():
            for p in ranks:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    after: dict[str, dict[str, Any]] = {}
    for strategy, run in runs.items():
        state, path = ckpt.load_latest(run / "checkpoints")
        after[strategy] = {"left": sorted(p.name for p in (run / "checkpoints").iterdir()),
                           "complete_left": [s for s, _ in ckpt.list_checkpoints(run / "checkpoints")],
                           "latest": (state["step"], state["model"], path)}
    resumed = per_run(finish(start_runs([(run, 2) for run in runs.values()])), [2] * len(runs))  # no hold
    done = {}
    for (strategy, run), result in zip(runs.items(), resumed, strict=True):
        moments = {"pt_in_flight": False, **{k: v for k, v in seen[strategy].items() if k != "done"}}
        done[strategy] = KilledRun(run=run, **moments, killed=killed[strategy], **after[strategy], resumed=result)
    return done


@pytest.mark.parametrize("strategy", SHARDED)
def test_a_rank_killed_during_its_background_shard_write_leaves_no_good_checkpoint(
        killed_runs: dict[str, KilledRun], strategy: str) -> None:
    """FSDP's shards (``checkpoint.sharded``) or a pipeline's stages (2 stages, one per rank), 2 gloo ranks,
    checkpoints every 2 steps written in the background on both. Rank 1's write of step 4 is held (the fsync
    of its DCP file), so its ``.pt`` is never written; training goes on to step 5 meanwhile; rank 1 is
    SIGKILLed there. Rank 0 fails, step 2 (whose ``.pt`` was written when step 4's checkpoint started) is the
    newest good checkpoint, and the same run directory resumes from it onto the first segment's losses; the
    orphaned DCP directory is pruned (the runs: :func:`killed_runs`)."""
    every, total = EVERY, TOTAL
    done = killed_runs[strategy]
    run, ckpts = done.run, done.run / "checkpoints"
    (code0, out0, err0), (code1, _, _) = done.killed
    assert done.alive_when_held, (code0, out0[-2000:], err0[-3000:])
    assert done.complete_when_held == [every], "step 2's .pt came before step 4's shards"
    assert done.dcp_when_held
    assert not done.pt_in_flight, "no .pt while a rank's shards are in flight"
    print(f"rank 1 SIGKILLed during its shard write of step 4: rank 0 exit {code0}; "
          f"checkpoints left: {done.left}")
    assert code1 == -9 and code0 != 0, (code0, out0[-2000:], err0[-3000:])
    assert done.complete_left == [every]
    step, model, path = done.latest
    assert step == every and model == {"dcp": "ckpt-000000002.dcp"}, path

    results = all_ok(done.resumed)  # the same run directory, no hold
    assert f"resumed from {ckpt.checkpoint_path(ckpts, every)} at step {every}" in results[0][1], results[0][1]
    first, second = _segments(run)
    assert sorted(second) == list(range(every + 1, total + 1)), "every step after the checkpoint, once"
    redone = sorted(set(first) & set(second))
    assert redone and [second[s] for s in redone] == pytest.approx([first[s] for s in redone], rel=1e-5, abs=1e-6)
    end = records(run, "end")[-1]
    assert end["status"] == "completed" and end["checkpoints_async"] == 3, end  # steps 4, 6 and the final 8
    assert sorted(p.name for p in ckpts.iterdir() if p.suffix == ".dcp") == [
        "ckpt-000000004.dcp", "ckpt-000000006.dcp", "ckpt-000000008.dcp"], "each shard folder has its .pt"
    assert [s for s, _ in ckpt.list_checkpoints(ckpts)] == [8, 6, 4]
