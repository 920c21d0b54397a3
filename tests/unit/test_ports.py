"""MASTER_PORT picking (cyclone_kit/ports.py): the job's own port unless taken, then the next free one."""

from __future__ import annotations

import socket
import subprocess
import sys

from cyclone_kit.core.ports import candidate_ports, main, pick_port


def test_candidates_start_at_the_jobs_port_and_wrap_around_the_range() -> None:
    assert list(candidate_ports(15000, 4, 6)) == [15002, 15003, 15000, 15001]


def test_pick_port_skips_taken_ports_and_falls_back_to_the_jobs_port() -> None:
    taken = {15002, 15003}
    assert pick_port(15000, 4, 6, free=lambda p: p not in taken) == 15000
    assert pick_port(15000, 4, 6, free=lambda p: False) == 15002  # nothing free: the job's own port


def test_two_jobs_16000_apart_on_one_node_get_different_ports() -> None:
    """The collision the plain formula had: job ids 16000 apart map to the same port."""
    with socket.socket() as held:
        first = pick_port(15000, 16000, 123)
        held.bind(("", first))
        held.listen()
        second = int(subprocess.run([sys.executable, "-m", "cyclone_kit.core.ports", "15000", "16000", str(123 + 16000)],
                                    capture_output=True, text=True, check=True, timeout=30).stdout)
    assert first == 15123 or first > 15123  # 15123 unless something on this host holds it
    assert second != first and 15000 <= second < 31000


def test_bad_arguments_are_one_line_and_exit_2(capsys) -> None:
    assert main(["15000", "x", "1"]) == 2
    assert main(["100", "10", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and "HINT:" in err
