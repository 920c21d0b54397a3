"""Issue 29: what a user's script sees of its launch under ``cyclone-kit run``: a one-task job runs as
``python SCRIPT`` (item 3), a failed run's records are complete (item 5), and a snapshot keeps the
script's own location (item 1)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tests.helpers.cli import REPO, jsonl_records, run_cli, run_dir_of

pytestmark = pytest.mark.slow

TIMEOUT_S = 240  # a hang guard per command, not a bound

#: nanoGPT's train.py tells a DDP run from a plain one by RANK alone, then takes cuda:LOCAL_RANK.
NANOGPT_BRANCH = textwrap.dedent("""
    import os
    ddp = int(os.environ.get('RANK', -1)) != -1
    if ddp:
        local = int(os.environ['LOCAL_RANK'])
        print(f"branch: ddp rank={os.environ['RANK']} world={os.environ['WORLD_SIZE']} local={local}")
    else:
        print("branch: single", "MASTER_ADDR" in os.environ, "MASTER_PORT" in os.environ)
""")


_run_dir, _records = run_dir_of, jsonl_records


def _branch(tmp_path: Path, *flags: str) -> str:
    script = tmp_path / "nano.py"
    script.write_text(NANOGPT_BRANCH)
    proc = run_cli("run", str(script), "--nproc", "1", "--quiet", "--runs-dir", str(tmp_path / "runs"), *flags,
                   timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = (_run_dir(proc.stdout) / "logs" / "rank-0.out").read_text()
    return next(line for line in out.splitlines() if line.startswith("branch:"))


def test_a_one_task_run_of_a_script_that_branches_on_rank_takes_its_python_script_path(tmp_path: Path) -> None:
    assert _branch(tmp_path) == "branch: single False False"  # as `python nano.py`


def test_dist_env_torchrun_gives_a_one_task_run_torchrun_s_variables(tmp_path: Path) -> None:
    assert _branch(tmp_path, "--dist-env", "torchrun") == "branch: ddp rank=0 world=1 local=0"  # as torchrun --nproc 1


def test_a_one_task_run_of_a_script_that_always_forms_a_group_gets_a_world_of_one(tmp_path: Path) -> None:
    proc = run_cli("run", str(REPO / "examples" / "plain_ddp.py"), "--nproc", "1", "--quiet", "--runs-dir",
                   str(tmp_path), "--", "--steps", "3", "--batch-size", "8", timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = _run_dir(proc.stdout)
    assert "plain_ddp: rank 0 of 1" in (run_dir / "logs" / "rank-0.out").read_text()
    end = _records(run_dir / "shim.jsonl")[-1]
    assert end["status"] == "completed" and end["process_group_world"] == 1, end


#: Rank 0 waits (for a peer that fails); rank 1 fails once rank 0 is waiting: rank 0 is stopped by the launcher.
FAILS_ON_RANK_1 = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    rank = int(os.environ["RANK"])
    ready = Path(sys.argv[1]) / "rank0-waiting"
    if rank == 0:
        ready.write_text("1")
        while True:           # a rank waiting on its peer: it never ends on its own
            time.sleep(0.05)
    while not ready.exists():
        time.sleep(0.05)
    raise RuntimeError("rank 1 fails")
""")


def test_a_failed_two_rank_run_leaves_rank_0_s_end_record(tmp_path: Path) -> None:
    script = tmp_path / "fails.py"
    script.write_text(FAILS_ON_RANK_1)
    proc = run_cli("run", str(script), "--nproc", "2", "--quiet", "--runs-dir", str(tmp_path / "runs"),
                   "--", str(tmp_path), timeout=TIMEOUT_S)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    run_dir = _run_dir(proc.stdout + proc.stderr)
    records = _records(run_dir / "shim.jsonl")
    assert [r["kind"] for r in records] == ["start", "end"], records
    end = records[-1]
    assert end["status"] == "failed" and end["exit_code"] == 143 and "SIGTERM" in end["error"], end
    failure = json.loads((run_dir / "failure.json").read_text())
    assert "rank 1 fails" in json.dumps(failure), failure  # the root cause stays rank 1's
    assert not (run_dir / "ranks" / "error-rank-0.json").exists()  # a stopped rank is not a root cause
    metrics = _records(run_dir / "metrics.jsonl")
    assert [m["kind"] for m in metrics] == ["start", "end"], metrics


def test_status_of_a_local_run_shows_its_ranks_hosts_and_wall_time_and_no_invented_job_id(tmp_path: Path) -> None:
    script = tmp_path / "two.py"
    script.write_text("print('done')\n")
    proc = run_cli("run", str(script), "--nproc", "2", "--nodes", "2", "--quiet", "--runs-dir", str(tmp_path / "runs"),
                   timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = _run_dir(proc.stdout)
    invented = (run_dir / "job_id").read_text().strip()  # the ranks' SLURM_JOB_ID: the launcher's own
    wall = json.loads((run_dir / "launch.json").read_text())["wall_time_s"]
    status = run_cli("status", str(run_dir), cwd=tmp_path)
    assert status.returncode == 0, status.stdout + status.stderr
    assert invented not in status.stdout, status.stdout
    lines = status.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("JOBID"))
    row = lines[header + 1].split(None, 5)
    assert row[:4] == ["-", "two", "COMPLETED", "2"], status.stdout
    hours, minutes, seconds = (int(x) for x in row[4].split(":"))
    assert hours * 3600 + minutes * 60 + seconds == max(1, round(wall)), (row, wall)
    assert row[5] == "2 ranks on 127.0.0.1, 127.0.0.2", status.stdout


