"""User scripts through ``cyclone-kit run SCRIPT --nproc 2``: real rank processes, the launch shim,
the examples unchanged, root cause first when a script fails, a time-to-solution sweep report."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import re
import textwrap
from pathlib import Path

import pytest

from cyclone_kit.config.script import sha256_hex
from tests.helpers.cli import REPO, jsonl_records, run_cli, run_dir_of

pytestmark = pytest.mark.slow

EXAMPLES = REPO / "examples"
TIMEOUT_S = 240  # a hang guard per command (>= 5x the slowest seen on 2 busy cores, ~40 s), not a bound


_run_dir, _records = run_dir_of, jsonl_records


def _rank_lines(run_dir: Path, prefix: str) -> list[str]:
    return [line for p in sorted((run_dir / "logs").glob("rank-*.out"))
            for line in p.read_text().splitlines() if line.startswith(f"{prefix}: rank ")]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


def test_plain_ddp_runs_unchanged_with_two_ranks_and_leaves_shim_records(tmp_path: Path) -> None:
    script = EXAMPLES / "plain_ddp.py"
    proc = run_cli("run", str(script), "--nproc", "2", "--quiet", "--runs-dir", str(tmp_path),
                   "--", "--steps", "6", "--batch-size", "16", timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = _run_dir(proc.stdout)
    lines = _rank_lines(run_dir, "plain_ddp")
    assert sorted(re.search(r"rank (\d) of (\d)", x).groups() for x in lines) == [("0", "2"), ("1", "2")], lines
    # the run directory: spec with the script's hash, a copy of it, the shim's start/end records
    spec = json.loads((run_dir / "spec.json").read_text())
    assert spec["script"]["path"] == str(script) and spec["script"]["args"] == ["--steps", "6", "--batch-size", "16"]
    assert spec["script"]["sha256"] == sha256_hex(script.read_bytes()) and "train" not in spec
    assert (run_dir / "script" / "plain_ddp.py").read_bytes() == script.read_bytes()
    start, end = _records(run_dir / "shim.jsonl")
    assert (start["kind"], start["world_size"], start["script"], start["sha256"]) == (
        "start", 2, str(run_dir / "script" / "plain_ddp.py"), spec["script"]["sha256"])  # the snapshot ran
    assert (end["kind"], end["status"], end["exit_code"]) == ("end", "completed", 0) and end["wall_time_s"] > 0
    # no ck.log_step in the script: the metrics contract gets a time-to-solution pair
    head, tail = _records(run_dir / "metrics.jsonl")
    assert (head["strategy"], head["world_size"], tail["status"]) == ("time-to-solution", 2, "completed")
    assert tail["samples_per_s"] == pytest.approx(1 / end["wall_time_s"])


def test_a_module_runs_with_python_m_semantics(tmp_path: Path) -> None:
    pkg = tmp_path / "src" / "mypkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "helper.py").write_text("VALUE = 7\n")
    (pkg / "train.py").write_text(textwrap.dedent("""
        import os, sys
        from mypkg.helper import VALUE
        assert __name__ == "__main__"
        print(f"mod: rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} argv {sys.argv[1:]} value {VALUE}")
    """))
    env = {"PYTHONPATH": f"{tmp_path / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = run_cli("run", "-m", "mypkg.train", "--nproc", "2", "--quiet", "--runs-dir", str(tmp_path / "runs"),
                   "--", "a", "b c", env=env, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = _run_dir(proc.stdout)
    lines = sorted(_rank_lines(run_dir, "mod"))
    assert lines == ["mod: rank 0 of 2 argv ['a', 'b c'] value 7", "mod: rank 1 of 2 argv ['a', 'b c'] value 7"]
    assert (run_dir / "script" / "train.py").is_file()


@pytest.mark.parametrize(("example", "module", "args"), [
    ("lightning_example.py", "lightning", ["--max-steps", "4"]),
    ("accelerate_example.py", "accelerate", ["--steps", "4"]),
])
def test_framework_examples_run_unchanged_with_two_ranks(example: str, module: str, args: list[str],
                                                         tmp_path: Path) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install '.[dev]' brings it)")
    proc = run_cli("run", str(EXAMPLES / example), "--nproc", "2", "--quiet", "--runs-dir", str(tmp_path),
                   "--", *args, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = _rank_lines(_run_dir(proc.stdout), example[:-3])
    assert sorted(re.search(r"rank (\d) of (\d)", x).groups() for x in lines) == [("0", "2"), ("1", "2")], lines


def test_horovod_example_meets_through_the_shims_gloo_rendezvous(tmp_path: Path) -> None:
    try:
        import horovod.torch  # noqa: F401
    except Exception as exc:
        pytest.skip(f"Horovod not importable ({type(exc).__name__}); build it with scripts/build-horovod.sh")
    proc = run_cli("run", str(EXAMPLES / "horovod_example.py"), "--nproc", "2", "--horovod", "--quiet",
                   "--runs-dir", str(tmp_path), "--", "--steps", "4", timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = _rank_lines(_run_dir(proc.stdout), "horovod_example")
    assert sorted(re.search(r"rank (\d) of (\d)", x).groups() for x in lines) == [("0", "2"), ("1", "2")], lines


# Both ranks meet once; then rank 1 fails its own way while rank 0 waits for ever (only the launcher
# can end it: no clock in the test, no race with rank 0 failing by itself).
FAILING = textwrap.dedent("""
    import os, signal, sys, threading
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method="env://")
    dist.barrier()
    if dist.get_rank() == 1:
        how = sys.argv[1]
        if how == "raise":
            raise ValueError("boom on rank one")
        if how == "exit3":
            sys.exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Event().wait()
    print("rank 0 stopped waiting: must not happen")
