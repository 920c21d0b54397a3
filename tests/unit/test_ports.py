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
