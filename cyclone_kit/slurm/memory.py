"""Slurm memory sizes (``--mem``, ``resources.mem``): parse to MiB (pure)."""

from __future__ import annotations

import re

from cyclone_kit.core.errors import ValidationError


def parse_mem_mb(text: str) -> int:
    """Slurm's ``--mem`` value (a count with an optional K, M, G or T suffix; M by default) in MiB."""
    match = re.fullmatch(r"(\d+)([KMGT]?)B?", text.strip().upper())
    if not match or int(match.group(1)) == 0:
        raise ValidationError(
            f"resources.mem {text!r} is not a memory size Slurm accepts",
            hint="write it as a positive count with a unit, e.g. '32G' or '16000M'",
        )
    factor = {"K": 1 / 1024, "": 1, "M": 1, "G": 1024, "T": 1024 * 1024}[match.group(2)]
    return max(1, int(int(match.group(1)) * factor))
