"""The public API (``import cyclone_kit as ck``) in real processes: examples/ddp_ck.py and small scripts.

* no launcher at all: world 1, a gloo group of one (DDP works unchanged), a run directory of its own;
* 2 ranks under the local launcher (the srun-like environment): start/step/end records that
  ``cyclone-kit report`` reads;
* the requeue signal to the launcher (passed on to the ranks as srun does): every rank stops
  after the same step, the checkpoint holds that step, the run ends "preempted"; run again, it
  resumes and completes with every step exactly once and the very losses of an uninterrupted run;
* a call out of order: one line naming the fix, exit 2, no traceback; an exception in the
  script: a ``failed`` end record and the rank's error record;
* checkpoints: kept and rotated as ``checkpoint.keep`` says; a torn file is skipped.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from cyclone_kit.backends.local_env import clean_environment
from cyclone_kit.runtime import checkpoint as ckpt
from tests.helpers.cli import REPO, run_cli
from tests.helpers.phases import assert_phases_add_up
from tests.helpers.ranks import records
from tests.helpers.slow_parts import hold_files, slow_parts_env
from tests.helpers.slurm_jobs import wait_for

pytestmark = pytest.mark.slow

DDP_CK = str(REPO / "examples" / "ddp_ck.py")
TIMEOUT_S = 240






def plain_env(**extra: str) -> dict[str, str]:
    """This environment without any launcher's variables, CPU only."""
    return {**clean_environment(os.environ), "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": "", **extra}


def make_run_dir(path: Path, spec: dict[str, Any]) -> Path:
    path.mkdir(parents=True)
    (path / "spec.json").write_text(json.dumps(spec))
    return path


def launcher(run_dir: Path, nproc: int, *script_args: str,
             env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """The local launcher (cyclone_kit.backends.srun_emulator.launch) running ddp_ck.py on ``nproc`` ranks
    (``env``: more variables for the launcher and its ranks)."""
    code = textwrap.dedent(f"""
        import sys
        from cyclone_kit.backends.srun_emulator import launch
        result = launch({str(run_dir)!r}, {nproc}, threads=1, timeout_s={TIMEOUT_S},
                        command=[sys.executable, {DDP_CK!r}, *{list(script_args)!r}])
        sys.exit(0 if result.ok else 1)
    """)
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=plain_env(**(env or {})),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen[str], run_dir: Path) -> None:
    out, err = proc.communicate(timeout=TIMEOUT_S)
    logs = "".join(p.read_text()[-2000:] for p in sorted((run_dir / "logs").glob("rank-*.err")))
    assert proc.returncode == 0, (out, err, logs)


def run_script(tmp_path: Path, body: str, *, run_dir: Path | None = None) -> subprocess.CompletedProcess[str]:
    """A small script using ck, run as one process without a launcher."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    env = plain_env(**({"CYCLONE_RUN_DIR": str(run_dir)} if run_dir else {}))
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


# --------------------------------------------------------------------------- no launcher, and 2 ranks
def test_ddp_ck_without_any_launcher_runs_as_world_one(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, DDP_CK, "--steps", "12", "--batch-size", "16"], cwd=tmp_path,
                            env=plain_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert run_dir.name.startswith("ddp_ck-")
    start, *steps, end = records(run_dir)
    assert start["kind"] == "start" and start["world_size"] == 1 and start["launcher"] == "single"
    assert (start["per_device_batch_size"], start["global_batch_size"]) == (16, 16)
    assert [s["step"] for s in steps] == [10, 12]  # log_every 10, and the last partial window
    assert all(s["samples_per_s"] > 0 and math.isfinite(s["loss"]) for s in steps)
    assert (end["kind"], end["status"], end["steps"]) == ("end", "completed", 12)
    assert json.loads((run_dir / "ranks" / "rank-00000.json").read_text())["device"] == "cpu"
    assert "completed at step 12" in result.stdout
    # ck.instrument(model=, optimizer=) in a world of one: no gradient communication; no loader: data not timed.
    assert (start["phase_timing"], start["comm_timing"]) == ("host-clock", "none")
    assert all(s["data_time_s"] is None for s in steps)
    assert_phases_add_up([{**s, "data_time_s": 0.0} for s in steps], communication=False)


#: The spec and ddp_ck.py arguments of the requeue test's runs; its uninterrupted reference (2 ranks under the
#: local launcher) is also the run whose records ``cyclone-kit report`` reads: one run, two tests.
REQUEUE_TOTAL = 30  # the stop comes at step 5-10 (asserted): the resumed segment runs 20-25 steps
#: ``stall_floor_s = 0``: the progress watchdog off. The requeue test holds both ranks after step 5 for as long as
#: the signal takes to reach them; with the watchdog armed that hold had to end within its bound (36 s here), a
#: margin a 5x slower machine could eat (docs/TESTING.md item 9). Stalls have tests of their own (test_stall).
REQUEUE_SPEC = {"train": {"log_every": 1}, "checkpoint": {"poll_s": 0, "keep": 2, "stall_floor_s": 0}}
REQUEUE_ARGS = ("--steps", str(REQUEUE_TOTAL), "--batch-size", "16")


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ddp_ck.py on 2 ranks under the local launcher, never signalled: the contract ``report`` reads, and
    the uninterrupted trajectory the requeued run must follow."""
    run_dir = make_run_dir(tmp_path_factory.mktemp("api") / "reference", REQUEUE_SPEC)
    finish(launcher(run_dir, 2, *REQUEUE_ARGS), run_dir)
    return run_dir


