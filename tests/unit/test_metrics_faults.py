"""Pure parts of the fault handling (issue 22): the loss encoding, the contract's type checks, whole-line
metrics appends on a full disk, and telling a full disk from other errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cyclone_kit.runtime import metrics as mx


def test_loss_encoding_round_trips_and_type_errors_name_the_field() -> None:
    from cyclone_kit.rundir import contract

    for value, text in ((float("nan"), "NaN"), (float("inf"), "Infinity"), (float("-inf"), "-Infinity")):
        assert contract.encode_loss(value) == text
        decoded = contract.decode_loss(text)
        assert decoded != decoded if text == "NaN" else decoded == value
    assert contract.encode_loss(0.5) == 0.5 and contract.encode_loss(None) is None
    assert contract.decode_loss("abc") is None and contract.decode_loss(True) is None
    assert contract.type_error(contract.step_record(3, 0, float("nan"), 0.1, 0.0, 5.0, "t")) is None
    assert contract.type_error({"kind": "step", "step": "abc"}) == "step field 'step' is 'abc', not an integer"
    assert "not a number" in contract.type_error({"kind": "step", "step": 1, "loss": "high"})
    assert "not an integer" in contract.type_error({"kind": "start", "world_size": 2.5})
    assert contract.type_error({"kind": "end", "status": 3}) == "end field 'status' is 3, not a string"


def test_a_full_disk_in_the_middle_of_a_line_leaves_no_torn_line(tmp_path: Path, monkeypatch) -> None:
    """os.write that stores half a line and then fails (ENOSPC): the half is cut off again."""
    import errno
    import os

    from cyclone_kit.core.errors import DiskFullError
    from cyclone_kit.rundir import fileio

    path = tmp_path / "metrics.jsonl"
    w = mx.MetricsWriter(path)
    w.write(mx.record("start", run_id="r"))
    real_write, calls = os.write, []

    def half_then_full(fd: int, data: bytes) -> int:
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fileio.os, "write", half_then_full)
    with pytest.raises(DiskFullError, match=r"writing metrics .*metrics.jsonl: it needs \d+ bytes"):
        w.write(mx.step_record(1, 0, 1.0, 0.1, 0.0, 5.0, mx.utc_now()))
    monkeypatch.undo()
    w.close()
    assert [json.loads(x)["kind"] for x in path.read_text().splitlines()] == ["start"]
    assert path.read_text().endswith("\n")


def test_disk_full_is_found_in_a_chained_exception() -> None:
    import errno

    from cyclone_kit.rundir.fileio import is_disk_full, size_text

    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("[enforce fail at inline_container.cc:672] unexpected pos 123") from inner
    except RuntimeError as outer:
        assert is_disk_full(outer)
    assert not is_disk_full(RuntimeError("unexpected pos"))
    assert (size_text(512), size_text(2048), size_text(3 << 20)) == ("512 bytes", "2.0 KiB", "3.0 MiB")
