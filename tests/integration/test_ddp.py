"""The training engine with real processes and real gloo process groups (CPU, 1 thread per rank).

Each rank is a ``python -m cyclone_kit.runtime`` subprocess given torchrun-style variables
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so the real bootstrap, process group,
DDP, metrics and checkpoint code run; every process has a timeout so nothing can hang.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
import torch

from cyclone_kit.rundir import contract, failures
from cyclone_kit.runtime import checkpoint as ck
from cyclone_kit.runtime.engine.data import DEBIAN_FASHION_MNIST
from tests.helpers.ranks import (
    TIMEOUT_S,
    final_params,
    finish,
    records,
    run_ranks,
    start_ranks,
    start_runs,
    write_spec,
)
from tests.helpers.slow_parts import hold_files, slow_parts_env
from tests.helpers.slurm_jobs import wait_for

#: A process-group timeout no test waits for: a rank that exits within TIMEOUT_S after its peer died
#: noticed the death itself, it did not sit out the gloo timeout.
PG_TIMEOUT_NEVER_S = 3600
#: Hang guard for the module's reference runs (5 ranks at once on 2 cores): they are paid for by
#: the first test that uses them, so they get their own, longer guard.
RUNS_HANG_S = 600
#: pytest-timeout of every test here: the first one also pays for a reference run; the signalled
#: ones run a reference, a signalled run and a resume, each under its own guard.
SLOW_TEST_TIMEOUT_S = 900

pytestmark = [pytest.mark.slow, pytest.mark.timeout(SLOW_TEST_TIMEOUT_S)]


















# ------------------------------------------------------------------------ DDP correctness + metrics
@pytest.fixture(scope="module")
def pair_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """jobs/smoke.toml with 1 rank x batch 64, 2 ranks x batch 32, and 2 ranks x batch 16 x 2
    accumulated micro-batches: the same global batch of 64 (run concurrently)."""
    base = tmp_path_factory.mktemp("pair")
    one, two, accum = base / "one-rank", base / "two-ranks", base / "two-ranks-accum"
    # 640 samples: 10 optimizer steps per epoch in both runs, so 30 steps cross 2 epoch boundaries.
    write_spec(one, batch_size=64, log_every=1, synthetic_samples=640)
    write_spec(two, batch_size=32, log_every=1, synthetic_samples=640)
    write_spec(accum, batch_size=16, grad_accum=2, log_every=1, synthetic_samples=640)
    procs = start_runs([(two, 2), (one, 1), (accum, 2)])  # forked from one process (issue 27)
    for rank, (code, out, err) in enumerate(finish(procs, timeout=RUNS_HANG_S)):
        assert code == 0, f"process {rank} exited {code}\n{out}\n{err}"
    return {"one": one, "two": two, "accum": accum}


def test_two_ranks_with_batch_b_match_one_rank_with_batch_2b(pair_runs: dict[str, Path]) -> None:
    # The two runs sum the same gradients in a different order (an all-reduce of two half-batch
    # means versus one full-batch mean), so they differ by float rounding, which 30 SGD steps
    # amplify to ~1e-4. A real DDP bug (gradients summed, not averaged; no all-reduce; a wrong
    # LR scaling or data shard) moves the loss by several percent within a few steps.
    l1 = [r["loss"] for r in records(pair_runs["one"], "step")]
    l2 = [r["loss"] for r in records(pair_runs["two"], "step")]
    assert len(l1) == len(l2) == 30
    assert l2[:5] == pytest.approx(l1[:5], rel=1e-4, abs=1e-5)
    assert l2 == pytest.approx(l1, rel=2e-3, abs=2e-4)
    p1, p2 = final_params(pair_runs["one"]), final_params(pair_runs["two"])
    assert p1.keys() == p2.keys()
    for name in p1:
        torch.testing.assert_close(p2[name], p1[name], rtol=1e-2, atol=2e-3, msg=f"parameter {name} differs")


def test_gradient_accumulation_with_no_sync_matches_the_full_batch(pair_runs: dict[str, Path]) -> None:
    l1 = [r["loss"] for r in records(pair_runs["one"], "step")]
    la = [r["loss"] for r in records(pair_runs["accum"], "step")]
    assert la[:5] == pytest.approx(l1[:5], rel=1e-4, abs=1e-5)
    assert la == pytest.approx(l1, rel=2e-3, abs=2e-4)
    start = records(pair_runs["accum"], "start")[0]
    assert (start["per_device_batch_size"], start["global_batch_size"], start["grad_accum"]) == (16, 64, 2)
    p1, pa = final_params(pair_runs["one"]), final_params(pair_runs["accum"])
    for name in p1:
        torch.testing.assert_close(pa[name], p1[name], rtol=1e-2, atol=2e-3, msg=f"parameter {name} differs")


def test_two_rank_run_writes_the_metrics_contract(pair_runs: dict[str, Path]) -> None:
    run = pair_runs["two"]
    recs = records(run)
    assert all(r["schema"] == contract.SCHEMA for r in recs)
    assert next(r["kind"] for r in recs) == "start" and recs[-1]["kind"] == "end"
    start, end = recs[0], recs[-1]
    assert (start["world_size"], start["num_nodes"], start["local_world_size"]) == (2, 1, 2)
    assert (start["per_device_batch_size"], start["global_batch_size"]) == (32, 64)
    assert (start["model"], start["dataset"], start["precision"], start["device"]) == (
        "tiny_cnn", "synthetic", "fp32", "cpu")
    assert start["launcher"] == "torchrun" and start["slurm_job_id"] is None
    assert set(start["versions"]) == {"torch", "torchvision", "cyclone_kit"} and start["restart_count"] == 0
    assert isinstance(start["hostnames"], list) and start["hostnames"]
    steps = records(run, "step")
    assert [r["step"] for r in steps] == list(range(1, 31))
    losses = [r["loss"] for r in steps]
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, f"loss did not fall: {losses}"
    assert all(r["samples_per_s"] > 0 and r["step_time_s"] > 0 and r["data_time_s"] >= 0 for r in steps)
    assert end["status"] == "completed" and end["steps"] == 30 and end["samples_per_s"] > 0
    assert end["wall_time_s"] > 0
    epochs = records(run, "epoch")
    assert [e["epoch"] for e in epochs] == [0, 1, 2] and all(e["val_accuracy"] is not None for e in epochs)
    assert [r["epoch"] for r in steps] == [0] * 10 + [1] * 10 + [2] * 10
    for rank in (0, 1):
        summary = json.loads((run / "ranks" / f"rank-{rank:05d}.json").read_text())
        assert summary["rank"] == rank and summary["samples_per_s"] > 0 and summary["peak_memory_bytes"] > 0
    assert [s for s, _ in ck.list_checkpoints(run / "checkpoints")] == [30, 20]  # keep = 2


# ------------------------------------------------------------------------ exact resume after a signal
#: Steps of the runs the tests signal (and of their uninterrupted reference): smoke.toml's 30, 3 epochs of
#: 10. The signal lands while every rank is held after optimizer step 12 (:mod:`tests.helpers.slow_parts`),
#: so mid-run at any speed; the stop comes at 12-20 (asserted), so the resumed segment starts in the second
#: epoch and crosses the epoch boundary at 20. FSDP follows the one-rank run to ~2e-5 over these steps.
SIGNALLED_STEPS = 30
#: The progress watchdog off in the runs held after a step until a signal reached them: armed, it bounded the hold
#: (36 s at smoke.toml's pg_timeout_s), a margin a 5x slower machine could eat (docs/TESTING.md item 9).
NO_WATCHDOG = {"stall_floor_s": 0}


@pytest.fixture(scope="module")
def long_reference(pair_runs: dict[str, Path]) -> Path:
    """One rank x batch 64 for SIGNALLED_STEPS steps, never interrupted: the trajectory to follow. It is
    pair_runs' one-rank run (the same spec), so no rank process is started for it."""
    run = pair_runs["one"]
    spec = json.loads((run / "spec.json").read_text())["train"]
    assert (spec["batch_size"], spec["synthetic_samples"], spec["steps"]) == (64, 640, SIGNALLED_STEPS), spec
    assert [e["status"] for e in records(run, "end")] == ["completed"]
    return run