def test_two_ranks_write_the_contract_that_report_reads(two_rank_run: Path, tmp_path: Path) -> None:
    run_dir = two_rank_run
    start = records(run_dir, "start")[0]
    assert (start["world_size"], start["per_device_batch_size"], start["global_batch_size"]) == (2, 16, 32)
    assert start["launcher"] == "local" and start["strategy"] == "script" and start["model"] == "ddp_ck"
    assert [s["step"] for s in records(run_dir, "step")] == list(range(1, REQUEUE_TOTAL + 1))  # log_every 1
    # ck.instrument's comm hook on ddp_ck.py's DDP model: every bucket's all-reduce timed.
    assert (start["phase_timing"], start["comm_timing"]) == ("host-clock", "ddp-comm-hook")
    assert_phases_add_up([{**s, "data_time_s": 0.0} for s in records(run_dir, "step")], communication=True)
    (end,) = records(run_dir, "end")
    assert end["status"] == "completed" and end["steps"] == REQUEUE_TOTAL and end["samples_per_s"] > 0
    assert sorted(p.name for p in (run_dir / "ranks").iterdir()) == ["rank-00000.json", "rank-00001.json"]
    assert not (run_dir / "checkpoints").exists(), "no stop, no checkpoint"

    report = run_cli("report", str(run_dir), "-o", str(tmp_path / "report"))
    assert report.returncode == 0, report.stderr
    assert "1 complete" in report.stdout, report.stdout
    import csv

    rows = list(csv.DictReader((tmp_path / "report" / "scaling.csv").open()))
    assert [(int(r["world_size"]), int(float(r["per_device_batch_size"]))) for r in rows] == [(2, 16)], rows
    assert float(rows[0]["samples_per_s"]) > 0


def test_ddp_ck_under_torchrun_joins_torchruns_world(tmp_path: Path) -> None:
    run_dir = make_run_dir(tmp_path / "run", {"train": {"log_every": 4}})
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             DDP_CK, "--steps", "8", "--batch-size", "8"], cwd=tmp_path,
                            env=plain_env(CYCLONE_RUN_DIR=str(run_dir), OMP_NUM_THREADS="1"), capture_output=True,
                            text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    (start,) = records(run_dir, "start")
    assert (start["launcher"], start["world_size"], start["local_world_size"]) == ("torchrun", 2, 2)
    assert start["global_batch_size"] == 16 and [s["step"] for s in records(run_dir, "step")] == [4, 8]
    assert [e["status"] for e in records(run_dir, "end")] == ["completed"]


def test_a_process_group_the_script_made_is_reused_and_left_to_it(instrumented_script: tuple[Path, str]) -> None:
    _run_dir, stdout = instrumented_script  # the script made its gloo group of one before ck.init()
    assert "same group True 1" in stdout


