"""Containers on the real local Slurm cluster (issue 30): Charliecloud, the runtime Debian 12 ships.

The image is Debian 12 with its own python3 (3.11.2), built by scripts/build-container-image.sh
(``make container-image``, a prerequisite of ``make test``; cached under /var/tmp/cyclone-images);
it holds no torch and no cyclone_kit: each job binds this project's virtual environment in at the
same path (``container.host_venv``). Two jobs run side by side, one module-scoped fixture:

* the built-in engine (jobs/smoke.toml, tiny CNN) on 2 cpu nodes x 1 rank in the container, held
  after optimizer step HOLD_STEP (tests/helpers/slow_parts.py) until ``scancel --signal=USR2`` has
  reached both ranks: it checkpoints, rank 0 (no ``scontrol`` in the image) asks the step watcher
  outside to requeue, Slurm starts it again, it resumes from the checkpoint and completes. Every
  optimizer step is recorded exactly once across the two segments. Nothing depends on machine speed.
* a user's script on 2 gpu nodes x 1 rank in the container, in the published pattern: relative
  ``./data`` and outputs in the folder ``submit`` ran in, a sibling package, run from the run
  directory's snapshot; it records the interpreter it ran on (the image's 3.11.2, with Charliecloud's
  ``CH_RUNNING`` set), the folder and the host.

Without ch-run or the image the tests skip, saying how to build it; with CK_REQUIRE_CONTAINER=1 or
CK_REQUIRE_SLURM=1 (``make test`` as root, which builds the image first) they fail instead.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from cyclone_kit.backends.slurm import SlurmBackend
from cyclone_kit.core.proc import run_command
from cyclone_kit.slurm.states import JobState
from tests.helpers.cli import run_cli
from tests.helpers.slow_parts import hold_files, slow_parts_env
from tests.helpers.slurm_jobs import cancel_quietly, parse_submit_output, read_records, submit_smoke, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(900)]

IMAGE = Path(os.environ.get("CK_CONTAINER_IMAGE", "/var/tmp/cyclone-images/debian12-python3"))
CONTAINER = ("--container", str(IMAGE), "--set", "container.runtime=charliecloud")
STEPS = 12
#: the engine's ranks wait after this optimizer step until the test's signal reached both
HOLD_STEP = 3
#: hang guards only (a broken job); every wait is for an event
HANG_S = 600

SCRIPT = textwrap.dedent("""
    import json, os, socket, sys
    from pathlib import Path

    import helpers

    rank = int(os.environ["RANK"])
    n = int(Path("./data/n.txt").read_text())
    Path(f"./out-rank{rank}.json").write_text(json.dumps({
        "cwd": os.getcwd(), "file": __file__, "version": helpers.VERSION, "host": socket.gethostname(), "n": n,
        "python": list(sys.version_info[:3]), "ch_running": os.environ.get("CH_RUNNING", ""),
        "world": int(os.environ["WORLD_SIZE"])}))
""")


def _not_ready(reason: str) -> None:
    message = (f"Charliecloud container tests need {reason}: build it with `make container-image` "
               "(scripts/build-container-image.sh: apt-get install charliecloud-runtime mmdebstrap, ~75 s)")
    if os.environ.get("CK_REQUIRE_CONTAINER") == "1" or os.environ.get("CK_REQUIRE_SLURM") == "1":
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def _ends(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_records(run_dir) if r["kind"] == "end"]


def _logs(run_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted((run_dir / "logs").rglob("*")) if p.is_file())


def _project(folder: Path) -> Path:
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "n.txt").write_text("5\n")
    (folder / "helpers").mkdir()
    (folder / "helpers" / "__init__.py").write_text("VERSION = 1\n")
    (folder / "train.py").write_text(SCRIPT)
    return folder


@pytest.fixture(scope="module")
def jobs(slurm_cluster: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Submit the engine job and the script job at once; signal the engine job once held; wait for both."""
    if shutil.which("ch-run") is None:
        _not_ready("ch-run on PATH")
    if not (IMAGE / ".complete").is_file():
        _not_ready(f"the image {IMAGE}")
    backend = SlurmBackend()
    runs = tmp_path_factory.mktemp("container-runs")
    parts = tmp_path_factory.mktemp("container-holds")
    holds = hold_files(parts)
    engine = submit_smoke(runs, "--nodes", "2", "--ntasks-per-node", "1", "--time", "15", *CONTAINER,
                          sets=("train.log_every=1", "checkpoint.poll_s=0", f"train.steps={STEPS}"),
                          env=slow_parts_env(parts, hold_step=HOLD_STEP))
    proj = _project(tmp_path_factory.mktemp("container-proj") / "proj")
    submitted = run_cli("submit", "train.py", "--profile", "local", "--partition", "gpu", "--nodes", "2",
                        "--gpus-per-node", "1", "--ntasks-per-node", "1", "--time", "00:10:00", *CONTAINER,
                        "--runs-dir", str(proj / "runs"), cwd=proj, timeout=120)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    script = parse_submit_output(submitted.stdout)
    start = time.monotonic()
    try:
        wait_for(lambda: holds.at(HOLD_STEP, range(2)), HANG_S, f"both ranks held after step {HOLD_STEP}", poll=0.2)
        run_command(["scancel", "--signal=USR2", engine[0]], timeout=60)
        wait_for(lambda: holds.signalled(range(2)), HANG_S, "the signal to reach both ranks", poll=0.2)
        holds.go()
        engine_info = backend.wait(engine[0], timeout=HANG_S)
        script_info = backend.wait(script[0], timeout=HANG_S)
    finally:
        holds.go()  # never leave a rank held
        cancel_quietly(backend, engine[0])
        cancel_quietly(backend, script[0])
    print(f"container jobs: engine {engine[0]} {engine_info.state.value}, script {script[0]} "
          f"{script_info.state.value}, {time.monotonic() - start:.1f} s after submission")
    return {"engine": (*engine, engine_info), "script": (*script, script_info), "proj": proj}


