"""The live cluster's shape as Slurm reports it: partitions, nodes, accounting, associations (pure).

argv builders and parsers for ``scontrol -o show partition``, ``scontrol -o show node``,
``scontrol show config`` and ``sacctmgr show assoc``; :mod:`cyclone_kit.slurm.query` runs them.
Every parser takes the raw text and raises :class:`~cyclone_kit.core.errors.ParseError` quoting it
when it cannot be read. The tests hold real output of Slurm 22.05 (tests/unit/slurm_output/).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from cyclone_kit.core.errors import ParseError, ValidationError
from cyclone_kit.slurm import hostlist
from cyclone_kit.slurm.parse import parse_duration, parse_scontrol_fields

#: sacctmgr show assoc fields, in the order :func:`parse_sacctmgr_assoc` reads them.
ASSOC_FIELDS = ("Cluster", "Account", "User", "Partition")
#: the AccountingStorageType of a cluster without slurmdbd.
NO_ACCOUNTING = "accounting_storage/none"
_RAW_QUOTE = 500
_SAFE = re.compile(r"[A-Za-z0-9._+:\-\[\],]+")


@dataclass(frozen=True)
class PartitionInfo:
    """One partition as ``scontrol show partition`` reports it.

    Attributes:
        name: the partition name.
        state: ``UP``, ``DOWN``, ``DRAIN`` or ``INACTIVE``.
        nodelist: its nodes as a hostlist (``c[1-2]``), ``""`` when it has none.
        total_nodes: ``TotalNodes``.
        total_cpus: ``TotalCPUs``.
        max_time_s: ``MaxTime`` in seconds; ``None`` for ``UNLIMITED``.
        max_time: ``MaxTime`` exactly as printed.
        default: whether it is the cluster's default partition.
    """

    name: str
    state: str
    nodelist: str
    total_nodes: int
    total_cpus: int
    max_time_s: int | None
    max_time: str
    default: bool = False

    @property
    def hosts(self) -> list[str]:
        """The partition's node names, expanded."""
        return hostlist.expand(self.nodelist) if self.nodelist else []


@dataclass(frozen=True)
class NodeInfo:
    """One node as ``scontrol show node`` reports it.

    Attributes:
        name: the node name.
        cpus: ``CPUTot``.
        memory_mb: ``RealMemory`` in MB (what jobs may ask for).
        gpus: GPUs in its ``Gres`` (all types together).
        gres: ``Gres`` as printed (``""`` for none).
        state: ``State`` (``IDLE``, ``MIXED``, ``DOWN+DRAIN`` ...).
        partitions: the partitions it belongs to.
    """

    name: str
    cpus: int
    memory_mb: int
    gpus: int
    gres: str
    state: str
    partitions: tuple[str, ...] = ()


@dataclass(frozen=True)
class Association:
    """One row of ``sacctmgr show assoc``: this user may charge this account (on this partition)."""

    cluster: str
    account: str
    user: str
    partition: str = ""


def _fail(what: str, raw: str, why: str) -> ParseError:
    """A ParseError quoting (the start of) the raw text."""
    shown = raw if len(raw) <= _RAW_QUOTE else raw[:_RAW_QUOTE] + "..."
    return ParseError(
        f"cannot parse {what} ({why}); raw output: {shown!r}",
        hint="this Slurm prints a format cyclone_kit does not know; report it with the raw output",
    )


def _token(what: str, value: str) -> str:
    """A name passed to a Slurm command: no blanks, quotes or shell characters."""
    if not value or not _SAFE.fullmatch(value):
        raise ValidationError(f"{what} {value!r} is not a valid Slurm name", hint="use letters, digits and ._+-: only")
    return value


# --------------------------------------------------------------------------- argv builders
def scontrol_show_partition(name: str) -> list[str]:
    """``scontrol -o show partition NAME``: one line; exits 1 with "Partition X not found"."""
    return ["scontrol", "-o", "show", "partition", _token("partition", name)]


def scontrol_show_nodes(nodelist: str) -> list[str]:
    """``scontrol -o show node NODELIST``: one line per node (a hostlist like ``g[1-2]`` works)."""
    return ["scontrol", "-o", "show", "node", _token("nodelist", nodelist)]


def scontrol_show_config() -> list[str]:
    """``scontrol show config``: ``Key = Value`` lines (AccountingStorageType among them)."""
    return ["scontrol", "show", "config"]


def sacctmgr_assoc(user: str) -> list[str]:
    """``sacctmgr show assoc`` for one user, ``|``-separated, in :data:`ASSOC_FIELDS` order."""
    return [
        "sacctmgr",
        "--noheader",
        "--parsable2",
        "show",
        "assoc",
        "where",
        f"user={_token('user', user)}",
        f"format={','.join(ASSOC_FIELDS)}",
    ]


# --------------------------------------------------------------------------- parsers
def _records(text: str, key: str) -> list[str]:
    """Split ``scontrol show`` output (one-line or multi-line records) at each ``KEY=``."""
    return [r for r in re.split(rf"(?m)^(?={key}=)", text) if r.strip()]


