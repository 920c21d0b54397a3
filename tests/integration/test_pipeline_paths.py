"""Pipeline paths of issue 28 on 2 CPU ranks (gloo, 1 thread each): 2 stages of the tiny CNN, 1 replica.

The ranks are real processes of the runtime, started through tests/helpers/pipeline_rank.py, which
first makes a condition the CPU cannot make by itself (channels_last batches, a counted stage clock,
a shard write slower than the stall bound); every wait has a timeout and no verdict reads a clock:

* bug 3: channels_last on with ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (torch then checks every stage
  input's strides against the declared buffer): training and validation run;
* bug 4: the validation forwards (``schedule.eval``) are not collected by the stage clock as training
  compute: every log window holds exactly the training step's forward and backward chunks (in bug 3's
  run: one run, both conditions);
* bug 5: a shard write slower than the progress watchdog's bound is no stall: the run completes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from cyclone_kit.runtime import torchcompat
from tests.helpers.pipeline_rank import PATCHES_VAR
from tests.helpers.ranks import REPO, all_ok, finish, popen_group, popen_ranks, rank_envs, records, write_spec

#: Hang guard of a 2-rank run (not a performance bound): 2 ranks on 2 busy cores, imports included.
HANG_S = 300
DRIVER = REPO / "tests" / "helpers" / "pipeline_rank.py"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2 * HANG_S)]

#: 2 stages x 1 replica, GPipe over 2 micro-batches of 4; 32 samples = 4 steps an epoch.
MICROBATCHES = 2
PIPE = dict(strategy="pipeline", model="tiny_cnn", pipeline_stages=2, pipeline_schedule="gpipe",
            microbatches=MICROBATCHES, batch_size=8, synthetic_samples=32, warmup_steps=0, log_every=1)


def _start(run: Path, world: int, patches: str, **extra_env: str) -> list[Any]:
    """The driver's ranks, forked as the local launcher forks the trainer's (the patches apply at run time)."""
    return popen_ranks([str(DRIVER), "--run-dir", str(run)], rank_envs(world, {PATCHES_VAR: patches, **extra_env}))


def _run(run: Path, patches: str, **extra_env: str) -> list[tuple[int, str, str]]:
    return all_ok(finish(_start(run, 2, patches, **extra_env), timeout=HANG_S))


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _validated(run: Path, results: list[tuple[int, str, str]], epochs: int) -> None:
    """Every epoch has a val_accuracy; under a torch without ``schedule.eval`` (< 2.9) none has, and rank 0
    said why in one line (torchcompat's)."""
    from torch.distributed.pipelining.schedules import _PipelineSchedule

    validates = torchcompat.has_schedule_eval(_PipelineSchedule)
    assert [e["val_accuracy"] is not None for e in records(run, "epoch")] == [validates] * epochs
    if not validates:
        assert torchcompat.schedule_eval_line(torch.__version__) in results[0][2], results[0][2][-2000:]


@pytest.fixture(scope="module")
def nhwc_clock(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[tuple[int, str, str]]]:
    """One run for bugs 3 and 4 (issue 27: one 2-rank run, not two): channels_last batches under
    ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` with the stage clock counted. Neither condition touches what the other
    test reads: DETAIL checks the stage inputs' metadata and the process group's collectives, not what the
    stages compute, and the clock's count wraps ``Clock.add``/``read``, not a tensor. 9 steps, 4 an epoch:
    validation after steps 4 and 8 and at the end, windows 5 and 9 follow one; 12 validation samples in
    batches of 8: a padded last batch in every validation pass. The run directory and every rank's result."""
    run = tmp_path_factory.mktemp("pipeline") / "nhwc-clock"
    write_spec(run, steps=9, val_samples=12, channels_last=True, **PIPE)
    return run, _run(run, "channels_last,clock", TORCH_DISTRIBUTED_DEBUG="DETAIL")


def test_channels_last_batches_pass_torchs_stride_checks_under_debug_detail(
        nhwc_clock: tuple[Path, list[tuple[int, str, str]]]) -> None:
    """Bug 3: stage 0 declared a contiguous input but was fed NHWC batches; under DETAIL torch checks
    the strides of every stage input (PipeliningMetadataError: stride mismatch). Training and the
    validation passes (a padded last batch) run, and the stages' first input is NHWC."""
    run, results = nhwc_clock
    steps = records(run, "step")
    assert [r["step"] for r in steps] == list(range(1, 10))
    assert all(r["loss"] == r["loss"] for r in steps)  # not NaN
    _validated(run, results, 3)
    assert records(run, "end")[-1]["status"] == "completed"


def test_validation_forwards_are_not_counted_as_stage_compute(
        nhwc_clock: tuple[Path, list[tuple[int, str, str]]]) -> None:
    """Bug 4: the stage clock collected the forwards of ``schedule.eval``, so the window after each
    validation had inflated compute and no idle time. Counted per log window (one step each), every
    rank's clock holds exactly one schedule step and its M forward + M backward chunks."""
    run, results = nhwc_clock
    _validated(run, results, 3)  # validation after steps 4 and 8 (and at the end): windows 5 and 9 follow one
    for rank in range(2):
        windows = _jsonl(run / f"clock-rank-{rank}.jsonl")
        assert windows[0] == {"computations": 0, "steps": 0}  # the read at the loop's start
        assert windows[1:] == [{"computations": 2 * MICROBATCHES, "steps": 1}] * 9, f"rank {rank}: {windows}"


#: The spec of the blow-up run (:func:`test_pipeline_weights_that_stopped_being_finite_stop_the_run`).
BLOW_UP = dict(steps=8, val_samples=0, checkpoint={"every_steps": 4, "resume": False},
               **{**PIPE, "lr": 1e30, "lr_scaling": "none", "log_every": 2})


@pytest.fixture(scope="module")
def unpatched_group(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[tuple[int, str, str]]]]:
    """Bug 5's two runs (``checkpoint.async_write`` true and false) and the blow-up run, their 6 ranks forked from
    one process (issue 27: one import of torch, not three; :func:`tests.helpers.ranks.popen_group`). They may
    share it: the same environment at import (no ``TORCH_DISTRIBUTED_DEBUG``), each rank applies its own patches
    after the fork (``slow_save``, or none for the blow-up run), and each run has its own run directory and
    rendezvous; the other runs' ranks only make a run's steps slower, not its verdict (bug 5's ranks sleep on
    their own watchdog's bound; the blow-up run's weights blow up at the same step at any speed). The run
    directory and every rank's result, by run name ("background", "blocking", "blow-up")."""
    base = tmp_path_factory.mktemp("pipeline-group")
    runs = {"background": base / "background", "blocking": base / "blocking", "blow-up": base / "blow-up"}
    for name in ("background", "blocking"):
        write_spec(runs[name], steps=6, checkpoint={"every_steps": 5, "stall_floor_s": 3.0,
                                                    "async_write": name == "background"}, **PIPE)
    write_spec(runs["blow-up"], **BLOW_UP)
    patches = {"background": "slow_save", "blocking": "slow_save", "blow-up": ""}
    starts = [([str(DRIVER), "--run-dir", str(run)], env)
              for name, run in runs.items() for env in rank_envs(2, {PATCHES_VAR: patches[name]})]
    results = finish(popen_group(starts), timeout=HANG_S)
    return {name: (run, results[2 * i:2 * i + 2]) for i, (name, run) in enumerate(runs.items())}


