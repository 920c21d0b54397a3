"""Slurm hostlists (``gpu[01-04,07],cn[001-003]``) and task counts (``2(x3),1``).

A thin wrapper over python-hostlist, which gets the hard cases right (several brackets in one
name, a dash before the bracket, zero padding that follows the low bound), turning its errors
into :class:`~cyclone_kit.core.errors.ValidationError` with a HINT.
"""

from __future__ import annotations

from collections.abc import Iterable

import hostlist as _hostlist

from cyclone_kit.core.errors import ValidationError

_HOSTLIST_HINT = (
    "a Slurm hostlist is names or prefix[ranges] separated by commas, e.g. gpu[01-04,07],cn001 "
    "(ranges low-high with low <= high, brackets balanced)"
)


def expand(hostlist: str) -> list[str]:
    """Expand a Slurm hostlist into host names, in Slurm's order.

    >>> expand("gpu[01-02,07],cn1")
    ['gpu01', 'gpu02', 'gpu07', 'cn1']

    Raises:
        ValidationError: the text is not a hostlist (unbalanced brackets, a range like 3-1, ...).
    """
    text = hostlist.strip()
    if any(ch.isspace() for ch in text):
        raise ValidationError(f"bad hostlist {hostlist!r}: it contains whitespace", hint=_HOSTLIST_HINT)
    try:
        return list(_hostlist.expand_hostlist(text))
    except _hostlist.BadHostlist as exc:
        raise ValidationError(f"bad hostlist {hostlist!r}: {exc}", hint=_HOSTLIST_HINT) from None


def first_host(hostlist: str) -> str:
    """The first host of a hostlist (e.g. the rendezvous host for MASTER_ADDR).

    Raises:
        ValidationError: the hostlist is malformed or empty.
    """
    hosts = expand(hostlist)
    if not hosts:
        raise ValidationError(
            f"hostlist {hostlist!r} is empty",
            hint="pass SLURM_JOB_NODELIST from inside a job, e.g. c[1-2]",
        )
    return hosts[0]


def collect(hosts: Iterable[str]) -> str:
    """Compress host names into a hostlist (the inverse of :func:`expand` for distinct hosts).

    Raises:
        ValidationError: a name cannot appear in a hostlist (it contains ``,[]`` or whitespace).
    """
    names = list(hosts)
    for name in names:
        if not name or any(ch in ",[]" or ch.isspace() for ch in name):
            raise ValidationError(
                f"host name {name!r} cannot be written in a hostlist",
                hint="host names must be non-empty and free of commas, brackets and whitespace",
            )
    return str(_hostlist.collect_hostlist(names))


def expand_tasks_per_node(tasks: str) -> list[int]:
    """Expand SLURM_TASKS_PER_NODE: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``.

    Raises:
        ValidationError: the text is not in Slurm's ``count[(xrepeat)],...`` form.
    """
    try:
        counts = list(_hostlist.parse_slurm_tasks_per_node(tasks.strip()))
    except _hostlist.BadHostlist as exc:
        raise ValidationError(
            f"bad SLURM_TASKS_PER_NODE {tasks!r}: {exc}",
            hint="expected counts like 4 or 2(x3),1 (count, optional (xREPEAT), comma separated)",
        ) from None
    return counts
