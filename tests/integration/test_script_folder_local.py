"""A user's script as it is, run here with ``cyclone-kit run`` (issue 21): it works in the folder it was
started from (relative ``./data`` and ``./ckpt.pt``), a second run resumes from the first one's
checkpoint, every run runs the snapshot taken at its start (``--resume`` included) unless
``--live-code``, ``--chdir`` moves the working directory, a world of 2 that never forms a process
group is reported as 2 independent copies, and one that does is not."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tests.helpers.cli import run_cli

#: A script in the published pattern: relative ./data and ./ckpt.pt, a sibling package, no cyclone_kit.
SCRIPT = textwrap.dedent("""
    import os
    from pathlib import Path

    import helpers

    rank = int(os.environ["RANK"])
    n = int(Path("./data/n.txt").read_text())
    ckpt = Path("./ckpt.pt")
    # rank 0 resumes from the last run's checkpoint (the ranks do not meet: no other rank may look)
    done = (int(ckpt.read_text()) if ckpt.exists() else 0) if rank == 0 else None
    Path(f"./out-rank{rank}.json").write_text(
        f'{{"cwd": "{os.getcwd()}", "file": "{__file__}", "version": {helpers.VERSION}, "done": {done or 0}, "n": {n}}}')
    if rank == 0:
        ckpt.write_text(str(done + n))
""")


def _project(folder: Path, version: int = 1) -> Path:
    """A project folder: train.py, its helpers package and ./data."""
    (folder / "data").mkdir(parents=True, exist_ok=True)
    (folder / "data" / "n.txt").write_text("5\n")
    (folder / "helpers").mkdir(exist_ok=True)
    (folder / "helpers" / "__init__.py").write_text(f"VERSION = {version}\n")
    (folder / "train.py").write_text(SCRIPT)
    return folder


def _run(cwd: Path, *argv: str) -> tuple[str, Path]:
    proc = run_cli("run", *argv, "--runs-dir", str(cwd / "runs"), cwd=cwd, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("run dir: ") == 1 and proc.stdout.count("starting ") == 1, proc.stdout
    run_dir = Path(next(line for line in proc.stdout.splitlines() if line.startswith("run dir: "))[9:])
    return proc.stdout, run_dir


def _outs(folder: Path) -> list[dict]:
    return [json.loads((folder / f"out-rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.timeout(600)
def test_a_script_runs_in_its_folder_from_its_snapshot_and_resumes(tmp_path: Path) -> None:
    proj = _project(tmp_path / "proj")
    stdout, first = _run(proj, "train.py", "--nproc", "2")
    outs = _outs(proj)
    print(f"first run: {outs}")
    assert [(o["cwd"], o["version"], o["n"]) for o in outs] == [(str(proj), 1, 5)] * 2 and outs[0]["done"] == 0
    assert {o["file"] for o in outs} == {str(first / "script" / "train.py")}  # the snapshot ran
    assert sorted(str(p.relative_to(first / "script")) for p in (first / "script").rglob("*.py")) == [
        "helpers/__init__.py", "train.py"]
    assert (proj / "ckpt.pt").read_text() == "5" and not (first / "ckpt.pt").exists()
    assert (first / "logs" / "rank-0.out").exists()  # logs and records stay in the run directory
    # two ranks that never formed a process group: said by the shim's end record, run and status
    end = [json.loads(x) for x in (first / "shim.jsonl").read_text().splitlines()][-1]
    assert end["warning"].startswith("2 ranks ran as 2 independent copies") and end["process_group_world"] is None
    assert "warning: 2 ranks ran as 2 independent copies" in stdout
    status = run_cli("status", str(first), cwd=proj)
    assert "2 ranks ran as 2 independent copies" in status.stdout, status.stdout + status.stderr
    # a binary file in logs/ (TensorBoard's, say) is named by `logs`, not dumped
    (first / "logs" / "events.out.tfevents.1").write_bytes(b"\x18\x00\x00\x00\x00\x00\x00\x00\xa3\x7f brain.Event:2")
    logs = run_cli("logs", str(first), cwd=proj)
    assert "==> logs/events.out.tfevents.1 <== binary file (24 bytes), not shown" in logs.stdout, logs.stdout
    assert "\x00" not in logs.stdout and "==> logs/rank-0.err <==" in logs.stdout

    # a second run from the same folder resumes from the first one's checkpoint
    _run(proj, "train.py", "--nproc", "2")
    assert _outs(proj)[0]["done"] == 5 and (proj / "ckpt.pt").read_text() == "10"

    # the code changes; --resume of the first run runs what was submitted then, --live-code what is there now
    (proj / "helpers" / "__init__.py").write_text("VERSION = 2\n")
    _run(proj, "--resume", str(first), "--nproc", "2")
    assert [o["version"] for o in _outs(proj)] == [1, 1]
    _, live = _run(proj, "train.py", "--nproc", "2", "--live-code")
    outs = _outs(proj)
    assert [o["version"] for o in outs] == [2, 2] and {o["file"] for o in outs} == {str(proj / "train.py")}
    spec = json.loads((live / "spec.json").read_text())["script"]
    assert (spec["live"], spec["chdir"]) == (True, str(proj))


@pytest.mark.timeout(300)
def test_chdir_moves_the_working_directory(tmp_path: Path) -> None:
    proj = _project(tmp_path / "proj")
    elsewhere = _project(tmp_path / "elsewhere")
    (elsewhere / "train.py").unlink()
    _run(tmp_path, str(proj / "train.py"), "--nproc", "2", "--chdir", str(elsewhere))
    assert [o["cwd"] for o in _outs(elsewhere)] == [str(elsewhere)] * 2 and (elsewhere / "ckpt.pt").exists()
    assert not (proj / "ckpt.pt").exists()


@pytest.mark.timeout(300)
def test_a_snapshot_over_its_bound_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    proj = _project(tmp_path / "proj")
    for i in range(401):
        (proj / f"mod{i}.py").write_text("x = 1\n")
    proc = run_cli("run", "train.py", "--nproc", "1", "--runs-dir", str(proj / "runs"), cwd=proj)
    assert proc.returncode == 2 and "more than 400 Python files" in proc.stderr and "--live-code" in proc.stderr
    assert "Traceback" not in proc.stderr and not (proj / "runs").exists()


@pytest.mark.timeout(600)
def test_a_process_group_of_the_launched_world_is_not_flagged_even_when_destroyed(tmp_path: Path) -> None:
    (tmp_path / "pg.py").write_text(textwrap.dedent("""
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method="env://")
        dist.barrier()
        dist.destroy_process_group()   # gone before the script ends: the shim noted it when it was formed
    """))
    stdout, run_dir = _run(tmp_path, "pg.py", "--nproc", "2")
    end = [json.loads(x) for x in (run_dir / "shim.jsonl").read_text().splitlines()][-1]
    assert (end["status"], end["process_group_world"], end.get("warning")) == ("completed", 2, None)
    assert "independent copies" not in stdout