#: Lightning's examples find their data from __file__ (backbone_image_classifier.py:
#: path.join(path.dirname(__file__), "..", "..", "Datasets")); this one also reads sys.argv[0] and a sibling.
NEXT_TO_ITSELF = textwrap.dedent("""
    import json, os, sys
    from os import path
    import helper
    data = path.join(path.dirname(__file__), "..", "..", "Datasets", "n.txt")
    beside = os.path.join(os.path.dirname(os.path.abspath(sys.argv[0])), "config.json")
    print("seen:" + json.dumps({"file": __file__, "argv0": sys.argv[0], "data": open(data).read(),
                                "config": json.load(open(beside)), "helper": helper.__file__,
                                "value": helper.VALUE, "path0": sys.path[0]}))
""")


def test_a_snapshot_keeps_what_the_script_sees_of_its_own_location_several_levels_deep(tmp_path: Path) -> None:
    project = tmp_path / "project"
    folder = project / "pl_examples" / "domain_templates" / "deep"
    folder.mkdir(parents=True)
    (project / "pl_examples" / "Datasets").mkdir()
    (project / "pl_examples" / "Datasets" / "n.txt").write_text("42")
    (folder / "config.json").write_text('{"lr": 0.1}')
    (folder / "helper.py").write_text("VALUE = 'snapshot'\n")
    script = folder / "train.py"
    script.write_text(NEXT_TO_ITSELF)
    work = tmp_path / "work"  # the job runs elsewhere: only __file__ leads to the data
    work.mkdir()
    proc = run_cli("run", str(script), "--nproc", "1", "--quiet", "--runs-dir", str(tmp_path / "runs"), cwd=work,
                   timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = _run_dir(proc.stdout)
    out = (run_dir / "logs" / "rank-0.out").read_text()
    seen = json.loads(next(line for line in out.splitlines() if line.startswith("seen:"))[5:])
    assert seen["file"] == str(script) and seen["argv0"] == str(script), seen  # as under python SCRIPT
    assert seen["data"] == "42" and seen["config"] == {"lr": 0.1}, seen
    # the code that ran is the snapshot's: its folder is sys.path[0], its siblings are imported from there
    assert seen["path0"] == str(run_dir / "script") and seen["helper"] == str(run_dir / "script" / "helper.py"), seen
    assert seen["value"] == "snapshot"


def test_a_snapshot_s_traceback_names_the_file_that_ran(tmp_path: Path) -> None:
    script = tmp_path / "src" / "boom.py"
    script.parent.mkdir()
    script.write_text("import os\nassert os.path.dirname(__file__).endswith('src')\nraise ValueError('boom')\n")
    proc = run_cli("run", str(script), "--nproc", "1", "--quiet", "--runs-dir", str(tmp_path / "runs"),
                   timeout=TIMEOUT_S)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    run_dir = _run_dir(proc.stdout + proc.stderr)
    err = (run_dir / "logs" / "rank-0.err").read_text()
    assert f'File "{run_dir / "script" / "boom.py"}", line 3' in err and "ValueError: boom" in err, err


#: A Lightning Fabric script written for `fabric run` (no `.launch()`), and one written for `python` (with it).
FABRIC = textwrap.dedent("""
    import torch
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu"{devices})
    {launch}model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    for _ in range(3):
        fabric.backward(model(torch.randn(8, 4, device=fabric.device)).sum())
        optimizer.step()
        optimizer.zero_grad()
    print(f"fabric: rank {{fabric.global_rank}} of {{fabric.world_size}} nodes {{fabric.strategy.num_nodes}}", flush=True)
""")


@pytest.mark.parametrize(("devices", "launch", "layout"), [
    ("", "", ["--nodes", "2", "--nproc", "2"]),                          # fabric run's script, 2 nodes x 1
    (", devices=2", "fabric.launch()\n", ["--nproc", "2"]),              # a python script that launches itself
])
def test_a_lightning_fabric_script_runs_on_many_ranks_unchanged(tmp_path: Path, devices: str, launch: str,
                                                                layout: list[str]) -> None:
    pytest.importorskip("lightning.fabric")
    script = tmp_path / "fab.py"
    script.write_text(FABRIC.format(devices=devices, launch=launch))
    proc = run_cli("run", str(script), *layout, "--quiet", "--runs-dir", str(tmp_path / "runs"), timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = _run_dir(proc.stdout)
    lines = sorted(line for rank in (0, 1) for line in (run_dir / "logs" / f"rank-{rank}.out").read_text().splitlines()
                   if line.startswith("fabric:"))
    nodes = 2 if "--nodes" in layout else 1
    assert lines == [f"fabric: rank 0 of 2 nodes {nodes}", f"fabric: rank 1 of 2 nodes {nodes}"], lines
