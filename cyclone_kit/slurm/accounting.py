"""Resource usage from Slurm accounting (``sacct``): allocated TRES, elapsed time, consumed energy.

:func:`sacct_usage_argv` builds the command, :func:`parse_sacct_usage` reads its output (pure,
tested on captured output) and :func:`accounting_disabled` recognises a cluster without
slurmdbd, where ``sacct`` fails with "Slurm accounting storage is disabled".
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from cyclone_kit.core.errors import ParseError
from cyclone_kit.slurm.argv import check_job_id
from cyclone_kit.slurm.parse import parse_duration

#: The fields :func:`sacct_usage_argv` asks for, in order.
USAGE_FIELDS = ("JobIDRaw", "JobID", "State", "Start", "End", "ElapsedRaw", "AllocTRES", "ConsumedEnergyRaw")

_DISABLED = re.compile(r"accounting storage is disabled", re.IGNORECASE)


@dataclass(frozen=True)
class JobUsage:
    """One allocation's usage as sacct reports it (one record per run of a requeued job).

    Attributes:
        job_id: the job id (``"123"`` or ``"123_4"`` for an array task).
        state: the state as sacct prints it.
        start: start time (ISO 8601, cluster-local, no zone), ``""`` when it never started.
        end: end time, ``""`` while running.
        elapsed_s: seconds the allocation ran.
        tres: the allocated TRES, e.g. ``{"cpu": 4, "node": 2, "gres/gpu": 4}`` (memory in MB).
        energy_j: consumed energy in joules; None when sacct reports none (0 or empty).
    """

    job_id: str
    state: str
    start: str
    end: str
    elapsed_s: int
    tres: dict[str, float]
    energy_j: float | None

    @property
    def gpus(self) -> int:
        """Allocated GPUs (``gres/gpu`` in AllocTRES; 0 when not tracked)."""
        return int(self.tres.get("gres/gpu", 0))


def sacct_usage_argv(job_ids: Sequence[str]) -> list[str]:
    """``sacct`` argv for the allocations (every requeued run too) of ``job_ids``."""
    ids = [check_job_id(j) for j in job_ids]
    return ["sacct", "--noheader", "--parsable2", "--allocations", "--duplicates",
            f"--format={','.join(USAGE_FIELDS)}", f"--jobs={','.join(ids)}"]


def accounting_disabled(text: str) -> bool:
    """True when sacct's error output says the cluster has no accounting storage."""
    return bool(_DISABLED.search(text))


_UNITS = {"K": 1 / 1024, "M": 1.0, "G": 1024.0, "T": 1024.0**2}


def parse_tres(text: str) -> dict[str, float]:
    """``billing=4,cpu=4,gres/gpu=2,mem=4000M,node=1`` -> a dict (memory in MB).

    Raises:
        ParseError: an item is not ``name=number[unit]``.
    """
    out: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        match = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]?)", value)
        if not sep or match is None:
            raise ParseError(f"cannot parse AllocTRES item {item!r} in {text!r}",
                             hint="this Slurm prints a TRES format cyclone_kit does not know; report it")
        out[name] = float(match.group(1)) * _UNITS.get(match.group(2), 1.0)
    return out


def parse_sacct_usage(text: str) -> list[JobUsage]:
    """Parse ``sacct --parsable2 --noheader`` output in :data:`USAGE_FIELDS` order.

    Raises:
        ParseError: a line has the wrong number of fields or an unreadable number; the message
            quotes the raw text.
    """
    out = []
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = line.split("|")
        if len(parts) != len(USAGE_FIELDS):
            raise ParseError(
                f"cannot parse sacct usage output (line {line!r} has {len(parts)} fields, "
                f"expected {len(USAGE_FIELDS)}); raw output: {text[:500]!r}",
                hint="this Slurm prints a format cyclone_kit does not know; report it with the raw output",
            )
        _raw_id, job_id, state, start, end, elapsed, tres, energy = (p.strip() for p in parts)
        try:
            elapsed_s = int(elapsed) if elapsed.isdigit() else parse_duration(elapsed)
            energy_j = float(energy) if energy else 0.0
        except (ValueError, ParseError) as exc:
            raise ParseError(f"cannot parse sacct usage line {line!r}: {exc}",
                             hint="this Slurm prints a format cyclone_kit does not know; report it") from None
        out.append(JobUsage(
            job_id=job_id,
            state=state,
            start="" if start in ("Unknown", "None") else start,
            end="" if end in ("Unknown", "None") else end,
            elapsed_s=elapsed_s,
            tres=parse_tres(tres),
            energy_j=energy_j if energy_j > 0 else None,
        ))
    return out
