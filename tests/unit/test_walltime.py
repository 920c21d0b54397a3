"""Slurm wall-time parsing: every accepted form, the refusals, and a round-trip property."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cyclone_kit.core.errors import ValidationError
from cyclone_kit.slurm.walltime import format_time, parse_time


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30", 1800),
        ("90", 5400),
        ("30:15", 1815),
        ("01:00:00", 3600),
        ("24:00:00", 86400),
        ("1-0", 86400),
        ("1-02", 93600),
        ("1-02:30", 95400),
        ("2-00:00:01", 172801),
        ("0-00:01:00", 60),
    ],
)
def test_accepted_forms(text, seconds):
    assert parse_time(text) == seconds


@pytest.mark.parametrize("text", ["", "abc", "1:2:3:4", "00:61", "01:60:00", "1-25", "1-1:70", "-5", "0", "00:00:00",
                                  "1h", "12.5", " ", "1-", "::"])
def test_refused_forms(text):
    with pytest.raises(ValidationError) as e:
        parse_time(text)
    assert "HINT" in str(e.value)


@given(st.integers(min_value=1, max_value=400 * 86400))
def test_round_trip(seconds):
    assert parse_time(format_time(seconds)) == seconds