def test_engine_in_a_container_is_signalled_requeued_and_resumes(jobs: dict[str, Any]) -> None:
    job_id, run_dir, info = jobs["engine"]
    records = read_records(run_dir)
    starts = [r for r in records if r["kind"] == "start"]
    ends = _ends(run_dir)
    logs = _logs(run_dir)
    assert info.state is JobState.COMPLETED, (info, logs[-4000:])
    assert [e["status"] for e in ends] == ["preempted", "completed"], (ends, logs[-4000:])
    assert [s["restart_count"] for s in starts] == [0, 1] and {s["world_size"] for s in starts} == {2}
    assert set(starts[0]["hostnames"]) == {"c1", "c2"}
    stopped_at = ends[0]["steps"]
    assert HOLD_STEP <= stopped_at <= HOLD_STEP + 3, f"held after step {HOLD_STEP}, stopped after {stopped_at}"
    assert starts[1]["start_step"] == stopped_at, "the second segment resumed from the signal's checkpoint"
    steps = [r["step"] for r in records if r["kind"] == "step"]
    assert steps == list(range(1, STEPS + 1)), "every optimizer step exactly once, in order, across the requeue"
    # the ranks ran under ch-run (its --set-env gave them CYCLONE_REQUEUE_BY); the watcher outside requeued
    assert f"asked the step watcher to requeue Slurm job {job_id}" in logs, logs[-4000:]
    assert f"a rank asked for a requeue of job {job_id} (from a container)" in logs, logs[-4000:]
    assert not (run_dir / "requeue_requested").exists() and not (run_dir / "failure.json").exists()
    text = (run_dir / "job.sbatch").read_text()
    # the run directory's and the venv's top folders, each bound once (a clone under /tmp has its venv there too)
    binds = " ".join(f"-b {b}" for b in dict.fromkeys(["/tmp", f"/{Path(sys.prefix).parts[1]}"]))
    assert f"ch-run {binds} --set-env=CYCLONE_REQUEUE_BY=stepwatch " \
           f"--set-env=CYCLONE_CONTAINER=charliecloud --cd={run_dir} {IMAGE} -- python3 -m cyclone_kit.runtime" in text, text
    spec = json.loads((run_dir / "spec.json").read_text())["container"]
    assert (spec["runtime"], spec["image"]) == ("charliecloud", str(IMAGE)) and spec["pythonpath"]


def test_a_script_in_a_container_runs_in_its_submit_folder_on_the_images_python(jobs: dict[str, Any]) -> None:
    job_id, run_dir, info = jobs["script"]
    proj = jobs["proj"]
    assert info.state is JobState.COMPLETED, (info, _logs(run_dir)[-4000:])
    seen = [json.loads((proj / f"out-rank{r}.json").read_text()) for r in range(2)]
    print(f"script job {job_id} in the container: {seen}")
    assert {o["host"] for o in seen} == {"g1", "g2"} and {o["world"] for o in seen} == {2}
    assert {(o["cwd"], o["n"], o["version"]) for o in seen} == {(str(proj), 5, 1)}  # ./data, the sibling package
    assert {o["file"] for o in seen} == {str(proj / "train.py")}  # the snapshot runs as the script itself
    assert all(o["ch_running"] for o in seen), "Charliecloud sets CH_RUNNING in its containers"
    own = run_command(["ch-run", str(IMAGE), "--", "python3", "-c", "import sys; print(list(sys.version_info[:3]))"],
                      env={**os.environ, "USER": os.environ.get("USER") or "root"}, timeout=60).stdout
    assert {json.dumps(o["python"]) for o in seen} == {own.strip()}, "the image's own interpreter ran the script"
    starts = [json.loads(line) for line in (run_dir / "shim.jsonl").read_text().splitlines() if '"start"' in line]
    assert starts and {s["restart_count"] for s in starts} == {0}
    assert "ch-run" in (run_dir / "job.sbatch").read_text() and f"cd {proj}" in (run_dir / "job.sbatch").read_text()


def test_doctor_runs_its_probes_in_the_image(jobs: dict[str, Any], tmp_path: Path) -> None:
    """``doctor --container``: the image starts on every rank, torch imports there (after the jobs: nodes free)."""
    result = run_cli("doctor", "--profile", "local", "--partition", "cpu", "--container", str(IMAGE),
                     "--container-runtime", "charliecloud", "--runs-dir", str(tmp_path / "runs"), "--json",
                     cwd=tmp_path, timeout=300)
    checks = {c["check"]: c for c in json.loads(result.stdout)}
    print(f"doctor in the container: {checks['container']['detail']}")
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert checks["container"]["ok"] is True and "runs on 2 ranks: torch" in checks["container"]["detail"]
    assert checks["python"]["ok"] is True and "in the charliecloud image" in checks["python"]["detail"]
    assert checks["bootstrap"]["ok"] is True and checks["allreduce"]["ok"] is True
