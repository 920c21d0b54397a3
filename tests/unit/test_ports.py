"""MASTER_PORT picking (cyclone_kit/ports.py): the job's own port unless taken, then the next free one."""

from __future__ import annotations

from cyclone_kit.core.ports import candidate_ports, main, pick_port


def test_candidates_start_at_the_jobs_port_and_wrap_around_the_range() -> None:
    assert list(candidate_ports(15000, 4, 6)) == [15002, 15003, 15000, 15001]


def test_pick_port_skips_taken_ports_and_falls_back_to_the_jobs_port() -> None:
    taken = {15002, 15003}
    assert pick_port(15000, 4, 6, free=lambda p: p not in taken) == 15000
    assert pick_port(15000, 4, 6, free=lambda p: False) == 15002  # nothing free: the job's own port




def test_bad_arguments_are_one_line_and_exit_2(capsys) -> None:
    assert main(["15000", "x", "1"]) == 2
    assert main(["100", "10", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and "HINT:" in err


def test_a_port_in_time_wait_is_free_and_one_with_a_listener_is_not() -> None:
    """A requeued job's own port, held only by its last segment's closed connections, is taken again
    (as TCPStore's SO_REUSEADDR bind can); a live listener still makes it busy."""
    import socket

    from cyclone_kit.core.ports import can_bind

    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert not can_bind(port)
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = listener.accept()
        accepted.close()  # the server side closes first: its end of the connection is in TIME_WAIT
        client.close()
    assert can_bind(port)


def test_a_local_runs_port_is_below_the_kernels_ephemeral_range_and_free() -> None:
    """The local launcher's MASTER_PORT: a real listener holds the first candidate, so the next one is taken; every
    pick lies in [PORT_BASE, PORT_BASE + PORT_SPAN), below the ports the kernel hands out by itself (read from
    /proc where there is one), and the search starts at a different place for each run."""
    import socket
    from pathlib import Path

    from cyclone_kit.backends.local_env import free_port
    from cyclone_kit.core.ports import PORT_BASE, PORT_SPAN, can_bind, free_local_port

    low = Path("/proc/sys/net/ipv4/ip_local_port_range")
    ephemeral = int(low.read_text().split()[0]) if low.exists() else 32768
    assert ephemeral >= PORT_BASE + PORT_SPAN
    first = PORT_BASE + 1234
    with socket.socket() as listener:
        try:
            listener.bind(("", first))
        except OSError:  # some program holds it already: busy either way
            pass
        else:
            listener.listen()
        assert not can_bind(first)
        pick = free_local_port(start=1234)
        assert pick != first and (pick == first + 1 or not can_bind(first + 1)), pick
    picks = {free_port() for _ in range(20)}
    assert all(PORT_BASE <= p < PORT_BASE + PORT_SPAN for p in picks), picks
    assert len(picks) > 1, "every run would try the same port first"