""")


@pytest.mark.parametrize(("how", "first_line"), [
    ("raise", r"error: rank 1 on host localhost \(pid \d+\) exit code 1 after [\d.]+ s: ValueError: boom on rank one"),
    ("exit3", r"error: rank 1 on host localhost \(pid \d+\) exit code 3 after [\d.]+ s: ScriptExit: .*sys.exit\(3\)"),
    ("kill", r"error: rank 1 on host localhost \(pid \d+\) killed by SIGKILL after [\d.]+ s$"),
])
def test_a_failing_script_reports_the_root_cause_first_and_leaves_no_rank(how: str, first_line: str,
                                                                           tmp_path: Path) -> None:
    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    proc = run_cli("run", str(script), "--nproc", "2", "--quiet", "--runs-dir", str(tmp_path / "runs"), "--", how,
                   timeout=TIMEOUT_S)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert re.match(first_line, proc.stderr.splitlines()[0]), proc.stderr
    run_dir = _run_dir(proc.stdout)
    failure = json.loads((run_dir / "failure.json").read_text())
    assert failure["rank"] == 1 and failure["cause"] == "rank_failed"
    assert all(r["stopped_by_launcher"] for r in failure["ranks"] if r["rank"] == 0)
    if how == "raise":
        assert any("ValueError: boom on rank one" in line for line in failure["stderr_tail"])
    pids = [r["pid"] for r in json.loads((run_dir / "launch.json").read_text())["ranks"]]
    assert not [pid for pid in pids if _alive(pid)]
    assert "must not happen" not in (run_dir / "logs" / "rank-0.out").read_text()
    shim = _records(run_dir / "shim.jsonl")  # rank 0's: it may have been stopped before it could end
    assert shim[0]["kind"] == "start" and all(r["status"] == "failed" for r in shim[1:])


def test_strong_sweep_of_a_script_reports_time_to_solution(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep.toml"
    sweep.write_text(textwrap.dedent(f"""
        [sweep]
        name = "tts"
        mode = "strong"
        global_batch_size = 128
        world_sizes = [1, 2]

        [base]
        name = "tts"
        [base.script]
        path = {json.dumps(str(EXAMPLES / "plain_ddp.py"))}
        args = ["--steps", "4", "--batch-size", "{{per_device_batch_size}}"]
        [base.resources]
        profile = "local"
    """))
    proc = run_cli("sweep", str(sweep), "--backend", "local", "--quiet", "--runs-dir", str(tmp_path / "runs"),
                   timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    study = Path(re.search(r"^study dir: (.+)$", proc.stdout, re.MULTILINE).group(1))
    with open(study / "report" / "scaling.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["world_size"], r["per_device_batch_size"], r["global_batch_size"], r["strategy"]) for r in rows] == [
        ("1", "128", "128", "time-to-solution"), ("2", "64", "128", "time-to-solution")]
    walls = {}
    for point in json.loads((study / "sweep.json").read_text())["points"]:
        end = _records(study / point["run_dir"] / "shim.jsonl")[-1]
        walls[point["world_size"]] = end["wall_time_s"]
        args = json.loads((study / point["run_dir"] / "spec.json").read_text())["script"]["args"]
        assert args == ["--steps", "4", "--batch-size", str(128 // point["world_size"])]
    assert "Time to solution: the script logged no steps" in (study / "report" / "report.md").read_text()
    speedup = float(rows[1]["speedup"])
    assert speedup == pytest.approx(walls[1] / walls[2], rel=1e-3)  # T(N0) / T(N) of the whole script


def test_the_time_limit_warning_signal_does_not_kill_a_script_that_ignores_it(tmp_path: Path) -> None:
    script = tmp_path / "ignores.py"
    script.write_text(textwrap.dedent("""
        import os, signal
        os.kill(os.getpid(), signal.SIGUSR2)   # what Slurm's --signal=USR2@LEAD delivers
        print("still running after SIGUSR2")
    """))
    proc = run_cli("run", str(script), "--nproc", "1", "--quiet", "--runs-dir", str(tmp_path / "runs"),
                   timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = _run_dir(proc.stdout)
    assert "still running after SIGUSR2" in (run_dir / "logs" / "rank-0.out").read_text()
    assert "SIGUSR2 received" in (run_dir / "logs" / "rank-0.err").read_text()