def test_interrupted_and_resumed_run_follows_the_uninterrupted_trajectory(
        long_reference: Path, tmp_path: Path) -> None:
    reference = {r["step"]: r["loss"] for r in records(long_reference, "step")}
    run = tmp_path / "resumed"
    write_spec(run, checkpoint=NO_WATCHDOG, batch_size=64, log_every=1, synthetic_samples=640, steps=SIGNALLED_STEPS)
    # Signal in the second epoch (held after step 12), so the resume starts mid-epoch after an epoch boundary.
    holds = hold_files(tmp_path / "hold")
    (proc,) = start_ranks(run, 1, env=slow_parts_env(tmp_path / "hold", hold_step=12))
    try:
        wait_for(lambda: holds.at(12, [0]) or proc.poll() is not None, TIMEOUT_S, "the rank held after step 12")
        proc.send_signal(signal.SIGUSR2)  # the requeue signal: checkpoint and stop (no Slurm here)
        wait_for(lambda: holds.signalled([0]) or proc.poll() is not None, TIMEOUT_S, "the signal to reach the rank")
    finally:
        holds.go()
    (code, out, err), = finish([proc])
    assert code == 0, err
    first = records(run)
    assert first[-1]["kind"] == "end" and first[-1]["status"] == "preempted", "the run finished before the signal"
    stopped_at = first[-1]["steps"]
    print(f"signalled while held after step 12; stopped after step {stopped_at}")
    assert 12 <= stopped_at <= 20, "one rank reads its flag after every step: the stop follows the signal"
    assert "not running under Slurm" in out
    run_ranks(run, 1)  # the same command again resumes
    recs = records(run)
    starts = [r for r in recs if r["kind"] == "start"]
    ends = [r for r in recs if r["kind"] == "end"]
    assert len(starts) == 2 and [e["status"] for e in ends] == ["preempted", "completed"]
    assert starts[1]["start_step"] == stopped_at
    steps = [r["step"] for r in recs if r["kind"] == "step"]
    assert sorted(steps) == list(range(1, SIGNALLED_STEPS + 1)), "every optimizer step exactly once"
    resumed = {r["step"]: r["loss"] for r in recs if r["kind"] == "step"}
    assert resumed == pytest.approx(reference, rel=1e-6, abs=1e-7)
    p_ref, p_res = final_params(long_reference), final_params(run)
    for name in p_ref:
        torch.testing.assert_close(p_res[name], p_ref[name], rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------------ failures never hang
def test_a_killed_rank_makes_the_other_exit_promptly_with_an_error_record(tmp_path: Path) -> None:
    run = tmp_path / "killed"
    # "Promptly" as an event, not a bound: rank 0 must exit by itself (within the hang guard) although
    # its process-group timeout is far longer than the guard, so it noticed the dead peer.
    write_spec(run, steps=100000, log_every=1, pg_timeout_s=PG_TIMEOUT_NEVER_S)
    procs = start_ranks(run, 2)
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline and not (metrics.is_file() and '"kind":"step"' in metrics.read_text()):
        time.sleep(0.05)
    assert metrics.is_file() and '"kind":"step"' in metrics.read_text(), "training never started"
    procs[1].kill()
    killed_at = time.monotonic()
    results = finish(procs[:1], timeout=TIMEOUT_S)  # killed by the test only on the hang guard
    finish(procs[1:])
    (code0, _, _err0), = results
    took = time.monotonic() - killed_at
    print(f"rank 0 exited {code0} {took:.1f} s after rank 1 was killed")
    assert code0 not in (0, None) and code0 != -signal.SIGKILL, f"rank 0 exited {code0} after {took:.1f} s"
    record = json.loads((run / "ranks" / "error-rank-00000.json").read_text())
    assert record["rank"] == 0 and record["traceback"] and record["type"]
    # The event behind "promptly": rank 0 saw its peer's connection go (not a timeout, not its own fault).
    assert failures.peer_lost(record), (record["type"], record["message"])
    assert records(run)[-1]["status"] == "failed"


def test_a_failing_rank_writes_its_error_record_and_one_line(tmp_path: Path) -> None:
    run = tmp_path / "bad-data"
    write_spec(run, dataset="cifar10", data_dir=str(tmp_path / "no-such-dir"))
    (code, _out, err), = finish(start_ranks(run, 1))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "CIFAR-10 not found" in lines[0] and "HINT:" in lines[0]
    record = json.loads((run / "ranks" / "error-rank-00000.json").read_text())
    assert record["type"] == "ValidationError" and "CIFAR-10 not found" in record["message"]


# ------------------------------------------------------------------------ real data
@pytest.mark.skipif(not (DEBIAN_FASHION_MNIST / "train-images-idx3-ubyte.gz").is_file(),
                    reason=f"Debian's dataset-fashion-mnist is not installed ({DEBIAN_FASHION_MNIST})")
def test_fashion_mnist_short_run_reaches_a_sane_accuracy(tmp_path: Path) -> None:
    run = tmp_path / "fmnist"
    write_spec(run, dataset="fashion_mnist", data_dir=str(DEBIAN_FASHION_MNIST), steps=300, batch_size=64,
               lr=0.3, base_batch_size=64, warmup_steps=20, log_every=50, val_samples=2000)
    started = time.monotonic()
    run_ranks(run, 1)
    took = time.monotonic() - started
    epochs = records(run, "epoch")
    accuracy = epochs[-1]["val_accuracy"]
    print(f"Fashion-MNIST tiny_cnn 300 steps x 64: val accuracy {accuracy:.3f} in {took:.1f} s (process)")
    assert accuracy > 0.70
    assert records(run, "end")[-1]["status"] == "completed"


# ------------------------------------------------------------------------ FSDP2, signalled on one rank only
def test_fsdp_run_signalled_on_one_rank_resumes_on_the_one_rank_trajectory(
        long_reference: Path, tmp_path: Path) -> None:
    """2 ranks with FSDP2 (batch 32 each) follow 1 rank with batch 64; a requeue signal sent to
    rank 1 alone stops both ranks at the same step (the flag all-reduce), the full-state
    checkpoint resumes exactly."""
    reference = [r["loss"] for r in records(long_reference, "step")]
    run = tmp_path / "fsdp"
    # Agree after every step: the stop is then acted on a step or two after the signal, whatever the speed.
    write_spec(run, checkpoint={"poll_s": 0, **NO_WATCHDOG}, strategy="fsdp", batch_size=32, log_every=1,
               synthetic_samples=640, steps=SIGNALLED_STEPS)
    holds = hold_files(tmp_path / "hold")
    procs = start_ranks(run, 2, env=slow_parts_env(tmp_path / "hold", hold_step=12))
    running = lambda: all(p.poll() is None for p in procs)  # noqa: E731
    try:
        wait_for(lambda: holds.at(12, range(2)) or not running(), TIMEOUT_S, "both ranks held after step 12")
        procs[1].send_signal(signal.SIGUSR2)
        wait_for(lambda: holds.signalled([1]) or not running(), TIMEOUT_S, "the signal to reach rank 1")
    finally:
        holds.go()
    for rank, (code, out, err) in enumerate(finish(procs)):
        assert code == 0, f"rank {rank} exited {code}\n{out}\n{err}"
    first = records(run)
    assert first[-1]["kind"] == "end" and first[-1]["status"] == "preempted", "the run finished before the signal"
    assert first[0]["strategy"] == "fsdp" and first[0]["world_size"] == 2
    stopped_at = first[-1]["steps"]
    print(f"rank 1 signalled while both were held after step 12; both stopped after step {stopped_at}")
    assert 12 <= stopped_at <= 20, "poll_s 0: the flag all-reduce stops both ranks steps after the signal"
    run_ranks(run, 2)
    recs = records(run)
    assert [e["status"] for e in recs if e["kind"] == "end"] == ["preempted", "completed"]
    steps = {r["step"]: r["loss"] for r in recs if r["kind"] == "step"}
    assert sorted(steps) == list(range(1, SIGNALLED_STEPS + 1))
    assert [steps[s] for s in range(1, SIGNALLED_STEPS + 1)] == pytest.approx(reference, rel=2e-3, abs=2e-4)
    p_ref, p_fsdp = final_params(long_reference), final_params(run)
    assert p_ref.keys() == p_fsdp.keys()
    for name in p_ref:
        torch.testing.assert_close(p_fsdp[name], p_ref[name], rtol=1e-2, atol=2e-3, msg=f"parameter {name} differs")