# --------------------------------------------------------------------------- signal, checkpoint, resume
def test_requeue_signal_stops_every_rank_at_one_step_and_the_run_resumes_exactly(two_rank_run: Path,
                                                                                  tmp_path: Path) -> None:
    total, spec, args = REQUEUE_TOTAL, REQUEUE_SPEC, REQUEUE_ARGS
    run_dir = make_run_dir(tmp_path / "run", spec)
    # Both ranks wait after optimizer step 5 until the signal reached them: it lands mid-run, at any speed.
    holds = hold_files(tmp_path / "hold")
    proc = launcher(run_dir, 2, *args, env=slow_parts_env(tmp_path / "hold", hold_step=5))
    try:
        wait_for(lambda: holds.at(5, range(2)), TIMEOUT_S, "both ranks held after step 5")
        proc.send_signal(signal.SIGUSR2)  # passed on to both ranks, as srun --signal does
        wait_for(lambda: holds.signalled(range(2)), TIMEOUT_S, "the signal to reach both ranks")
        holds.go()
        finish(proc, run_dir)
    finally:
        holds.go()  # never leave a rank held (a failed wait above would leave it waiting forever)
        if proc.poll() is None:
            proc.kill()
    (end,) = records(run_dir, "end")
    stopped = end["steps"]
    # checkpoint.poll_s 0: the ranks agree after every step; the flag raised during step 5 goes into
    # step 5's reduce and is acted on at step 6's poll: the stop comes within steps of the signal.
    print(f"signalled while held after step 5; stopped after step {stopped}")
    assert end["status"] == "preempted" and 5 <= stopped <= 10, end
    state, _path = ckpt.load_latest(run_dir / "checkpoints")
    assert state["step"] == stopped and state["user_state"]["step"] == stopped
    out = (run_dir / "logs" / "rank-0.out").read_text()
    assert "stopped on a signal after a checkpoint; not running under Slurm" in out, out[-2000:]
    assert "Traceback" not in "".join(p.read_text() for p in (run_dir / "logs").glob("*.err"))

    finish(launcher(run_dir, 2, *args), run_dir)  # the same run directory again: resumes
    starts, ends = records(run_dir, "start"), records(run_dir, "end")
    assert [s["start_step"] for s in starts] == [0, stopped]
    assert [e["status"] for e in ends] == ["preempted", "completed"] and ends[1]["steps"] == total
    steps = records(run_dir, "step")
    assert [s["step"] for s in steps] == list(range(1, total + 1)), "every step exactly once"

    expected = [s["loss"] for s in records(two_rank_run, "step")]  # the same spec and arguments, never signalled
    assert [s["loss"] for s in steps] == pytest.approx(expected, rel=1e-5, abs=1e-6), \
        "the resumed run follows the uninterrupted one (weights, momentum and batches restored)"


# --------------------------------------------------------------------------- misuse and failure
@pytest.mark.parametrize(("body", "message"), [
    pytest.param("ck.log_step(1, samples=8)", "error: ck.log_step() before ck.init() HINT: call ctx = ck.init()",
                 id="before-init"),
    pytest.param("ck.init()\nck.init()", "error: ck.init() was called twice HINT: call ck.init() once",
                 id="init-twice"),
    pytest.param("ck.init()\nck.finish()\nck.stop_requested()",
                 "error: ck.stop_requested() after ck.finish() HINT: call ck.finish() last", id="after-finish"),
    pytest.param("ck.init()\nck.log_step(1)\nck.instrument(loader=[1])",
                 "error: ck.instrument() after the first ck.log_step() HINT:", id="instrument-late"),
    pytest.param("ck.init()\nck.log_step(3)\nck.log_step(2)",
                 "error: ck.log_step(step=2) after step 3: steps must increase HINT:", id="step-backwards"),
])
def test_a_call_out_of_order_fails_in_one_line_with_exit_2(tmp_path: Path, body: str, message: str) -> None:
    result = run_script(tmp_path, "import cyclone_kit as ck\n" + body + "\n")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), result.stderr


