"""cyclone_kit.core.prefork: ranks forked from one process that imported torch become the caller's own
children, each with its own environment, session, working directory, descriptors and exit status, as
``subprocess.Popen`` would start them (the local launcher's trainer ranks are started this way).

That ``cyclone-kit run`` forks the trainer's ranks (``launch.json``: ``"forked": true``) and starts them
afresh under ``CYCLONE_PREFORK=0`` is held by bench/rank_start.py, which refuses a launch whose record says
otherwise, in test_bench_smoke."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cyclone_kit.core import prefork
from tests.helpers.ranks import REPO, alive
from tests.helpers.slurm_jobs import wait_for

PROBE = REPO / "tests" / "helpers" / "prefork_probe.py"
#: Hang guard (not a performance bound): the zygote imports torch (~5 s on a busy 2-core machine).
HANG_S = 300


def _starts(tmp_path: Path, ends: list[str], **env: str) -> tuple[list[prefork.RankStart], list[tuple[int, int]]]:
    pipes = [os.pipe() for _ in ends]
    base = {**os.environ, "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": "", **env}
    starts = [prefork.RankStart(args=("--probe", str(rank)), env={**base, "RANK": str(rank), "PROBE_END": end},
                                script=str(PROBE), cwd=str(tmp_path), stdout=out_w, stderr=out_w)
              for rank, (end, (_, out_w)) in enumerate(zip(ends, pipes, strict=True))]
    return starts, pipes


def _read(pipes: list[tuple[int, int]]) -> list[list[str]]:
    """Each rank's output until every process holding its pipe closed it (the other ranks included)."""
    outs = []
    for read_end, _ in pipes:
        with os.fdopen(read_end, "rb") as f:
            outs.append(f.read().decode().splitlines())
    return outs


@pytest.mark.timeout(HANG_S + 60)
def test_forked_ranks_are_this_process_s_children_with_their_own_environment_and_status(tmp_path: Path) -> None:
    go = tmp_path / "go"
    starts, pipes = _starts(tmp_path, ["exit:0", "exit:3", "signal:SIGTERM", "wait"], PROBE_GO=str(go))
    procs = prefork.spawn(starts)
    for _, write_end in pipes:
        os.close(write_end)
    assert procs is not None, "no fork server on this Linux machine"
    assert procs[3].poll() is None and procs[3].returncode is None
    stat = Path(f"/proc/{procs[3].pid}/stat").read_text()
    assert int(stat[stat.rfind(")") + 2:].split()[1]) == os.getpid(), "the caller's child (it was the zygote's)"
    go.touch()
    # waitpid answers for each: they are the caller's children (os.waitpid fails on any other process)
    assert [p.wait(timeout=HANG_S) for p in procs] == [0, 3, -signal.SIGTERM, 0]
    outs = _read(pipes)
    facts = [json.loads(lines[0]) for lines in outs]
    for rank, (fact, lines) in enumerate(zip(facts, outs, strict=True)):
        assert fact["preloaded"] is True, "torch was imported once, before the fork"
        assert fact["rank"] == str(rank) and fact["name"] == "__main__"
        assert fact["sid"] == fact["pgid"] == fact["pid"] != os.getsid(0), "a session of its own, as start_new_session"
        assert fact["argv"] == [str(PROBE), "--probe", str(rank)] and fact["cwd"] == str(tmp_path)
        assert fact["fds"] == [0, 1, 2, 3], "no other rank's descriptor (3: the listing's own)"
        assert fact["stdin"] == "", "stdin is /dev/null"
        assert lines[1] == f"stderr of rank {rank}"
    assert len({f["pid"] for f in facts}) == 4
    assert procs[0].wait() == 0 and procs[0].poll() == 0, "the status stays known"


def test_a_module_runs_as_python_dash_m_would_run_it(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "__main__.py").write_text("import os, sys\nprint(__name__, sys.argv[1:], sys.path[0] == os.getcwd())\n"
                                         "sys.exit(int(sys.argv[1]))\n")
    read_end, write_end = os.pipe()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(tmp_path)}
    procs = prefork.spawn([prefork.RankStart(args=("7",), env=env, module="pkg", cwd=str(tmp_path), stdout=write_end,
                                             stderr=write_end)], preload=("json",))
    os.close(write_end)
    assert procs is not None
    assert procs[0].wait(timeout=HANG_S) == 7
    with os.fdopen(read_end) as f:
        assert f.read().split("\n")[0] == "__main__ ['7'] True"


def test_no_fork_where_it_is_turned_off_or_a_gpu_is_visible_or_the_zygote_cannot_start(tmp_path: Path) -> None:
    starts, pipes = _starts(tmp_path, ["exit:0"])
    assert prefork.spawn(starts, python=str(tmp_path / "no-python")) is None
    off, _ = _starts(tmp_path, ["exit:0"], CYCLONE_PREFORK="0")
    assert prefork.spawn(off) is None and not prefork.enabled({"CYCLONE_PREFORK": "off", "CUDA_VISIBLE_DEVICES": ""})
    for read_end, write_end in pipes:
        os.close(read_end)
        os.close(write_end)
    dev = tmp_path / "dev"
    dev.mkdir()
    assert prefork.sees_no_gpu({}, dev=str(dev))
    (dev / "nvidiactl").touch()
    assert prefork.sees_no_gpu({}, dev=str(dev)), "the control file alone is no GPU"
    (dev / "nvidia0").touch()
    assert not prefork.sees_no_gpu({}, dev=str(dev)) and not prefork.sees_no_gpu({"CUDA_VISIBLE_DEVICES": "0"}, dev=str(dev))
    assert prefork.sees_no_gpu({"CUDA_VISIBLE_DEVICES": ""}, dev=str(dev))
    assert prefork.sees_no_gpu({"CUDA_VISIBLE_DEVICES": "-1"}, dev=str(dev))


def test_a_forked_child_whose_caller_never_learned_its_pid_exits_without_running(tmp_path: Path) -> None:
    """The zygote's protocol when the caller is interrupted before it holds the pids: it closes the go pipe
    without a byte, and every forked child exits before it runs anything of its rank (no output)."""
    go_read, go_write = os.pipe()
    out_read, out_write = os.pipe()
    rank = {"module": None, "script": str(PROBE), "args": [], "cwd": str(tmp_path), "stdout": out_write,
            "stderr": out_write, "stdin": None, "new_session": True,
            "env": {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PROBE_END": "exit:0"}}
    zygote = subprocess.Popen([sys.executable, "-m", "cyclone_kit.core.prefork"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, pass_fds=(go_read, out_write), cwd=REPO)
    answer, _ = zygote.communicate(json.dumps({"preload": [], "go": go_read, "ranks": [rank, rank]}).encode(),
                                   timeout=HANG_S)
    os.close(go_read)
    os.close(out_write)
    pids = json.loads(answer)
    assert zygote.returncode == 0 and len(pids) == 2
    os.close(go_write)  # the caller "was interrupted": no byte
    with os.fdopen(out_read, "rb") as f:
        assert f.read() == b"", "a child ran its rank"
    wait_for(lambda: not any(alive(pid) for pid in pids), HANG_S, "the children to exit")
