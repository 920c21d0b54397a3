"""cyclone_kit.core.proc.run_command against real processes (no mocks: sh, true, false, sleep)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from cyclone_kit.core.errors import CommandError, CommandNotFound, CycloneError
from cyclone_kit.core.proc import run_command


def test_captures_stdout_stderr_and_status() -> None:
    result = run_command(["sh", "-c", "echo out; echo err >&2"])
    assert (result.returncode, result.stdout, result.stderr, result.ok) == (0, "out\n", "err\n", True)
    assert result.argv == ("sh", "-c", "echo out; echo err >&2")
    assert result.duration_s >= 0


def test_nonzero_exit_raises_with_everything() -> None:
    with pytest.raises(CommandError) as info:
        run_command(["sh", "-c", "echo partial; echo 'sbatch: error: invalid partition' >&2; exit 3"])
    err = info.value
    assert (err.returncode, err.stdout, err.stderr) == (3, "partial\n", "sbatch: error: invalid partition\n")
    assert err.argv[0] == "sh"
    text = str(err)
    assert "exited 3" in text and "invalid partition" in text and "HINT:" in text and "\n" not in text


def test_check_false_returns_the_failure() -> None:
    result = run_command(["false"], check=False)
    assert result.returncode == 1 and not result.ok


def test_missing_program_is_command_not_found() -> None:
    with pytest.raises(CommandNotFound) as info:
        run_command(["cyclone-kit-no-such-program", "--x"])
    assert isinstance(info.value, CycloneError)
    assert "cyclone-kit-no-such-program" in str(info.value) and "HINT:" in str(info.value)


#: The grandchild's sleep: it can only end early because the timeout killed it (issue 12: an event,
#: not a bound on how fast this machine kills processes).
LONG_SLEEP_S = 3600
#: Hang guard (not a performance bound) for the grandchild to disappear; it takes milliseconds.
HANG_S = 60


def test_timeout_kills_the_whole_process_group(tmp_path: Path) -> None:
    marker = tmp_path / "child.pid"
    started = time.monotonic()
    with pytest.raises(CommandError) as info:
        # The shell starts a grandchild; a timeout must not leave it running.
        # 5 s: time for the shell to start its grandchild and say its pid even on a loaded machine
        run_command(["sh", "-c", f"sleep {LONG_SLEEP_S} & echo $! > {marker}; wait"], timeout=5)
    assert time.monotonic() - started < LONG_SLEEP_S  # ended by the timeout, not by the sleep
    assert "timed out" in str(info.value) and info.value.returncode is None
    child = int(marker.read_text())
    deadline = time.monotonic() + HANG_S
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        # a zombie until its parent is reaped: check its state
        stat = Path(f"/proc/{child}/stat")
        if not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"grandchild {child} still running after the timeout")


def test_input_env_and_cwd(tmp_path: Path) -> None:
    result = run_command(
        ["sh", "-c", 'read line; echo "$line $CK_TEST_VAR $(pwd)"'],
        input="hello\n",
        env={"CK_TEST_VAR": "value"},
        cwd=tmp_path,
    )
    assert result.stdout.strip() == f"hello value {tmp_path}"
    assert "PATH" in os.environ  # env is merged over the environment, so sh was still found


def test_missing_cwd_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CommandError) as info:
        run_command(["true"], cwd=tmp_path / "nope")
    assert "does not exist" in str(info.value)


def test_empty_argv() -> None:
    with pytest.raises(CommandError):
        run_command([])


def test_undecodable_output_does_not_crash() -> None:
    result = run_command(["printf", "\\377ok"])
    assert result.stdout.endswith("ok")