@pytest.fixture(scope="module")
def instrumented_script(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A world of one with a DataLoader whose dataset sleeps in __getitem__, in a process group the script made
    itself before ck.init(): its run directory and stdout. One process for two tests (issue 27: one import of
    torch, not two); they do not interfere: ck.instrument times the loader and the step on the host clock,
    whoever made the group, and whether ck.init() reuses a group and leaves it to the script does not depend on
    what the script logs (the other scripts here, and ddp_ck.py without a launcher, cover ck.init() making its
    own)."""
    tmp_path = tmp_path_factory.mktemp("instrumented")
    run_dir = make_run_dir(tmp_path / "run", {"train": {"log_every": 4}})
    result = run_script(tmp_path, """
        import time
        import torch
        import torch.distributed as dist
        import cyclone_kit as ck

        class Slow(torch.utils.data.Dataset):
            def __len__(self):
                return 64
            def __getitem__(self, i):
                time.sleep(0.002)
                return torch.randn(32), i % 4

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        group = dist.group.WORLD
        ctx = ck.init()
        model = torch.nn.Linear(32, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = ck.instrument(model=model, optimizer=opt,
                               loader=torch.utils.data.DataLoader(Slow(), batch_size=8))
        for step, (x, y) in enumerate(loader, 1):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            ck.log_step(step, samples=8, loss=loss)
        ck.finish()
        print("same group", dist.is_initialized() and dist.group.WORLD is group, ctx.world_size)
        dist.destroy_process_group()
    """, run_dir=run_dir)
    assert result.returncode == 0, result.stderr
    return run_dir, result.stdout


def test_instrument_times_the_loader_the_forward_and_the_optimizer_of_a_script(
        instrumented_script: tuple[Path, str]) -> None:
    """A world of one with a DataLoader whose dataset sleeps in __getitem__: the data wait shows as
    data_time_s, the rest of the step splits into compute (forward to optimizer step) and other."""
    run_dir, _stdout = instrumented_script
    steps = records(run_dir, "step")
    assert [s["step"] for s in steps] == [4, 8]
    assert_phases_add_up(steps, communication=False)
    assert all(s["data_time_s"] >= 8 * 0.002 for s in steps)  # 8 samples, each sleeping 2 ms, per step


def test_an_exception_in_the_script_writes_the_failed_end_and_error_records(tmp_path: Path) -> None:
    run_dir = make_run_dir(tmp_path / "run", {})
    result = run_script(tmp_path, """
        import cyclone_kit as ck
        ctx = ck.init()
        ck.log_step(1, samples=8, loss=1.5)
        raise RuntimeError("the data loader broke")
    """, run_dir=run_dir)
    assert result.returncode == 1 and "RuntimeError: the data loader broke" in result.stderr
    (end,) = records(run_dir, "end")
    assert end["status"] == "failed" and end["steps"] == 1
    error = json.loads((run_dir / "ranks" / "error-rank-00000.json").read_text())
    assert error["type"] == "RuntimeError" and error["message"] == "the data loader broke"


def test_checkpoints_rotate_as_the_spec_says_and_a_torn_one_is_skipped(tmp_path: Path) -> None:
    run_dir = make_run_dir(tmp_path / "run", {"checkpoint": {"keep": 2}})
    result = run_script(tmp_path, """
        import torch
        import cyclone_kit as ck
        ctx = ck.init()
        assert ck.load_checkpoint() is None
        for step in (1, 2, 3):
            ck.log_step(step, samples=4)
            ck.save_checkpoint({"w": torch.full((2,), float(step)), "note": "hi"})
        print("world", ctx.world_size, ctx.rank, ctx.is_main, ctx.device)
        ck.finish()
    """, run_dir=run_dir)
    assert result.returncode == 0, result.stderr
    assert "world 1 0 True cpu" in result.stdout
    assert [s for s, _ in ckpt.list_checkpoints(run_dir / "checkpoints")] == [3, 2]
    # No ck.instrument: the step records say the phases were not measured (null), not 0.
    assert records(run_dir, "start")[0]["phase_timing"] is None
    (step,) = records(run_dir, "step")
    assert step["data_time_s"] is None and all(step[k] is None for k in ("compute_time_s", "comm_time_s",
                                                                           "comm_exposed_s", "other_time_s"))
    (run_dir / "checkpoints" / "ckpt-000000009.pt").write_bytes(b"torn")
    result = run_script(tmp_path, """
        import cyclone_kit as ck
        ck.init()
        state = ck.load_checkpoint()
        print("loaded", state["w"].tolist(), state["note"])
        ck.finish()
    """, run_dir=run_dir)
    assert result.returncode == 0, result.stderr
    assert "loaded [3.0, 3.0] hi" in result.stdout and "skipping damaged checkpoint" in result.stdout
