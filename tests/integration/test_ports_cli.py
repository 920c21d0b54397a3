"""``python -m cyclone_kit.core.ports`` as the sbatch script runs it, in a real interpreter."""

from __future__ import annotations

import socket
import subprocess
import sys

from cyclone_kit.core.ports import pick_port


def test_two_jobs_16000_apart_on_one_node_get_different_ports() -> None:
    """The collision the plain formula had: job ids 16000 apart map to the same port."""
    with socket.socket() as held:
        first = pick_port(15000, 16000, 123)
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as pick_port probes: a TIME_WAIT port is free
        held.bind(("", first))
        held.listen()
        second = int(subprocess.run([sys.executable, "-m", "cyclone_kit.core.ports", "15000", "16000", str(123 + 16000)],
                                    capture_output=True, text=True, check=True, timeout=30).stdout)
    assert first == 15123 or first > 15123  # 15123 unless something on this host holds it
    assert second != first and 15000 <= second < 31000
