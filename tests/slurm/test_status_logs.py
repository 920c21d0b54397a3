"""Issue 17: `status` and `logs` answer for everything a user has, on the real local Slurm cluster.

A held job says why it waits and that it has no logs yet; `logs -f` waits for it (saying so),
then follows it to the end. A requeued (and held) job says it was requeued. A job that
failed makes `status` exit 1. Every wait is for an event (a line, a state), never a duration.
A study directory and its report job's id: test_sweep_slurm, on its strong study (issue 27: this file's own
2-point study, 3 Slurm jobs and ~30 CPU-s, is gone).

The held, requeued and failed jobs are 1 node x 1 task (smoke.toml's default is 2 tasks): what is asserted
is what `status` and `logs` say of a job, which no second rank changes, and each rank start is a Python that
imports torch (issue 27: the three jobs' CPU, sacct TotalCPU, 22 -> 11 s).
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from cyclone_kit.backends.slurm import SlurmBackend
from cyclone_kit.core.proc import run_command
from cyclone_kit.slurm.states import JobState
from tests.helpers.cli import REPO, run_cli
from tests.helpers.slurm_jobs import cancel_quietly, steps_logged, submit_smoke, wait_for

#: hang guards only (a broken job or cluster); every wait is for an event
HANG_S = 600

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(3 * HANG_S)]
HOLD = 'resources.extra_sbatch=["--hold"]'
#: the held, requeued and failed jobs' shape (see the module doc)
ONE_TASK = ("--nodes", "1", "--ntasks-per-node", "1")


class Follower:
    """``logs -f TARGET`` in a subprocess; its stdout lines collected as they come."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "cyclone_kit", "logs", "-f", *args], cwd=REPO,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**__import__("os").environ, "PYTHONUNBUFFERED": "1"})
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def saw(self, text: str) -> bool:
        return any(text in line for line in list(self.lines))

    def finish(self, timeout: float) -> tuple[int, str, str]:
        rc = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=30)
        return rc, "\n".join(self.lines), self.proc.stderr.read() if self.proc.stderr else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


def test_held_job_says_why_and_logs_follow_waits_for_it(slurm_cluster: dict[str, str], tmp_path: Path) -> None:
    backend = SlurmBackend()
    job_id, run_dir = submit_smoke(tmp_path, *ONE_TASK, sets=(HOLD, "train.steps=20", "train.log_every=5"))
    follower = None
    try:
        status = run_cli("status", job_id, "--runs-dir", str(tmp_path), timeout=60)
        assert status.returncode == 0, status.stdout + status.stderr
        assert re.search(rf"^{job_id}\s+smoke\s+PENDING\s.*JobHeldUser$", status.stdout, re.M), status.stdout
        assert f"job {job_id} is PENDING (JobHeldUser): held by its owner; `scontrol release {job_id}`" in status.stdout

        logs = run_cli("logs", str(run_dir), timeout=60)
        assert logs.returncode == 0, logs.stderr
        assert logs.stdout.strip().endswith("; no logs yet"), logs.stdout
        assert logs.stdout.startswith(f"job {job_id} is PENDING (JobHeldUser)"), logs.stdout

        follower = Follower(str(run_dir), "--poll", "0.2")
        wait_for(lambda: follower.saw("waiting for it to start"), HANG_S, "logs -f to say it waits")
        assert follower.proc.poll() is None, "logs -f must keep waiting while the job is held"
        run_command(["scontrol", "release", job_id], timeout=60)
        rc, out, err = follower.finish(timeout=HANG_S)  # ends by itself once the job has ended
        info = backend.wait(job_id, timeout=HANG_S)
    finally:
        if follower is not None:
            follower.stop()
        cancel_quietly(backend, job_id)
    print(out)
    assert rc == 0, err
    assert info.state is JobState.COMPLETED, info
    held = [line for line in out.splitlines() if "(JobHeldUser)" in line]
    assert len(held) == 1 and held[0].endswith("waiting for it to start (Ctrl-C stops waiting)"), out
    # every waiting line is said once per state and reason, not once a poll
    waiting = [line for line in out.splitlines() if "waiting for" in line]
    assert len(waiting) == len(set(waiting)), out
    assert "==> logs/" in out and "cyclone_kit: completed at step 20/20" in out, out
    assert "cyclone_kit: checkpoint of step 20 written" in out, out


