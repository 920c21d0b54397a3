"""The public API's pure parts: lazy re-export, misuse before init, the run's spec settings, the loss mean.

The API in real processes (process groups, signals, checkpoints) is tests/integration/test_api.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

import cyclone_kit as ck
from cyclone_kit import api
from cyclone_kit.core.errors import CycloneError, ValidationError


def test_the_api_names_are_reexported() -> None:
    for name in ("init", "load_checkpoint", "log_step", "stop_requested", "save_checkpoint", "finish", "Context",
                 "ApiUsageError"):
        assert getattr(ck, name) is getattr(api, name) and name in dir(ck)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        ck.nope  # noqa: B018


@pytest.mark.parametrize("call", [
    lambda: ck.log_step(1, samples=4),
    lambda: ck.stop_requested(),
    lambda: ck.save_checkpoint({"a": 1}),
    lambda: ck.load_checkpoint(),
    lambda: ck.finish(),
])
def test_every_call_before_init_is_a_one_line_usage_error(call: Callable[[], object]) -> None:
    with pytest.raises(ck.ApiUsageError) as err:
        call()
    assert isinstance(err.value, CycloneError) and err.value.exit_code == 2
    text = str(err.value)
    assert "before ck.init()" in text and "HINT: call ctx = ck.init()" in text and "\n" not in text


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "10"])
def test_init_refuses_a_bad_log_every_before_touching_anything(bad: object) -> None:
    with pytest.raises(ck.ApiUsageError, match="must be a positive int"):
        ck.init(log_every=bad)  # type: ignore[arg-type]
    assert api._run is None


def test_spec_settings_come_from_the_run_dirs_spec(tmp_path: Path) -> None:
    cc, every = api._spec_settings(tmp_path)
    assert (cc.keep, cc.signal, cc.poll_s, every) == (2, "USR2", 0.5, None)  # no spec.json: the defaults
    (tmp_path / "spec.json").write_text(json.dumps({"name": "x", "train": {"log_every": 3},
                                                    "checkpoint": {"keep": 5, "signal": "USR1", "poll_s": 0}}))
    cc, every = api._spec_settings(tmp_path)
    assert (cc.keep, cc.signal, cc.poll_s, every) == (5, "USR1", 0, 3)
    (tmp_path / "spec.json").write_text(json.dumps({"script": {"log_every": 7}}))
    assert api._spec_settings(tmp_path)[1] == 7


@pytest.mark.parametrize(("content", "message"), [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a table"),
    (json.dumps({"checkpoint": {"keep": 0}}), "checkpoint.keep"),
    (json.dumps({"checkpoint": {"signal": "KILL"}}), "checkpoint.signal"),
])
def test_a_bad_spec_is_a_validation_error(tmp_path: Path, content: str, message: str) -> None:
    (tmp_path / "spec.json").write_text(content)
    with pytest.raises(ValidationError, match=message):
        api._spec_settings(tmp_path)


def test_mean_loss_of_floats_and_tensors() -> None:
    import torch

    assert api._mean_loss([]) is None
    assert api._mean_loss([1.0, 3.0]) == 2.0
    assert api._mean_loss([torch.tensor(1.0), torch.tensor([3.0]), 2]) == pytest.approx(2.0)


def test_log_every_from_the_environment() -> None:
    assert api._env_log_every({}) is None and api._env_log_every({"CYCLONE_LOG_EVERY": " 3 "}) == 3
    for bad in ("0", "-2", "x", "1.5"):
        with pytest.raises(ValidationError, match="CYCLONE_LOG_EVERY"):
            api._env_log_every({"CYCLONE_LOG_EVERY": bad})