def _int(fields: dict[str, str], key: str, what: str, raw: str) -> int:
    value = fields.get(key, "")
    if not re.fullmatch(r"\d+", value):
        raise _fail(what, raw, f"{key}={value!r} is not a number")
    return int(value)


def parse_partitions(text: str) -> list[PartitionInfo]:
    """Parse ``scontrol [-o] show partition`` output into :class:`PartitionInfo` records.

    Raises:
        ParseError: a record lacks PartitionName, State, TotalNodes, TotalCPUs or MaxTime.
    """
    parts = []
    for record in _records(text, "PartitionName"):
        fields = parse_scontrol_fields(record)
        missing = [k for k in ("PartitionName", "State", "TotalNodes", "TotalCPUs", "MaxTime") if k not in fields]
        if missing:
            raise _fail("scontrol show partition output", text, f"missing {', '.join(missing)}")
        raw_max = fields["MaxTime"]
        if raw_max.upper() in ("UNLIMITED", "INFINITE", "NONE"):
            max_s = None
        else:
            try:
                max_s = parse_duration(raw_max)
            except ParseError:
                raise _fail("scontrol show partition output", text, f"MaxTime={raw_max!r} is not a duration") from None
        nodes = fields.get("Nodes", "")
        parts.append(
            PartitionInfo(
                name=fields["PartitionName"],
                state=fields["State"],
                nodelist="" if nodes in ("(null)", "") else nodes,
                total_nodes=_int(fields, "TotalNodes", "scontrol show partition output", text),
                total_cpus=_int(fields, "TotalCPUs", "scontrol show partition output", text),
                max_time_s=max_s,
                max_time=raw_max,
                default=fields.get("Default", "NO") == "YES",
            )
        )
    return parts


def gres_gpus(gres: str) -> int:
    """GPUs in a node's ``Gres``: ``gpu:4`` -> 4, ``gpu:v100:4(S:0-1),mps:400`` -> 4, ``(null)`` -> 0.

    Entries of several GPU types add up (``gpu:a100:2,gpu:v100:2`` -> 4).

    Raises:
        ParseError: a ``gpu`` entry does not end in a count.
    """
    plain = re.sub(r"\([^)]*\)", "", gres.strip())  # socket bindings like (S:0-1) or (S:0,2)
    total = 0
    for item in plain.split(","):
        item = item.strip()
        if not item.startswith("gpu"):
            continue
        count = item.rsplit(":", 1)[-1] if ":" in item else ""
        if not count.isdigit():
            raise _fail("a node's Gres", gres, f"{item!r} does not end in a GPU count")
        total += int(count)
    return total


def parse_nodes(text: str) -> list[NodeInfo]:
    """Parse ``scontrol [-o] show node`` output into :class:`NodeInfo` records.

    Raises:
        ParseError: a record lacks NodeName, CPUTot, RealMemory or State, or its Gres is unreadable.
    """
    nodes = []
    for record in _records(text, "NodeName"):
        fields = parse_scontrol_fields(record)
        missing = [k for k in ("NodeName", "CPUTot", "RealMemory", "State") if k not in fields]
        if missing:
            raise _fail("scontrol show node output", text, f"missing {', '.join(missing)}")
        gres = fields.get("Gres", "")
        gres = "" if gres in ("(null)", "") else gres
        partitions = fields.get("Partitions", "")
        nodes.append(
            NodeInfo(
                name=fields["NodeName"],
                cpus=_int(fields, "CPUTot", "scontrol show node output", text),
                memory_mb=_int(fields, "RealMemory", "scontrol show node output", text),
                gpus=gres_gpus(gres) if gres else 0,
                gres=gres,
                state=fields["State"],
                partitions=tuple(p for p in partitions.split(",") if p and p != "(null)"),
            )
        )
    return nodes


def parse_config(text: str) -> dict[str, str]:
    """``scontrol show config`` as a dict of its ``Key = Value`` lines (other lines are skipped)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() and " " not in key.strip():
            out.setdefault(key.strip(), value.strip())
    return out


def accounting_storage(config: dict[str, str]) -> str:
    """The cluster's AccountingStorageType (``accounting_storage/none`` when the key is absent)."""
    return config.get("AccountingStorageType", NO_ACCOUNTING) or NO_ACCOUNTING


def accounting_enabled(config: dict[str, str]) -> bool:
    """True when jobs are recorded in slurmdbd, so that sacct and sacctmgr answer."""
    return accounting_storage(config) != NO_ACCOUNTING


def parse_sacctmgr_assoc(text: str) -> list[Association]:
    """Parse ``sacctmgr --noheader --parsable2 show assoc format=Cluster,Account,User,Partition``.

    Raises:
        ParseError: a line does not have the four fields.
    """
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = line.split("|")
        if len(parts) != len(ASSOC_FIELDS):
            raise _fail("sacctmgr show assoc output", text, f"line {line!r} has {len(parts)} fields, expected 4")
        rows.append(Association(*(p.strip() for p in parts)))
    return rows


def accounts_of(user: str, associations: Iterable[Association]) -> list[str]:
    """The accounts ``user`` has an association with, sorted and without repeats."""
    return sorted({a.account for a in associations if a.user == user and a.account})