@pytest.fixture(scope="module")
def slow_saves(unpatched_group: dict[str, tuple[Path, list[tuple[int, str, str]]]]) -> dict[bool, Path]:
    """Bug 5's two runs (:func:`unpatched_group`), each rank exited 0. The run directory of each."""
    runs = {}
    for async_write, name in ((True, "background"), (False, "blocking")):
        run, results = unpatched_group[name]
        all_ok(results)
        runs[async_write] = run
    return runs


@pytest.mark.parametrize("async_write", [True, False], ids=["background", "blocking"])
def test_a_shard_write_slower_than_the_stall_bound_is_no_stall(slow_saves: dict[bool, Path], async_write: bool) -> None:
    """Bug 5: only rank 0's ``.pt`` write was excluded from the progress watchdog; a DCP shard write
    longer than the bound was taken for a stall (exit 124, failure.json). Here every rank's first
    shard write (step 5) takes twice its armed bound more: blocking, the step-5 checkpoint itself waits;
    in the background (the default), the step-6 checkpoint waits for it. The run completes, both
    checkpoints written."""
    run = slow_saves[async_write]
    for rank in range(2):
        slow = json.loads((run / f"slow-save-rank-{rank}.json").read_text())
        assert slow["bound_s"] is not None and slow["slept_s"] > slow["bound_s"]  # armed, and slept past it
    assert not (run / "failure.json").exists()
    assert records(run, "end")[-1]["status"] == "completed"
    assert [r["step"] for r in records(run, "step")] == list(range(1, 7))
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert {"ckpt-000000005.pt", "ckpt-000000006.pt", "ckpt-000000005.dcp", "ckpt-000000006.dcp"} <= set(names)


def test_pipeline_weights_that_stopped_being_finite_stop_the_run(
        unpatched_group: dict[str, tuple[Path, list[tuple[int, str, str]]]]) -> None:
    """Issue 28, bug 1's guard in the pipeline too: an LR of 1e30 blows the stages' weights up within a
    few steps; every rank stops at the same log step with the engine's one-line error (exit 1), and no
    checkpoint of the NaN weights is written (the run: :func:`unpatched_group`, :data:`BLOW_UP`)."""
    run, results = unpatched_group["blow-up"]
    assert [code for code, _, _ in results] == [1, 1], [err[-2000:] for _, _, err in results]
    for _, _, err in results:
        [line] = [x for x in err.splitlines() if x.startswith("error:")]
        assert "parameter tensor(s) of the model hold NaN or inf after step" in line and "HINT:" in line, line
    steps = records(run, "step")
    assert steps and steps[-1]["step"] < 8 and records(run, "end")[-1]["status"] == "failed"
    assert not list((run / "checkpoints").glob("*.pt")), "the NaN weights were not written"
