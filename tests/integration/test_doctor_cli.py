"""``cyclone-kit doctor`` refuses bad input before asking the cluster anything: one line, exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.cli import run_cli


@pytest.mark.parametrize(("args", "message"), [
    (("--profile", "nope"), "unknown profile 'nope'"),
    (("--profile", "local", "--partition", "bigmem"), "unknown partition 'bigmem'"),
    (("--profile", "local", "--nodes", "0"), "--nodes 0"),
    (("--profile", "local", "--nodes", "3"), "--nodes=3 but partition 'cpu'"),
    (("--profile", "local", "--partition", ""), "--partition is empty"),
    (("--profile", "local", "--wait-timeout", "0"), "--wait-timeout 0 is not positive"),
])
def test_bad_input_is_one_line_and_exit_2(args: tuple[str, ...], message: str, tmp_path: Path) -> None:
    out = run_cli("doctor", *args, "--runs-dir", str(tmp_path), timeout=60)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and message in out.stderr and "HINT:" in out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""
    assert not list(tmp_path.iterdir())
