"""Issue 29 item 5: the launch shim's SIGTERM handler is installed only where it changes nothing but the record."""

from __future__ import annotations

import signal

import pytest

from cyclone_kit.runtime.launch import end_on_sigterm


@pytest.fixture()
def restore_sigterm():
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


def test_installed_under_the_local_launcher_where_sigterm_has_its_default_action(restore_sigterm: None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    assert end_on_sigterm(lambda code, error: None, {"CYCLONE_LAUNCHER": "local"}) is True
    assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None)


@pytest.mark.parametrize("environ", [{}, {"CYCLONE_LAUNCHER": "slurm"}, {"CYCLONE_LAUNCHER": "torchrun"}])
def test_not_installed_outside_the_local_launcher(restore_sigterm: None, environ: dict) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    assert end_on_sigterm(lambda code, error: None, environ) is False
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_handler_already_there_is_kept(restore_sigterm: None) -> None:
    def own(signum: int, frame: object) -> None:
        pass

    signal.signal(signal.SIGTERM, own)
    assert end_on_sigterm(lambda code, error: None, {"CYCLONE_LAUNCHER": "local"}) is False
    assert signal.getsignal(signal.SIGTERM) is own
