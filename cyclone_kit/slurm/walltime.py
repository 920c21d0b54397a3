"""Slurm wall-time strings: parse to seconds and format back (pure)."""

from __future__ import annotations

import re

from cyclone_kit.core.errors import ValidationError

_FORMS = "MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"
_DAYS = re.compile(r"^(\d+)-(\d+)(?::(\d+))?(?::(\d+))?$")
_PLAIN = re.compile(r"^(\d+)(?::(\d+))?(?::(\d+))?$")


def parse_time(text: str) -> int:
    """Parse a Slurm ``--time`` value into seconds.

    Accepts Slurm's forms: ``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``,
    ``D-HH:MM:SS``. Minutes and seconds must be below 60 where they are not the
    leading field; the result must be positive.

    Raises:
        ValidationError: the text is not one of those forms, or is zero.
    """
    if not isinstance(text, str):
        raise ValidationError(f"time {text!r} is not a string", hint=f"write it as {_FORMS}, e.g. '02:00:00'")
    s = text.strip()
    seconds: int | None = None
    if m := _DAYS.match(s):
        d, h, mi, se = (int(g) if g is not None else 0 for g in m.groups())
        if h < 24 and mi < 60 and se < 60:
            seconds = ((d * 24 + h) * 60 + mi) * 60 + se
    elif m := _PLAIN.match(s):
        parts = [int(g) for g in m.groups() if g is not None]
        if len(parts) == 1:
            seconds = parts[0] * 60
        elif len(parts) == 2 and parts[1] < 60:
            seconds = parts[0] * 60 + parts[1]
        elif len(parts) == 3 and parts[1] < 60 and parts[2] < 60:
            seconds = (parts[0] * 60 + parts[1]) * 60 + parts[2]
    if seconds is None:
        raise ValidationError(f"malformed time {text!r}", hint=f"write it as {_FORMS}, e.g. '02:00:00'")
    if seconds <= 0:
        raise ValidationError(f"time {text!r} is zero", hint="ask for at least one minute, e.g. '00:10:00'")
    return seconds


def format_time(seconds: int) -> str:
    """Format seconds as Slurm's canonical ``D-HH:MM:SS`` (or ``HH:MM:SS`` under a day)."""
    d, rest = divmod(int(seconds), 86400)
    h, rest = divmod(rest, 3600)
    m, s = divmod(rest, 60)
    return f"{d}-{h:02d}:{m:02d}:{s:02d}" if d else f"{h:02d}:{m:02d}:{s:02d}"
