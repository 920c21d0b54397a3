"""Signals and kills against real local runs (`python -m cyclone_kit run`, 2 ranks, CPU, 1 thread each).

* SIGTERM to the launcher: every rank checkpoints and exits 0, the run ends "preempted", and
  the same run directory resumes to completion with every optimizer step exactly once.
* The configured requeue signal (checkpoint.signal, here USR1) to the launcher: passed on to
  the ranks like srun does, with the same outcome (the same stop; its resume is the SIGTERM case's).
* A storm of signals (USR2 and SIGTERM every 2 ms) at both ranks from the stop request until
  the stop checkpoint is in place: the checkpoint loads and the run resumes from it.
* SIGKILL of the writing rank while a checkpoint is being written in the background (the write held
  before its fsync, training went on meanwhile): the previous checkpoint still loads and the run
  resumes from it.
* The per-rank watchdog (cyclone_kit.runtime.watchdog) records a rank killed by a signal.

tests/unit/test_checkpoint.py already kills a bare save loop; these kill real training runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from cyclone_kit.backends.srun_emulator import LAUNCH_FILE, launch
from cyclone_kit.rundir.failures import root_cause
from cyclone_kit.runtime import checkpoint as ck
from cyclone_kit.runtime import watchdog
from tests.helpers.cli import REPO
from tests.helpers.ranks import alive, records
from tests.helpers.slow_parts import hold_files, slow_parts_env
from tests.helpers.slurm_jobs import wait_for

pytestmark = pytest.mark.slow

SMOKE = str(REPO / "jobs" / "smoke.toml")
#: Hang guard for every wait in this file (not a performance bound): the slowest wait, a resume
#: segment, takes ~20-30 s on a 2-core machine; this leaves >= 8x for a slower or busier one.
TIMEOUT_S = 240
#: pytest-timeout for the training tests: a run, a stop and a resume, each under its own hang guard.
SLOW_TEST_TIMEOUT_S = 900
#: Steps of the tiny-CNN runs signalled while both ranks are held after step 5
#: (:mod:`tests.helpers.slow_parts`). With checkpoint.poll_s=0 the ranks agree on the stop flag after
#: every step, so the stop comes within a step or two of the hold at any speed (5-7, asserted): 12 leaves
#: the resumed segment 5-7 steps, across the step-10 checkpoint.
SIGNALLED_STEPS = 12
#: The least step time of a signalled segment (a sleep after every optimizer step).
STEP_FLOOR_S = 0.01
#: Rounds of the signal storm sent while the stop checkpoint's write is held (its temporary file complete,
#: not yet renamed), before the write is released.
STORM_ROUNDS_DURING_WRITE = 50
#: Steps of the storm run (signalled from step 3, while both ranks are held there). With
#: checkpoint.poll_s=0 the ranks agree on the stop after every step, so it comes at step 3-5 at any speed
#: and the resumed segment runs 1-3 steps.
STORM_STEPS = 6


# --------------------------------------------------------------------------- helpers




def last_step(run_dir: Path) -> int:
    return max((r["step"] for r in records(run_dir, "step")), default=0)




class LocalRun:
    """``python -m cyclone_kit run jobs/smoke.toml --nproc 2`` in the background, killed on exit."""

    def __init__(self, runs_dir: Path, *sets: str, env: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> None:
        argv = [sys.executable, "-m", "cyclone_kit", "run", SMOKE, "--nproc", "2", "--threads", "1", "--quiet",
                "--runs-dir", str(runs_dir), *args]
        for item in sets:
            argv += ["--set", item]
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": "",
                                          **(env or {})})
        assert self.proc.stdout is not None
        first = self.proc.stdout.readline()
        assert first.startswith("run dir: "), first + self.proc.stderr.read()  # type: ignore[union-attr]
        self.run_dir = Path(first.split(": ", 1)[1].strip())
        self.rank_pids: list[int] = []

    def wait_ranks(self) -> list[int]:
        launch_file = self.run_dir / LAUNCH_FILE
        wait_for(launch_file.is_file, TIMEOUT_S, "launch.json")
        self.rank_pids = [r["pid"] for r in json.loads(launch_file.read_text())["ranks"]]
        return self.rank_pids

    def finish(self, timeout: float = TIMEOUT_S) -> tuple[int, str, str]:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        finally:
            self.cleanup()
        return self.proc.returncode, out, err

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in self.rank_pids:  # never leave a rank behind, whatever the launcher did
            if alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
        wait_for(lambda: not any(alive(p) for p in self.rank_pids), TIMEOUT_S, "the ranks to be gone")


def resume(run_dir: Path) -> None:
    """Run the same run directory again (2 ranks, resume=true in smoke.toml) and require success."""
    result = launch(run_dir, 2, threads=1, timeout_s=TIMEOUT_S, extra_env={"CUDA_VISIBLE_DEVICES": ""})
    assert result.ok, (result.first_failure, (run_dir / "logs" / "rank-0.err").read_text()[-3000:])


def assert_every_step_once(run_dir: Path, total: int) -> None:
    steps = [r["step"] for r in records(run_dir, "step")]
    assert steps == list(range(1, total + 1)), f"steps logged: {steps[:5]}...{steps[-5:]} ({len(steps)})"


# --------------------------------------------------------------------------- SIGTERM / the configured signal
@pytest.mark.parametrize(("sig", "sets", "expected_rc"), [
    pytest.param(signal.SIGTERM, (), 130, id="SIGTERM"),
    pytest.param(signal.SIGUSR1, ("checkpoint.signal=USR1",), 0, id="configured-USR1"),
])
@pytest.mark.timeout(SLOW_TEST_TIMEOUT_S)
def test_signal_to_local_run_checkpoints_stops_preempted_and_resumes(tmp_path: Path, sig: signal.Signals,
                                                                     sets: tuple[str, ...], expected_rc: int) -> None:
    total = SIGNALLED_STEPS
    # Both ranks wait after optimizer step 5 until the signal reached them: it lands mid-run, at any speed.
    holds = hold_files(tmp_path / "hold")
    # --stop-grace at the hang guard: SIGTERM gives the ranks that long for the step, the agreement and the stop
    # checkpoint before SIGKILL (30 s by default: seconds here, but a budget a 5x slower machine could eat).
    # checkpoint.stall_floor_s=0: the progress watchdog off (this test is not about stalls); armed, it bounded the
    # hold to 36 s, a margin a 5x slower machine could eat (docs/TESTING.md item 9).
    run = LocalRun(tmp_path, f"train.steps={total}", "train.log_every=1", "checkpoint.poll_s=0",
                   "checkpoint.stall_floor_s=0", *sets,
                   env=slow_parts_env(tmp_path / "hold", hold_step=5, step_delay_s=STEP_FLOOR_S),
                   args=("--stop-grace", str(TIMEOUT_S)))
    try:
        pids = run.wait_ranks()
        wait_for(lambda: holds.at(5, range(2)), TIMEOUT_S, "both ranks held after step 5")
        run.proc.send_signal(sig)
        sent = time.monotonic()
        wait_for(lambda: holds.signalled(range(2)), TIMEOUT_S, "the signal to reach both ranks")
        holds.go()
        code, out, err = run.proc.wait(timeout=TIMEOUT_S), "", ""
        orphans = [p for p in pids if alive(p)]  # ranks that outlived their launcher
        wait_for(lambda: not any(alive(p) for p in pids), TIMEOUT_S, "the ranks to stop")
        stop_s = time.monotonic() - sent
        code, out, err = run.finish(timeout=TIMEOUT_S)
    finally:
        holds.go()
        run.cleanup()
    print(f"{sig.name} to the launcher: every rank gone {stop_s:.2f} s later; launcher exit {code}")
    assert code != -sig and not orphans, (
        f"the launcher died of {sig.name} (exit {code}) and left rank(s) {orphans} running without it")
    ends = records(run.run_dir, "end")
    assert [e["status"] for e in ends] == ["preempted"], (ends, err)
    stopped = ends[0]["steps"]
    assert 5 <= stopped <= 7, "the stop came after the step the signal arrived in, within the next agreement"
    state, path = ck.load_latest(run.run_dir / "checkpoints")
    assert state["step"] == stopped, f"the stop was checkpointed ({path})"
    assert code == expected_rc, (code, out, err)
    rank_logs = "".join((run.run_dir / "logs" / f"rank-{r}.err").read_text() for r in (0, 1))
    assert "Traceback" not in rank_logs, rank_logs[-3000:]
    if sig != signal.SIGTERM:
        # Resumed in the SIGTERM case only (issue 27: one 2-rank run less): the stop left the same run directory
        # whichever signal asked for it (the "preempted" end record and the checkpoint of the stop step, asserted
        # above; no requeue outside Slurm), and a resume reads only that, never which signal it was.
        return
    resume(run.run_dir)
    starts = records(run.run_dir, "start")
    assert [s["start_step"] for s in starts] == [0, stopped]
    assert [e["status"] for e in records(run.run_dir, "end")] == ["preempted", "completed"]
    assert_every_step_once(run.run_dir, total)


# --------------------------------------------------------------------------- signals during the checkpoint
@pytest.mark.timeout(SLOW_TEST_TIMEOUT_S)
def test_signal_storm_during_the_stop_checkpoint_does_not_corrupt_it(tmp_path: Path) -> None:
    """USR2 then SIGTERM/USR2 alternately every 2 ms at both ranks until the stop checkpoint is in
    place; checkpoint.every_steps=0 makes it the only checkpoint, checkpoint.poll_s=0 makes the stop come
    a step or two after the hold at any speed (the ranks agree after every step). The moments are made
    (:mod:`tests.helpers.slow_parts`): the storm starts while both ranks are held after step 3 (they go
    on once both received a signal), and the stop checkpoint's write is held before its fsync (the
    temporary file complete, not yet renamed) for STORM_ROUNDS_DURING_WRITE rounds. The hold, not the
    checkpoint's size, keeps the write open, so smoke.toml's tiny CNN serves (no ResNet-18 needed)."""
    total = STORM_STEPS
    holds = hold_files(tmp_path / "hold")
    run = LocalRun(tmp_path, f"train.steps={total}", "train.log_every=1", "checkpoint.every_steps=0",
                   "checkpoint.poll_s=0",
                   env=slow_parts_env(tmp_path / "hold", hold_step=3, hold_write=1))
    ckpts = run.run_dir / "checkpoints"
    sent = during_write = 0
    try:
        pids = run.wait_ranks()
        wait_for(lambda: holds.at(3, range(2)), TIMEOUT_S, "both ranks held after step 3")
        storm = [signal.SIGUSR2, signal.SIGTERM]
        deadline = time.monotonic() + TIMEOUT_S  # a hang guard: the loop ends on the checkpoint (an event)
        while not ck.list_checkpoints(ckpts) and time.monotonic() < deadline:
            writing = holds.writing() and any(p.name.endswith(".tmp") for p in ckpts.iterdir())
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, storm[sent % 2])
            sent += 1
            during_write += writing
            if sent == 1:
                wait_for(lambda: holds.signalled(range(2)), TIMEOUT_S, "the first signals to reach both ranks")
                holds.go()
            if during_write == STORM_ROUNDS_DURING_WRITE:
                holds.release()
            time.sleep(0.002)
        code, _out, err = run.finish(timeout=TIMEOUT_S)
    finally:
        holds.go()
        holds.release()
        run.cleanup()
    print(f"signal storm: {sent} rounds of signals to 2 ranks, {during_write} of them while the checkpoint "
          f"was being written; launcher exit {code}")
    assert during_write >= STORM_ROUNDS_DURING_WRITE, "the storm did not go on while the checkpoint was written"
    ends = records(run.run_dir, "end")
    assert [e["status"] for e in ends] == ["preempted"], (ends, err)
    stopped = ends[0]["steps"]
    assert 3 <= stopped < total, "poll_s 0: the stop came within the next agreements after the hold, mid-run"
    state, _ = ck.load_latest(run.run_dir / "checkpoints")
    assert state["step"] == stopped
    for _, path in ck.list_checkpoints(ckpts):
        ck.load_checkpoint(path)
    assert not list(ckpts.glob(".ckpt-*.tmp")), "no temporary file left behind"

    resume(run.run_dir)
    assert [s["start_step"] for s in records(run.run_dir, "start")] == [0, stopped]
    assert_every_step_once(run.run_dir, total)


@pytest.mark.timeout(SLOW_TEST_TIMEOUT_S)
def test_sigkill_while_a_training_run_writes_a_checkpoint_resumes_from_the_previous(tmp_path: Path) -> None:
    """Rank 0 (the writer) is SIGKILLed while its temporary checkpoint file exists, after an earlier
    checkpoint is complete; the run fails, and the same run directory resumes from the earlier one.
    The moment is made (:mod:`tests.helpers.slow_parts`): the second checkpoint's write (step 2 x
    every), in the background thread, is held before its fsync while training goes on to step 3 x
    every, and the kill lands while it is held. A checkpoint every step: the first segment runs 3 steps
    and the resumed one 3."""
    total, every = 4, 1
    holds = hold_files(tmp_path / "hold")
    run = LocalRun(tmp_path, f"train.steps={total}", "train.log_every=1", f"checkpoint.every_steps={every}",
                   "checkpoint.keep=3",
                   env=slow_parts_env(tmp_path / "hold", hold_write=2))
    ckpts = run.run_dir / "checkpoints"
    try:
        pids = run.wait_ranks()
        wait_for(holds.writing, TIMEOUT_S, "the second checkpoint being written")
        tmp = [p for p in ckpts.iterdir() if p.name.endswith(".tmp") and not p.name.endswith(".sha256.tmp")]
        assert [p.name for p in tmp] == [Path(line).name for line in
                                         (holds.folder / "writing").read_text().split()], tmp
        assert [s for s, _ in ck.list_checkpoints(ckpts)] == [every], "the first checkpoint is complete"
        # Written in the background (checkpoint.async_write): training goes on to the next checkpoint,
        # whose save waits for the held write; the kill lands during the asynchronous write.
        wait_for(lambda: last_step(run.run_dir) >= 3 * every, TIMEOUT_S, "training to go on during the write")
        assert [s for s, _ in ck.list_checkpoints(ckpts)] == [every], "the held write is still not in place"
        os.kill(pids[0], signal.SIGKILL)
        code, _out, err = run.finish(timeout=TIMEOUT_S)
    finally:
        run.cleanup()
    complete = [s for s, _ in ck.list_checkpoints(ckpts)]
    print(f"SIGKILL while writing {tmp[0].name}; complete checkpoints left: {complete}; launcher exit {code}")
    assert code == 1, err
    assert "SIGKILL" in (root_cause(run.run_dir) or ""), root_cause(run.run_dir)
    state, _path = ck.load_latest(ckpts)
    previous = state["step"]
    assert previous == max(complete) == every, "the checkpoint before the killed write is the one resumed"
    assert tmp[0].name not in {p.name for _, p in ck.list_checkpoints(ckpts)}, "a half-written file is no checkpoint"

    resume(run.run_dir)
    starts = records(run.run_dir, "start")
    assert [s["start_step"] for s in starts] == [0, previous]
    assert records(run.run_dir, "end")[-1]["status"] == "completed"
    steps = [r["step"] for r in records(run.run_dir, "step")]
    second = steps[len(steps) - (total - previous):]
    assert second == list(range(previous + 1, total + 1)), "the resumed segment runs every step after the checkpoint"
    assert not list(ckpts.glob(".ckpt-*.tmp")), "the stale temporary file was cleaned up"


# --------------------------------------------------------------------------- the watchdog
def _watch(tmp_path: Path, code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "CYCLONE"))}
    return subprocess.run([sys.executable, "-m", "cyclone_kit.runtime.watchdog", "--run-dir", str(tmp_path), "--",
                           sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


def test_watchdog_records_a_rank_killed_by_a_signal(tmp_path: Path) -> None:
    (tmp_path / "spec.json").write_text("{}")
    result = _watch(tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
                    {"SLURM_JOB_ID": "42", "SLURM_PROCID": "3", "SLURMD_NODENAME": "c9"})
    assert result.returncode == -signal.SIGKILL, result  # the watchdog dies the same way
    record = json.loads((tmp_path / "ranks" / "error-rank-00003.json").read_text())
    assert (record["rank"], record["host"], record["signal"], record["exit_code"]) == (3, "c9", "SIGKILL", 137)
    assert root_cause(tmp_path).startswith("rank 3 on host c9 (pid ") and "killed by SIGKILL" in root_cause(tmp_path)
    assert "watchdog: rank 3 on host c9" in result.stderr


def test_watchdog_forwards_signals_and_passes_exit_codes_through(tmp_path: Path) -> None:
    code = ("import os, signal, sys, time\n"
            "signal.signal(signal.SIGUSR2, lambda s, f: sys.exit(7))\n"
            "os.kill(os.getppid(), signal.SIGUSR2)\n"  # reaches the watchdog, which must pass it on
            "time.sleep(3600)\n")  # ends only by the forwarded signal
    result = _watch(tmp_path, code, {"SLURM_JOB_ID": "42", "SLURM_PROCID": "0"})
    assert result.returncode == 7, result
    assert not (tmp_path / "ranks").exists() and not (tmp_path / "failure.json").exists(), "an exit code is no death"
    # A signal the watchdog passed on is a stop request, not a crash: no record either.
    code = "import os, signal, time\nos.kill(os.getppid(), signal.SIGTERM)\ntime.sleep(3600)\n"
    result = _watch(tmp_path, code, {"SLURM_JOB_ID": "42", "SLURM_PROCID": "0"})
    assert result.returncode == -signal.SIGTERM
    assert not (tmp_path / "failure.json").exists()


def test_a_signal_while_the_rank_starts_is_passed_on_not_fatal_to_the_watchdog(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The moment is made: SIGUSR2 reaches the watchdog just before the rank's process exists (inside its Popen
    call). The watchdog survives it and passes it on once the rank exists: the rank ends by that signal (it
    has no handler yet), and the watchdog, which forwarded it, records no death and ends by the same signal
    (here its own kill is intercepted, so that pytest's process lives on)."""
    from cyclone_kit.runtime.watchers import rankexit

    real_popen, real_kill, children, own_kills = subprocess.Popen, os.kill, [], []

    def popen_after_a_signal(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        assert callable(signal.getsignal(signal.SIGUSR2)), "the watchdog's handler must be in place before the rank"
        real_kill(os.getpid(), signal.SIGUSR2)  # handled at once (main thread): the rank does not exist yet
        children.append(real_popen(*args, **kwargs))
        return children[-1]

    def kill(pid: int, signum: int) -> None:
        if pid == os.getpid():
            own_kills.append(signum)
        else:
            real_kill(pid, signum)

    monkeypatch.setattr(rankexit.subprocess, "Popen", popen_after_a_signal)
    monkeypatch.setattr(rankexit.os, "kill", kill)
    monkeypatch.setattr(rankexit.time, "sleep", lambda _s: None)
    previous = signal.getsignal(signal.SIGUSR2)
    code = rankexit.supervise([sys.executable, "-c", "import time; time.sleep(3600)"], tmp_path,
                              {"SLURM_JOB_ID": "42", "SLURM_PROCID": "0", "PATH": os.environ.get("PATH", "")})
    assert len(children) == 1 and children[0].returncode == -signal.SIGUSR2, "the rank got the early signal"
    assert own_kills == [signal.SIGUSR2] and code == 128 + signal.SIGUSR2, "then the watchdog ends the same way"
    assert signal.getsignal(signal.SIGUSR2) is previous, "the watchdog's handlers are taken back"
    assert not (tmp_path / "failure.json").exists() and not (tmp_path / "ranks").exists(), "a passed-on stop"


@pytest.mark.parametrize(("env", "expected"), [
    ({"SLURM_JOB_ID": "7"}, True),
    ({"SLURM_ARRAY_JOB_ID": "7"}, True),
    ({}, False),
    ({"SLURM_JOB_ID": "7", "CYCLONE_LAUNCHER": "local"}, False),  # the local launcher watches its ranks
    ({"SLURM_JOB_ID": "7", watchdog.CHILD_VAR: "1"}, False),  # never a watchdog of a watchdog
    ({"SLURM_JOB_ID": "7", watchdog.SWITCH_VAR: "0"}, False),
    ({watchdog.SWITCH_VAR: "1"}, True),
])
def test_watchdog_wanted(env: dict[str, str], expected: bool) -> None:
    assert watchdog.wanted(env) is expected


def test_first_failure_record_wins(tmp_path: Path) -> None:
    first = watchdog.death_record(1, "c1", 100, -9, "2026-01-01T00:00:00.000+00:00")
    second = watchdog.death_record(2, "c2", 200, -11, "2026-01-01T00:00:01.000+00:00")
    watchdog.write_records(tmp_path, first)
    watchdog.write_records(tmp_path, second)
    assert json.loads((tmp_path / "failure.json").read_text())["first"]["rank"] == 1
    assert sorted(p.name for p in (tmp_path / "ranks").iterdir()) == ["error-rank-00001.json", "error-rank-00002.json"]
    assert watchdog.root_cause_line(second) == "rank 2 on host c2 (pid 200) killed by SIGSEGV"