def test_requeued_job_says_it_was_requeued_then_cancel_ends_it(slurm_cluster: dict[str, str], tmp_path: Path) -> None:
    backend = SlurmBackend()
    job_id, run_dir = submit_smoke(tmp_path, *ONE_TASK, sets=("train.steps=1000000", "train.log_every=5"))
    try:
        wait_for(lambda: steps_logged(run_dir) > 0, HANG_S, "the first step record")
        run_command(["scontrol", "requeuehold", job_id], timeout=60)
        info = backend.wait(job_id, until=lambda i: i.state is JobState.PENDING and (i.restart_count or 0) >= 1,
                            timeout=HANG_S)
        status = run_cli("status", str(run_dir), timeout=60)
        logs = run_cli("logs", job_id, "--runs-dir", str(tmp_path), timeout=60)
        cancel = run_cli("cancel", str(run_dir), timeout=120)
        after = run_cli("status", str(run_dir), timeout=60)
    finally:
        cancel_quietly(backend, job_id)
    print(status.stdout, logs.stdout[-500:], cancel.stdout, after.stdout, sep="\n")
    assert info.restart_count == 1, info
    assert status.returncode == 0, status.stdout + status.stderr
    assert re.search(rf"^{job_id}\s+smoke\s+PENDING\s", status.stdout, re.M), status.stdout
    assert f"job {job_id} is PENDING ({info.reason}): requeued 1 time(s)" in status.stdout, status.stdout
    assert "resumes from its last checkpoint" in status.stdout and f"`scontrol release {job_id}`" in status.stdout
    assert logs.returncode == 0 and "==> logs/" in logs.stdout, logs.stdout + logs.stderr  # the first segment's log
    assert cancel.returncode == 0 and cancel.stdout.strip() == f"job {job_id}: CANCELLED", cancel.stdout + cancel.stderr
    assert after.returncode == 0, "a cancelled job is no failure"
    assert re.search(rf"^{job_id}\s+smoke\s+CANCELLED\s", after.stdout, re.M), after.stdout


def test_failed_job_makes_status_exit_1(slurm_cluster: dict[str, str], tmp_path: Path) -> None:
    """A data path only the compute nodes would see (--no-data-check) that they do not: the job fails."""
    backend = SlurmBackend()
    argv = ["submit", str(REPO / "jobs" / "smoke.toml"), "--profile", "local", "--partition", "cpu", *ONE_TASK,
            "--runs-dir", str(tmp_path), "--set", "train.dataset=cifar10", "--set", f"train.data_dir={tmp_path}/not-there"]
    refused = run_cli(*argv, timeout=60)
    assert refused.returncode == 2 and "--no-data-check" in refused.stderr, refused.stderr
    assert not any(tmp_path.iterdir()), "a refused submit writes nothing"
    result = run_cli(*argv, "--no-data-check", timeout=60)
    assert result.returncode == 0, result.stderr
    job_id = re.search(r"submitted job (\d+)", result.stdout).group(1)
    try:
        info = backend.wait(job_id, timeout=HANG_S)
    finally:
        cancel_quietly(backend, job_id)
    assert info.state is JobState.FAILED, info
    status = run_cli("status", "--runs-dir", str(tmp_path), timeout=60)
    print(status.stdout)
    assert status.returncode == 1, status.stdout + status.stderr
    assert re.search(rf"^{job_id}\s+smoke\s+FAILED\s", status.stdout, re.M), status.stdout
    assert f"1 of 1 job(s) failed: {job_id} (FAILED)" in status.stdout


@pytest.mark.parametrize(("end", "code", "state"), [("completed", 0, "COMPLETED"), ("cancelled", 0, "CANCELLED"),
                                                    ("failed", 1, "FAILED")])
def test_job_slurm_forgot_is_shown_from_its_run_directory(slurm_cluster: dict[str, str], tmp_path: Path, end: str,
                                                          code: int, state: str) -> None:
    """A job id no squeue/sacct/scontrol knows any more: the run directory's end record answers."""
    from cyclone_kit.rundir.layout import RunDir

    rd = RunDir.create(tmp_path, "old", '{"name": "old"}\n')
    rd.write_submission("999999", "slurm")
    rd.metrics.write_text(f'{{"kind": "end", "status": "{end}", "steps": 3}}\n')
    status = run_cli("status", str(rd.path), timeout=HANG_S)
    assert status.returncode == code, status.stdout + status.stderr
    assert re.search(rf"^999999\s+old\s+{state}\s+-\s+-\s+from the run directory \(job 999999 not found", status.stdout,
                     re.M), status.stdout
