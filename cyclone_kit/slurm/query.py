"""Ask the live cluster about its shape (side effects: runs scontrol and sacctmgr).

The argv and the parsers are in :mod:`cyclone_kit.slurm.cluster`; every command goes through
:func:`cyclone_kit.core.proc.run_command`. What Slurm says is returned as data, including "the
partition does not exist" and "accounting is off", so that callers (``cyclone-kit doctor``)
can turn each fact into a check; only an unreachable Slurm raises.
"""

from __future__ import annotations

from dataclasses import dataclass

from cyclone_kit.core.errors import CommandError, ParseError, SlurmError
from cyclone_kit.core.proc import run_command
from cyclone_kit.slurm import cluster


@dataclass(frozen=True)
class ClusterFacts:
    """What the cluster says about one partition and one user.

    Attributes:
        partition: the partition, or ``None`` when Slurm does not know it.
        nodes: the partition's nodes.
        accounting: the AccountingStorageType (``accounting_storage/none`` without slurmdbd).
        associations: the user's associations; ``None`` when they could not be asked for.
        associations_error: why they could not (accounting off, sacctmgr failed).
        user: the user the associations are for.
    """

    partition: cluster.PartitionInfo | None
    nodes: tuple[cluster.NodeInfo, ...]
    accounting: str
    associations: tuple[cluster.Association, ...] | None
    associations_error: str
    user: str


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "no output")


def cluster_facts(partition: str, user: str, *, timeout: float = 30) -> ClusterFacts:
    """Query the partition, its nodes, the accounting type and the user's associations.

    Raises:
        SlurmError: Slurm's commands are missing or the controller does not answer.
        ParseError: Slurm printed something the parsers do not know.
    """
    hint = "is Slurm up and on PATH? check with `sinfo` (for the local test cluster: scripts/local-slurm.sh status)"
    try:
        config = run_command(cluster.scontrol_show_config(), timeout=timeout, check=False)
    except CommandError as e:
        raise SlurmError(f"cannot ask Slurm for its configuration: {e.message}", hint=hint) from None
    if not config.ok:
        raise SlurmError(f"scontrol show config failed: {_first_line(config.stderr or config.stdout)}", hint=hint)
    accounting = cluster.accounting_storage(cluster.parse_config(config.stdout))

    shown = run_command(cluster.scontrol_show_partition(partition), timeout=timeout, check=False)
    part: cluster.PartitionInfo | None = None
    nodes: tuple[cluster.NodeInfo, ...] = ()
    if shown.ok:
        found = [p for p in cluster.parse_partitions(shown.stdout) if p.name == partition]
        part = found[0] if found else None
    elif "not found" not in (shown.stderr + shown.stdout):
        raise SlurmError(f"scontrol show partition {partition} failed: {_first_line(shown.stderr or shown.stdout)}",
                         hint=hint)
    if part is not None and part.nodelist:
        listed = run_command(cluster.scontrol_show_nodes(part.nodelist), timeout=timeout, check=False)
        if not listed.ok:
            raise SlurmError(f"scontrol show node {part.nodelist} failed: {_first_line(listed.stderr or listed.stdout)}",
                             hint=hint)
        nodes = tuple(cluster.parse_nodes(listed.stdout))

    associations: tuple[cluster.Association, ...] | None = None
    why = ""
    if accounting == cluster.NO_ACCOUNTING:
        why = f"accounting storage is disabled on this cluster (AccountingStorageType={accounting})"
    else:
        try:
            result = run_command(cluster.sacctmgr_assoc(user), timeout=timeout, check=False)
        except CommandError as e:
            result, why = None, f"sacctmgr could not run: {e.message}"
        if result is not None and result.ok:
            try:
                associations = tuple(cluster.parse_sacctmgr_assoc(result.stdout))
            except ParseError as e:
                why = e.message
        elif result is not None:
            why = f"sacctmgr failed: {_first_line(result.stderr or result.stdout)}"
    return ClusterFacts(part, nodes, accounting, associations, why, user)
