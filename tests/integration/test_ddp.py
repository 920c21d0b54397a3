"""The training engine with real processes and real gloo process groups (CPU, 1 thread per rank).

Each rank is a ``python -m cyclone_kit.runtime`` subprocess given torchrun-style variables
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so the real bootstrap, process group,
DDP, metrics and checkpoint code run; every process has a timeout so nothing can hang.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from cyclone_kit.rundir import contract, failures
from cyclone_kit.runtime import checkpoint as ck
from cyclone_kit.runtime.engine.data import DEBIAN_FASHION_MNIST
from tests.helpers.ranks import (
    TIMEOUT_S,
    all_ok,
    final_params,
    finish,
    per_run,
    popen_group,
    rank_envs,
    records,
    start_runs,
    write_spec,
)
from tests.helpers.slow_parts import hold_files, slow_parts_env
from tests.helpers.slurm_jobs import wait_for

#: A process-group timeout no test waits for: a rank that exits within its hang guard after its peer died
#: noticed the death itself, it did not sit out the gloo timeout.
PG_TIMEOUT_NEVER_S = 3600
#: Hang guard for the module's runs (module_runs: 9 ranks at once on 2 cores): they are paid for by
#: the first test that uses them, so they get their own, longer guard.
RUNS_HANG_S = 600
#: pytest-timeout of every test here: the first one also pays for the module's runs; the first signalled one
#: for both signalled runs and their resumes (signalled_runs), each step under its own guard.
SLOW_TEST_TIMEOUT_S = 900

pytestmark = [pytest.mark.slow, pytest.mark.timeout(SLOW_TEST_TIMEOUT_S)]


















# ------------------------------------------------------------------------ DDP correctness + metrics
#: Whether Debian's Fashion-MNIST is here: its short run then joins the module's runs.
HAVE_FASHION_MNIST = (DEBIAN_FASHION_MNIST / "train-images-idx3-ubyte.gz").is_file()


@dataclasses.dataclass
class ModuleRuns:
    dirs: dict[str, Path]  #: run directory by run name
    results: dict[str, list[tuple[int, str, str]]]  #: the ranks' (exit code, stdout, stderr) by run name
    killed_started: bool  #: whether the "killed" run logged a step before its rank 1 was killed


@pytest.fixture(scope="module")
def module_runs(tmp_path_factory: pytest.TempPathFactory) -> ModuleRuns:
    """Every run of this module that needs no signal, all their ranks forked from one process (issue 27: one
    import of torch instead of four); each run has its own spec, run directory and rendezvous, so none sees
    another. The runs, by name:

    * "one", "two", "accum": jobs/smoke.toml with 1 rank x batch 64, 2 ranks x batch 32, and 2 ranks x
      batch 16 x 2 accumulated micro-batches: the same global batch of 64;
    * "killed": 2 ranks training for ever, rank 1 SIGKILLed by this fixture once a step was logged
      (``killed_started``: whether one was, before the hang guard), rank 0 left to exit by itself;
    * "bad-data": 1 rank on a CIFAR-10 directory that does not exist;
    * "fmnist" (when the data set is installed): 1 rank, 300 steps of Fashion-MNIST.
    """
    base = tmp_path_factory.mktemp("pair")
    dirs = {name: base / name for name in ("one", "two", "accum", "killed", "bad-data", "fmnist")}
    # 640 samples: 10 optimizer steps per epoch in both runs, so 30 steps cross 2 epoch boundaries.
    write_spec(dirs["one"], batch_size=64, log_every=1, synthetic_samples=640)
    write_spec(dirs["two"], batch_size=32, log_every=1, synthetic_samples=640)
    write_spec(dirs["accum"], batch_size=16, grad_accum=2, log_every=1, synthetic_samples=640)
    # "Promptly" as an event, not a bound: rank 0 must exit by itself (within the hang guard) although
    # its process-group timeout is far longer than the guard, so it noticed the dead peer.
    write_spec(dirs["killed"], steps=100000, log_every=1, pg_timeout_s=PG_TIMEOUT_NEVER_S)
    write_spec(dirs["bad-data"], dataset="cifar10", data_dir=str(base / "no-such-dir"))
    write_spec(dirs["fmnist"], dataset="fashion_mnist", data_dir=str(DEBIAN_FASHION_MNIST), steps=300, batch_size=64,
               lr=0.3, base_batch_size=64, warmup_steps=20, log_every=50, val_samples=2000)
    worlds = {"two": 2, "one": 1, "accum": 2, "killed": 2, "bad-data": 1, **({"fmnist": 1} if HAVE_FASHION_MNIST else {})}
    procs = start_runs([(dirs[name], world) for name, world in worlds.items()])
    killed = per_run(procs, list(worlds.values()))[list(worlds).index("killed")]
    metrics = dirs["killed"] / "metrics.jsonl"
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline and not (metrics.is_file() and '"kind":"step"' in metrics.read_text()):
        time.sleep(0.05)
    started = metrics.is_file() and '"kind":"step"' in metrics.read_text()
    killed[1].kill()  # whether or not it started: the test says which; rank 0 is then killed only on the hang guard
    results = per_run(finish(procs, timeout=RUNS_HANG_S), list(worlds.values()))
    return ModuleRuns(dirs, dict(zip(worlds, results, strict=True)), started)


@pytest.fixture(scope="module")
def pair_runs(module_runs: ModuleRuns) -> dict[str, Path]:
    """jobs/smoke.toml with 1 rank x batch 64, 2 ranks x batch 32, and 2 ranks x batch 16 x 2
    accumulated micro-batches: the same global batch of 64 (run concurrently), each rank exited 0."""
    for name in ("one", "two", "accum"):
        all_ok(module_runs.results[name])
    return {name: module_runs.dirs[name] for name in ("one", "two", "accum")}


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


@dataclasses.dataclass
class Signalled:
    run: Path  #: its run directory
    first: list[dict[str, Any]]  #: its records when the signalled segment had ended
    stopped: list[tuple[int, str, str]]  #: the signalled segment's ranks' (exit code, stdout, stderr)
    resumed: list[tuple[int, str, str]]  #: the same of the resumed segment


@pytest.fixture(scope="module")
def signalled_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Signalled]:
    """The module's two signalled runs, "one" (1 rank x batch 64) and "fsdp" (2 ranks x batch 32 with FSDP2),
    both held after step 12 and sent the requeue signal there (to rank 1 alone for "fsdp"), then resumed.
    The two signalled segments' 3 ranks are forked from one process, and so are the two resumes' (issue 27: two
    imports of torch, not three): slow_parts' sitecustomize runs once, in the process they are forked from, with
    the "one" run's environment, and each rank holds in the folder its own environment names
    (``CK_SLOW_PARTS_HOLD_DIR``; both hold after step 12, docs/TESTING.md item 29). Each run has its own spec,
    run directory, hold directory and rendezvous, and only its own ranks are signalled, so neither sees the
    other."""
    base = tmp_path_factory.mktemp("signalled")
    one, fsdp = base / "resumed", base / "fsdp"
    write_spec(one, checkpoint=NO_WATCHDOG, batch_size=64, log_every=1, synthetic_samples=640, steps=SIGNALLED_STEPS)
    # Agree after every step: the stop is then acted on a step or two after the signal, whatever the speed.
    write_spec(fsdp, checkpoint={"poll_s": 0, **NO_WATCHDOG}, strategy="fsdp", batch_size=32, log_every=1,
               synthetic_samples=640, steps=SIGNALLED_STEPS)
    # Signal in the second epoch (held after step 12), so the resume starts mid-epoch after an epoch boundary.
    holds_one, holds_fsdp = hold_files(base / "hold-one"), hold_files(base / "hold-fsdp")
    target = lambda run: ["-m", "cyclone_kit.runtime", "--run-dir", str(run)]  # noqa: E731
    proc, *procs = popen_group(
        [(target(one), env) for env in rank_envs(1, slow_parts_env(base / "hold-one", hold_step=12))]
        + [(target(fsdp), env) for env in rank_envs(2, slow_parts_env(base / "hold-fsdp", hold_step=12))])
    running = lambda: all(p.poll() is None for p in procs)  # noqa: E731
    try:
        wait_for(lambda: holds_one.at(12, [0]) or proc.poll() is not None, TIMEOUT_S, "the rank held after step 12")
        proc.send_signal(signal.SIGUSR2)  # the requeue signal: checkpoint and stop (no Slurm here)
        wait_for(lambda: holds_one.signalled([0]) or proc.poll() is not None, TIMEOUT_S,
                 "the signal to reach the rank")
        holds_one.go()
        wait_for(lambda: holds_fsdp.at(12, range(2)) or not running(), TIMEOUT_S, "both ranks held after step 12")
        procs[1].send_signal(signal.SIGUSR2)
        wait_for(lambda: holds_fsdp.signalled([1]) or not running(), TIMEOUT_S, "the signal to reach rank 1")
    finally:
        holds_one.go()
        holds_fsdp.go()
    stopped = {"one": finish([proc]), "fsdp": finish(procs)}
    first = {"one": records(one), "fsdp": records(fsdp)}
    resumed = per_run(finish(start_runs([(one, 1), (fsdp, 2)])), [1, 2])  # the same command again resumes
    return {name: Signalled(run, first[name], stopped[name], result)
            for name, run, result in (("one", one, resumed[0]), ("fsdp", fsdp, resumed[1]))}


def test_interrupted_and_resumed_run_follows_the_uninterrupted_trajectory(
        long_reference: Path, signalled_runs: dict[str, Signalled]) -> None:
    reference = {r["step"]: r["loss"] for r in records(long_reference, "step")}
    signalled = signalled_runs["one"]  # held after step 12, signalled there, then resumed (signalled_runs)
    run = signalled.run
    (code, out, err), = signalled.stopped
    assert code == 0, err
    first = signalled.first
    assert first[-1]["kind"] == "end" and first[-1]["status"] == "preempted", "the run finished before the signal"
    stopped_at = first[-1]["steps"]
    print(f"signalled while held after step 12; stopped after step {stopped_at}")
    assert 12 <= stopped_at <= 20, "one rank reads its flag after every step: the stop follows the signal"
    assert "not running under Slurm" in out
    all_ok(signalled.resumed)
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
def test_a_killed_rank_makes_the_other_exit_promptly_with_an_error_record(module_runs: ModuleRuns) -> None:
    run = module_runs.dirs["killed"]  # rank 1 was killed once a step was logged (module_runs)
    assert module_runs.killed_started, "training never started"
    (code0, _, _err0), _ = module_runs.results["killed"]
    print(f"rank 0 exited {code0} after rank 1 was killed")
    assert code0 not in (0, None) and code0 != -signal.SIGKILL, f"rank 0 exited {code0}"
    record = json.loads((run / "ranks" / "error-rank-00000.json").read_text())
    assert record["rank"] == 0 and record["traceback"] and record["type"]
    # The event behind "promptly": rank 0 saw its peer's connection go (not a timeout, not its own fault).
    assert failures.peer_lost(record), (record["type"], record["message"])
    assert records(run)[-1]["status"] == "failed"


def test_a_failing_rank_writes_its_error_record_and_one_line(module_runs: ModuleRuns) -> None:
    run = module_runs.dirs["bad-data"]  # a CIFAR-10 directory that does not exist (module_runs)
    (code, _out, err), = module_runs.results["bad-data"]
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "CIFAR-10 not found" in lines[0] and "HINT:" in lines[0]
    record = json.loads((run / "ranks" / "error-rank-00000.json").read_text())
    assert record["type"] == "ValidationError" and "CIFAR-10 not found" in record["message"]


# ------------------------------------------------------------------------ real data
@pytest.mark.skipif(not HAVE_FASHION_MNIST,
                    reason=f"Debian's dataset-fashion-mnist is not installed ({DEBIAN_FASHION_MNIST})")
def test_fashion_mnist_short_run_reaches_a_sane_accuracy(module_runs: ModuleRuns) -> None:
    run = module_runs.dirs["fmnist"]  # 300 steps x 64 (module_runs)
    all_ok(module_runs.results["fmnist"])
    epochs = records(run, "epoch")
    accuracy = epochs[-1]["val_accuracy"]
    print(f"Fashion-MNIST tiny_cnn 300 steps x 64: val accuracy {accuracy:.3f}")
    assert accuracy > 0.70
    assert records(run, "end")[-1]["status"] == "completed"


# ------------------------------------------------------------------------ FSDP2, signalled on one rank only
def test_fsdp_run_signalled_on_one_rank_resumes_on_the_one_rank_trajectory(
        long_reference: Path, signalled_runs: dict[str, Signalled]) -> None:
    """2 ranks with FSDP2 (batch 32 each) follow 1 rank with batch 64; a requeue signal sent to
    rank 1 alone stops both ranks at the same step (the flag all-reduce), the full-state
    checkpoint resumes exactly."""
    reference = [r["loss"] for r in records(long_reference, "step")]
    signalled = signalled_runs["fsdp"]  # both held after step 12, rank 1 signalled there, then resumed
    run = signalled.run
    for rank, (code, out, err) in enumerate(signalled.stopped):
        assert code == 0, f"rank {rank} exited {code}\n{out}\n{err}"
    first = signalled.first
    assert first[-1]["kind"] == "end" and first[-1]["status"] == "preempted", "the run finished before the signal"
    assert first[0]["strategy"] == "fsdp" and first[0]["world_size"] == 2
    stopped_at = first[-1]["steps"]
    print(f"rank 1 signalled while both were held after step 12; both stopped after step {stopped_at}")
    assert 12 <= stopped_at <= 20, "poll_s 0: the flag all-reduce stops both ranks steps after the signal"
    all_ok(signalled.resumed)
    recs = records(run)
    assert [e["status"] for e in recs if e["kind"] == "end"] == ["preempted", "completed"]
    steps = {r["step"]: r["loss"] for r in recs if r["kind"] == "step"}
    assert sorted(steps) == list(range(1, SIGNALLED_STEPS + 1))
    assert [steps[s] for s in range(1, SIGNALLED_STEPS + 1)] == pytest.approx(reference, rel=2e-3, abs=2e-4)
    p_ref, p_fsdp = final_params(long_reference), final_params(run)
    assert p_ref.keys() == p_fsdp.keys()
    for name in p_ref:
        torch.testing.assert_close(p_fsdp[name], p_ref[name], rtol=1e-2, atol=2e-3, msg=f"parameter {name} differs")
