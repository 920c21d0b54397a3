"""``cyclone-kit doctor``'s checks, as pure functions over parsed facts.

Each function takes what was found (a resolved request, the cluster's partition and nodes as
:mod:`cyclone_kit.slurm.cluster` parsed them, the smoke job's rank reports) and returns one
:class:`Check`: ok or not, a one-line detail, and a HINT naming the fix. Nothing here runs a
command or imports torch; :mod:`cyclone_kit.doctor.job` gathers the facts, and the smoke job's
ranks measure with :mod:`cyclone_kit.doctor.probe`.

``ok`` is ``True`` (passed), ``False`` (failed) or ``None`` (not checked, the detail says why:
accounting off, no module system, the smoke job could not run). ``doctor`` exits 1 when any
check failed, else 0.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from cyclone_kit.config.validate import ResolvedJob
from cyclone_kit.rundir.network import NetworkFigures, level_from_points
from cyclone_kit.slurm import hostlist
from cyclone_kit.slurm.cluster import Association, NodeInfo, PartitionInfo, accounts_of
from cyclone_kit.slurm.walltime import format_time

#: the share by which the profile's memory_gb may differ from the nodes' RealMemory.
MEMORY_TOLERANCE = 0.10
#: network variables whose value names interfaces (NCCL syntax: ``^`` excludes, ``=`` exact).
IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME")


@dataclass(frozen=True)
class Check:
    """One row of doctor's report.

    Attributes:
        check: a stable identifier (``partition``, ``cpus``, ``allreduce`` ...).
        ok: True passed, False failed, None not checked (``detail`` says why).
        detail: what was found, on one line.
        hint: the fix, when the check failed (may be empty otherwise).
        data: figures the check measured (``network``: the network.json document), else None.
    """

    check: str
    ok: bool | None
    detail: str
    hint: str = ""
    data: Mapping[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """``{check, ok, detail, hint}`` (the ``--json`` record), plus ``data`` when the check measured figures."""
        out = asdict(self)
        if self.data is None:
            out.pop("data")
        return out


@dataclass(frozen=True)
class HostVersions:
    """The submit host's versions the ranks must match (python always; torch when installed)."""

    python: str
    torch: str = ""


@dataclass(frozen=True)
class ModuleFacts:
    """What the submit host's module system said about the profile's modules.

    Attributes:
        system: ``"lmod"``, ``"environment-modules"`` or ``""`` (none found).
        listings: module name -> the text ``module -t avail NAME`` printed.
        error: why the modules could not be asked for (empty when they were).
    """

    system: str = ""
    listings: Mapping[str, str] = field(default_factory=dict)
    error: str = ""


@dataclass(frozen=True)
class SmokeResult:
    """How the smoke job went.

    Attributes:
        job_id: the job id, ``""`` when sbatch refused it.
        state: the final state (``COMPLETED``, ``FAILED`` ...) or the state it waited in.
        finished: False when doctor stopped waiting (the job was cancelled).
        reason: Slurm's reason (why it pends or ended), or sbatch's refusal.
        elapsed_s: seconds it ran.
        nodelist: the nodes it ran on.
        reports: the rank reports (parsed ``rank-<R>.json``), in rank order.
        stderr: the job's standard error (setup and srun messages, Python tracebacks).
        run_dir: where its script, logs and reports are.
        cancelled: doctor cancelled it after waiting ``--wait-timeout`` seconds.
    """

    job_id: str
    state: str
    finished: bool
    reason: str = ""
    elapsed_s: int = 0
    nodelist: str = ""
    reports: tuple[Mapping[str, Any], ...] = ()
    stderr: str = ""
    run_dir: str = ""
    cancelled: bool = False


def _where(job: ResolvedJob) -> str:
    return f"[partitions.{job.partition.name}] of profile {job.profile.name!r}"


def _not_checked(name: str, why: str) -> Check:
    return Check(name, None, f"not checked: {why}")


# --------------------------------------------------------------------------- static checks
def check_partition(job: ResolvedJob, live: PartitionInfo | None) -> Check:
    """The partition exists on the cluster and is UP."""
    name = job.partition.name
    if live is None:
        return Check("partition", False, f"partition {name!r} does not exist on this cluster",
                     f"use a partition `sinfo -s` lists, or fix the partition names of profile {job.profile.name!r}")
    if live.state != "UP":
        return Check("partition", False, f"partition {name!r} is {live.state}",
                     "wait until the administrators bring it UP (`sinfo -p " + name + "`), or use another partition")
    return Check("partition", True, f"partition {name!r} is UP: {live.total_nodes} nodes {live.nodelist}, "
                 f"{live.total_cpus} CPUs, MaxTime {live.max_time}")


def check_node_count(job: ResolvedJob, live: PartitionInfo | None) -> Check:
    """The profile's node count matches the partition's, and ``--nodes`` fits in it."""
    if live is None:
        return _not_checked("nodes", "the partition does not exist")
    want = job.partition.nodes
    problems, hints = [], []
    if want != live.total_nodes:
        problems.append(f"profile {job.profile.name!r} says {want} nodes in {job.partition.name!r}, "
                        f"the cluster has {live.total_nodes}")
        hints.append(f"set nodes = {live.total_nodes} in {_where(job)}")
    if job.nodes > live.total_nodes:
        problems.append(f"--nodes {job.nodes} is more than the {live.total_nodes} the partition has "
                        "(Slurm would accept it and pend forever)")
        hints.append(f"use --nodes {live.total_nodes} or fewer")
    if problems:
        return Check("nodes", False, "; ".join(problems), "; ".join(hints))
    return Check("nodes", True, f"{live.total_nodes} nodes, as the profile says; --nodes {job.nodes} fits")


def check_nodelist(job: ResolvedJob, live: PartitionInfo | None) -> Check:
    """The profile's nodelist (when it has one) names the partition's nodes."""
    if live is None:
        return _not_checked("nodelist", "the partition does not exist")
    if not job.partition.nodelist:
        return Check("nodelist", True, f"the profile names no nodes; the cluster's are {live.nodelist or '(none)'}")
    want = set(hostlist.expand(job.partition.nodelist))
    have = set(live.hosts)
    if want == have:
        return Check("nodelist", True, f"{live.nodelist}, as the profile says")
    missing = sorted(want - have)
    extra = sorted(have - want)
    parts = [f"profile says {job.partition.nodelist}, the cluster has {live.nodelist or '(none)'}"]
    if missing:
        parts.append(f"not in the partition: {hostlist.collect(missing)}")
    if extra:
        parts.append(f"not in the profile: {hostlist.collect(extra)}")
    return Check("nodelist", False, "; ".join(parts), f'set nodelist = "{live.nodelist}" in {_where(job)}')


def _nodes_summary(nodes: Sequence[NodeInfo], attr: str) -> str:
    """``4 (c[1-2])`` or ``4 on c1, 8 on c2`` for a per-node value."""
    by_value: dict[Any, list[str]] = {}
    for n in nodes:
        by_value.setdefault(getattr(n, attr), []).append(n.name)
    return ", ".join(f"{v} on {hostlist.collect(names)}" for v, names in sorted(by_value.items()))


def check_cpus(job: ResolvedJob, nodes: Sequence[NodeInfo]) -> Check:
    """The profile's CPUs per node match the nodes, and the request fits on the smallest node."""
    if not nodes:
        return _not_checked("cpus", "the partition has no nodes to look at")
    least = min(n.cpus for n in nodes)
    want = job.partition.cpus_per_node
    needed = job.ntasks_per_node * job.cpus_per_task
    problems, hints = [], []
    if want != least or any(n.cpus != want for n in nodes):
        problems.append(f"profile {job.profile.name!r} says {want} CPUs (cores) per node, the nodes have "
                        f"{_nodes_summary(nodes, 'cpus')}")
        hints.append(f"set cpus_per_node = {least} in {_where(job)}")
    if needed > least:
        problems.append(f"the request needs {job.ntasks_per_node} tasks x {job.cpus_per_task} CPUs = {needed} "
                        f"CPUs per node, the nodes have {least}")
        hints.append("lower --cpus-per-task or the tasks per node" if not hints else
                     "the CPUs per task then follow from the profile")
    if problems:
        return Check("cpus", False, "; ".join(problems), "; ".join(hints))
    return Check("cpus", True, f"{want} CPUs per node, as the profile says; the request uses {needed}")


def check_gpus(job: ResolvedJob, nodes: Sequence[NodeInfo]) -> Check:
    """The profile's GPUs per node match the nodes' Gres, and the request fits."""
    if not nodes:
        return _not_checked("gpus", "the partition has no nodes to look at")
    least = min(n.gpus for n in nodes)
    want = job.partition.gpus_per_node
    problems, hints = [], []
    if want != least or any(n.gpus != want for n in nodes):
        problems.append(f"profile {job.profile.name!r} says {want} GPUs per node, the nodes' Gres give "
                        f"{_nodes_summary(nodes, 'gpus')}")
        hints.append(f"set gpus_per_node = {least} in {_where(job)}")
    if job.gpus_per_node > least:
        problems.append(f"the request asks {job.gpus_per_node} GPUs per node, the nodes have {least}")
        hints.append(f"use --gpus-per-node {least} or fewer")
    if problems:
        return Check("gpus", False, "; ".join(problems), "; ".join(hints))
    gres = sorted({n.gres for n in nodes if n.gres})
    return Check("gpus", True, f"{want} GPUs per node, as the profile says" + (f" (Gres {', '.join(gres)})" if gres else ""))


def check_memory(job: ResolvedJob, nodes: Sequence[NodeInfo]) -> Check:
    """The profile's memory_gb is within :data:`MEMORY_TOLERANCE` of the nodes' RealMemory."""
    if not nodes:
        return _not_checked("memory", "the partition has no nodes to look at")
    least_mb = min(n.memory_mb for n in nodes)
    have_gb = least_mb / 1024
    want = job.partition.memory_gb
    if not want:
        return Check("memory", True, f"the profile sets no memory; nodes have {least_mb} MB")
    if abs(want - have_gb) > MEMORY_TOLERANCE * max(want, have_gb):
        return Check("memory", False, f"profile {job.profile.name!r} says {want} GB per node, the nodes have "
                     f"RealMemory {least_mb} MB ({have_gb:.1f} GB)",
                     f"set memory_gb = {max(1, round(have_gb))} in {_where(job)}")
    return Check("memory", True, f"{want} GB per node, nodes have RealMemory {least_mb} MB ({have_gb:.1f} GB)")


def check_max_time(job: ResolvedJob, live: PartitionInfo | None) -> Check:
    """The profile's max_time is no more than the partition's MaxTime, nor is the request's time."""
    if live is None:
        return _not_checked("max_time", "the partition does not exist")
    want = job.partition.max_time_s
    if live.max_time_s is None:
        return Check("max_time", True, f"the partition has no time limit; the profile assumes {job.partition.max_time}")
    if want > live.max_time_s:
        return Check("max_time", False, f"profile {job.profile.name!r} says max_time {job.partition.max_time}, "
                     f"the partition's MaxTime is {live.max_time}: longer jobs are refused",
                     f'set max_time = "{format_time(live.max_time_s)}" in {_where(job)}')
    if job.time_s > live.max_time_s:
        return Check("max_time", False, f"the request's --time {job.time} is above MaxTime {live.max_time}",
                     f"use --time {format_time(live.max_time_s)} or less")
    if want < live.max_time_s:
        return Check("max_time", True, f"profile max_time {job.partition.max_time} is below MaxTime {live.max_time} "
                     "(jobs requeue sooner than they must)")
    return Check("max_time", True, f"MaxTime {live.max_time}, as the profile says")


def check_account(job: ResolvedJob, accounting: str, associations: Sequence[Association] | None,
                  why: str, user: str) -> Check:
    """The account has an association with the user (when accounting is up)."""
    account = job.account
    if not account:
        if job.profile.account_required:
            return Check("account", False, f"profile {job.profile.name!r} requires an account and none was given",
                         "pass --account <project> (e.g. --account p163), or set account in the profile")
        return _not_checked("account", f"no --account given, and profile {job.profile.name!r} requires none")
    if associations is None:
        return _not_checked("account", why or f"sacctmgr did not answer ({accounting})")
    mine = accounts_of(user, associations)
    if account in mine:
        parts = sorted({a.partition for a in associations if a.account == account and a.user == user} - {""})
        where = f" (partitions {', '.join(parts)})" if parts else ""
        return Check("account", True, f"user {user!r} may charge account {account!r}{where}")
    return Check("account", False, f"user {user!r} has no association with account {account!r}"
                 + (f"; their accounts: {', '.join(mine)}" if mine else "; they have none"),
                 f"use --account {mine[0]}" if mine else "ask the administrators to add you to the project "
                 "(`sacctmgr show assoc user=" + user + "`)")


def module_available(name: str, listing: str) -> bool:
    """True when ``module -t avail NAME`` output lists ``name`` (or a version of it)."""
    for line in listing.splitlines():
        entry = re.sub(r"\((default|D|L)\)$", "", line.strip()).rstrip("/")
        if entry == name or (("/" not in name) and entry.startswith(name + "/")):
            return True
    return False


def check_modules(job: ResolvedJob, facts: ModuleFacts) -> Check:
    """Every module the profile loads exists, where Lmod or Environment Modules is present."""
    modules = job.profile.modules
    if not modules:
        return Check("modules", True, f"profile {job.profile.name!r} loads no modules")
    if not facts.system:
        return _not_checked("modules", f"profile loads {', '.join(modules)} but this host has neither Lmod nor "
                            "Environment Modules (LMOD_CMD / MODULES_CMD unset); the smoke job will load them")
    if facts.error:
        return _not_checked("modules", facts.error)
    missing = [m for m in modules if not module_available(m, facts.listings.get(m, ""))]
    if missing:
        return Check("modules", False, f"{facts.system}: not available: {', '.join(missing)}",
                     f"fix modules in profile {job.profile.name!r}: `module spider {missing[0].split('/')[0]}` lists "
                     "the versions")
    return Check("modules", True, f"{facts.system}: {', '.join(modules)} available")


def static_checks(job: ResolvedJob, live: PartitionInfo | None, nodes: Sequence[NodeInfo], *, accounting: str,
                  associations: Sequence[Association] | None, associations_error: str, user: str,
                  modules: ModuleFacts) -> list[Check]:
    """Every check of the profile and request against the live cluster, in report order."""
    return [
        check_partition(job, live),
        check_node_count(job, live),
        check_nodelist(job, live),
        check_cpus(job, nodes),
        check_gpus(job, nodes),
        check_memory(job, nodes),
        check_max_time(job, live),
        check_account(job, accounting, associations, associations_error, user),
        check_modules(job, modules),
    ]


def request_problems(job: ResolvedJob, live: PartitionInfo | None, nodes: Sequence[NodeInfo]) -> list[str]:
    """Why the smoke job could not run on this cluster (empty when it can be submitted)."""
    if live is None:
        return [f"partition {job.partition.name!r} does not exist"]
    out = []
    if live.state != "UP":
        out.append(f"partition {job.partition.name!r} is {live.state}")
    if job.nodes > live.total_nodes:
        out.append(f"{job.nodes} nodes asked, {live.total_nodes} exist")
    if nodes:
        cpus = min(n.cpus for n in nodes)
        if job.ntasks_per_node * job.cpus_per_task > cpus:
            out.append(f"{job.ntasks_per_node * job.cpus_per_task} CPUs per node asked, {cpus} exist")
        gpus = min(n.gpus for n in nodes)
        if job.gpus_per_node > gpus:
            out.append(f"{job.gpus_per_node} GPUs per node asked, {gpus} exist")
    if live.max_time_s is not None and job.time_s > live.max_time_s:
        out.append(f"--time {job.time} is above MaxTime {live.max_time}")
    return out


# --------------------------------------------------------------------------- live checks
_EXC_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b:?.*")  # not warnings: torch prints many
_SHELL_ERR = re.compile(r"(command not found|No such file or directory|Permission denied|not found|cannot|"
                        r"failed|error)", re.IGNORECASE)
_GENERIC = re.compile(r"^(srun: error: .*task \d+: (Exited with exit code|Killed|Terminated)|srun: (launch/|Job step)|"
                      r"cyclone_kit: job )")


def error_line(text: str) -> str:
    """The line of a job's stderr that says what went wrong ("" for none).

    A Python exception line (``ModuleNotFoundError: No module named 'x'``) first, then a shell or
    module error (``line 3: source: ...: No such file or directory``); srun's own "task N: Exited"
    lines last, since they only repeat that something failed.
    """
    lines = [" ".join(line.split()) for line in text.splitlines() if line.strip()]
    for line in lines:
        if _EXC_LINE.match(line):
            return line
    own = [line for line in lines if not _GENERIC.match(line)]
    for line in own:
        if _SHELL_ERR.search(line):
            return line
    return (own or lines or [""])[-1]


def _expected_ranks(job: ResolvedJob) -> int:
    return job.nodes * job.ntasks_per_node


def _missing_ranks(job: ResolvedJob, result: SmokeResult) -> list[int]:
    seen = {_rank_of(r) for r in result.reports}
    return [r for r in range(_expected_ranks(job)) if r not in seen]


def _rank_of(report: Mapping[str, Any]) -> int:
    slurm = report.get("slurm", {})
    try:
        return int(slurm.get("SLURM_PROCID", -1))
    except (TypeError, ValueError):
        return -1


def _short(ranks: Sequence[int]) -> str:
    """``0-3,6`` for a list of rank numbers."""
    ranks = sorted(set(ranks))
    out, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ",".join(out)


def check_smoke_job(job: ResolvedJob, result: SmokeResult) -> Check:
    """The smoke job ran to the end on every node, and every rank reported."""
    if not result.job_id:
        return Check("smoke_job", False, f"sbatch refused the smoke job: {result.reason}",
                     "fix the request or the profile as the message says")
    where = f"job {result.job_id}" + (f" on {result.nodelist}" if result.nodelist else "")
    if not result.finished:
        return Check("smoke_job", False, f"{where} still {result.state} when doctor stopped waiting"
                     + (f" (reason: {result.reason})" if result.reason else "")
                     + ("; it was cancelled" if result.cancelled else ""),
                     "Slurm's reason says what it waited for; run doctor again when the partition has room, "
                     "or give it longer with --wait-timeout")
    expected = _expected_ranks(job)
    done = sum(1 for r in result.reports if r.get("done"))
    text = f"{where} {result.state} in {result.elapsed_s} s; {done}/{expected} ranks finished every stage"
    if result.state == "COMPLETED" and done == expected:
        return Check("smoke_job", True, f"{text} (run dir {result.run_dir})")
    cause = error_line(result.stderr)
    return Check("smoke_job", False, text + (f"; first error: {cause}" if cause else ""),
                 f"see the checks below and the job's logs in {result.run_dir}/logs")


def check_python(job: ResolvedJob, result: SmokeResult, host: HostVersions) -> Check:
    """Python starts on every rank (with the profile's setup) at the submit host's version."""
    missing = _missing_ranks(job, result)
    if missing:
        cause = error_line(result.stderr) or "no error output"
        return Check("python", False, f"python did not start on rank(s) {_short(missing)}: {cause}",
                     "fix the profile's setup / modules / python so that `python -m cyclone_kit.doctor.probe` "
                     "runs on the compute nodes")
    versions = {str(r.get("python")) for r in result.reports}
    exes = sorted({str(r.get("executable")) for r in result.reports})
    box = job.spec.container
    if box is not None:  # the image's own python: with the job's venv bound in, the same minor version
        minors = {".".join(v.split(".")[:2]) for v in versions}
        mine = ".".join(host.python.split(".")[:2])
        if box.host_venv and minors != {mine}:
            return Check("python", False, f"the {box.runtime} image runs python {', '.join(sorted(versions))}, the "
                         f"submit host's venv {host.python}: its compiled packages (torch) need python {mine}",
                         f"use an image with python {mine} (container.python names it), or an image with its own "
                         "torch and cyclone_kit: container.host_venv = false")
        return Check("python", True, f"python {', '.join(sorted(versions))} in the {box.runtime} image on "
                     f"{len(result.reports)} ranks ({', '.join(exes)})")
    if versions != {host.python}:
        return Check("python", False, f"ranks run python {', '.join(sorted(versions))}, the submit host "
                     f"{host.python} ({', '.join(exes)})",
                     "use the same python on both sides: set python (or the setup/modules) in the profile")
    return Check("python", True, f"python {host.python} on {len(result.reports)} ranks ({', '.join(exes)})")


def check_torch_import(job: ResolvedJob, result: SmokeResult, host: HostVersions) -> Check:
    """``import torch`` works on every rank, at the submit host's torch version."""
    missing = _missing_ranks(job, result)
    if missing:
        cause = error_line(result.stderr) or "no error output"
        return Check("torch_import", False, f"rank(s) {_short(missing)} never got to import torch: {cause}",
                     "fix the profile's setup / modules so that python starts and imports torch on the nodes")
    unfinished = [_rank_of(r) for r in result.reports if "torch" not in r]
    if unfinished:
        return Check("torch_import", False, f"import torch never finished on rank(s) {_short(unfinished)} "
                     "(killed or hung while importing)",
                     "time `python -c 'import torch'` on a compute node: a slow shared file system or a hung "
                     "CUDA driver shows here")
    failed = [(_rank_of(r), r["torch"].get("error", "")) for r in result.reports if not r["torch"].get("ok")]
    if failed:
        ranks = [r for r, _ in failed]
        return Check("torch_import", False, f"import torch failed on rank(s) {_short(ranks)}: {failed[0][1] or 'no error'}",
                     "install torch in the python the job uses, or load its module in the profile")
    versions = sorted({str(r["torch"].get("version")) for r in result.reports})
    if host.torch and not all(same_version(v, host.torch) for v in versions):
        return Check("torch_import", False, f"ranks import torch {', '.join(versions)}, the submit host has {host.torch}",
                     "use the same environment on both sides (profile setup / python)")
    return Check("torch_import", True, f"torch {', '.join(versions)} on {len(result.reports)} ranks"
                 + ("" if host.torch else " (no torch on the submit host to compare with)"))


#: how each runtime shows a node's GPUs to the container, for the hint of :func:`check_container`.
_GPU_HINTS = {
    "charliecloud": "inject the host's NVIDIA libraries into the image once: ch-fromhost --nvidia IMAGE",
    "apptainer": "the job passes --nv; check the node's driver with `apptainer exec --nv IMAGE nvidia-smi`",
    "singularity": "the job passes --nv; check the node's driver with `singularity exec --nv IMAGE nvidia-smi`",
    "pyxis": "enroot's NVIDIA hook must be enabled on the nodes (ENROOT_... hooks/98-nvidia.sh); ask the admins",
}


def check_container(job: ResolvedJob, result: SmokeResult) -> Check:
    """The container image runs on every rank, ``import torch`` works inside it, and torch there sees the
    GPUs where the partition has them (pure; ``not checked`` for a job without a container)."""
    box = job.spec.container
    if box is None:
        return _not_checked("container", "no container")
    where = f"{box.runtime} image {box.image}"
    missing = _missing_ranks(job, result)
    if missing:
        cause = error_line(result.stderr) or "no error output"
        return Check("container", False, f"the {where} did not start on rank(s) {_short(missing)}: {cause}",
                     f"check the runtime and the image on a compute node: srun -N1 -p {job.partition.name} "
                     f"{'ch-run IMAGE -- ' if box.runtime == 'charliecloud' else ''}{box.python} -c 'import torch' "
                     "(see the job's .err log for the runtime's own message)")
    outside = [_rank_of(r) for r in result.reports if r.get("container") != box.runtime]
    if outside:
        return Check("container", False, f"rank(s) {_short(outside)} did not run in the {where}",
                     "a user template that drops the container's words? remove it, or render with the packaged one")
    failed = [(_rank_of(r), r.get("torch", {}).get("error", "never finished")) for r in result.reports
              if not r.get("torch", {}).get("ok")]
    if failed:
        return Check("container", False, f"import torch failed in the {where} on rank(s) "
                     f"{_short([r for r, _ in failed])}: {failed[0][1]}",
                     "bind the job's venv in (container.host_venv = true, an image python of the venv's minor "
                     "version) or install torch in the image")
    gpus = sorted({int(r["torch"].get("cuda_device_count", 0)) for r in result.reports})
    if job.gpus_per_node and 0 in gpus:
        blind = [_rank_of(r) for r in result.reports if not int(r["torch"].get("cuda_device_count", 0))]
        return Check("container", False, f"torch in the {where} sees no GPU on rank(s) {_short(blind)} of a "
                     f"partition with {job.gpus_per_node} per node", _GPU_HINTS.get(box.runtime, ""))
    torch = sorted({str(r["torch"].get("version")) for r in result.reports})
    seen = f", {'/'.join(map(str, gpus))} GPU(s) per rank" if job.gpus_per_node else ""
    return Check("container", True, f"{where} runs on {len(result.reports)} ranks: torch {', '.join(torch)}{seen}")


def same_version(a: str, b: str) -> bool:
    """Equal versions; a missing local part matches any (``2.14.1`` and ``2.14.1+cu130``, not ``+cpu`` and ``+cu130``).

    pip's metadata may drop the local part that ``torch.__version__`` keeps.
    """
    (pa, _, la), (pb, _, lb) = a.partition("+"), b.partition("+")
    return pa == pb and (la == lb or not la or not lb)


def _visible(report: Mapping[str, Any]) -> list[str]:
    value = report.get("cuda_visible_devices")
    if value in (None, "", "NoDevFiles", "-1"):
        return []
    return [v for v in str(value).split(",") if v.strip()]


def check_gpus_per_task(job: ResolvedJob, result: SmokeResult) -> Check:
    """Every task sees the GPUs it asked for: CUDA_VISIBLE_DEVICES and torch agree with the request."""
    reports = [r for r in result.reports if r.get("torch", {}).get("ok")]
    if not reports:
        return _not_checked("gpus_per_task", "no rank imported torch")
    want = job.gpus_per_node
    seen = {_rank_of(r): (_visible(r), int(r["torch"].get("cuda_device_count", 0))) for r in reports}
    if not want:
        shown = sorted({n for _, n in seen.values()})
        return Check("gpus_per_task", True, f"no GPUs requested; torch sees {', '.join(map(str, shown))} GPU(s) per task")
    per_task = want // max(job.ntasks_per_node, 1)
    bad_env = [r for r, (vis, _) in seen.items() if len(vis) not in (want, per_task)]
    if bad_env:
        r = bad_env[0]
        return Check("gpus_per_task", False, f"{want} GPUs per node requested but rank {r} has "
                     f"CUDA_VISIBLE_DEVICES={','.join(seen[r][0]) or '(unset)'} (ranks {_short(bad_env)})",
                     "request GPUs the way the cluster expects (gpu_request = 'gres' or 'gpus-per-node' in the profile)")
    bad_torch = [r for r, (vis, n) in seen.items() if n != len(vis)]
    if bad_torch:
        r = bad_torch[0]
        return Check("gpus_per_task", False, f"rank {r}: CUDA_VISIBLE_DEVICES={','.join(seen[r][0])} but torch sees "
                     f"{seen[r][1]} GPU(s) (ranks {_short(bad_torch)})",
                     "load the CUDA module / use a CUDA build of torch that matches the driver (`nvidia-smi` on the node)")
    counts = sorted({len(v) for v, _ in seen.values()})
    return Check("gpus_per_task", True, f"{want} GPUs per node requested; each task sees "
                 f"{', '.join(map(str, counts))} (CUDA_VISIBLE_DEVICES), torch agrees")


def check_bootstrap(job: ResolvedJob, result: SmokeResult) -> Check:
    """Rank detection, world size, hosts, MASTER_ADDR, MASTER_PORT and the process group."""
    reports = [r for r in result.reports if "bootstrap" in r]
    if not reports:
        return _not_checked("bootstrap", "no rank got as far as the rank bootstrap")
    expected = _expected_ranks(job)
    errors = [(_rank_of(r), r["bootstrap"]["error"]) for r in reports if r["bootstrap"].get("error")]
    if errors:
        ranks = [r for r, _ in errors]
        first = next((r for r in reports if r["bootstrap"].get("error")), {})
        connect = first.get("bootstrap", {}).get("master_connect")
        return Check("bootstrap", False, f"rank(s) {_short(ranks)}: {errors[0][1]}"
                     + (f"; TCP to the master: {connect}" if connect else ""),
                     "check MASTER_ADDR/MASTER_PORT (cyclone-kit env inside the job) and that every rank started")
    hung = [_rank_of(r) for r in reports if "init_ok" not in r["bootstrap"]]
    if hung:
        return Check("bootstrap", False, f"rank(s) {_short(hung)} never finished joining the process group "
                     "(killed or hung in init_process_group)",
                     "a rank that never starts keeps the others waiting: see the python and torch_import checks "
                     "and the job's logs")
    boots = [r["bootstrap"] for r in reports]
    sizes = sorted({b.get("world_size") for b in boots})
    ranks = sorted(b.get("rank") for b in boots)
    hosts = sorted({str(r.get("host")) for r in reports})
    problems = []
    if sizes != [expected]:
        problems.append(f"world size {', '.join(map(str, sizes))} detected, {expected} expected")
    if ranks != list(range(expected)):
        problems.append(f"ranks {_short([r for r in ranks if isinstance(r, int)])} detected, 0-{expected - 1} expected")
    if len(hosts) != job.nodes:
        problems.append(f"ranks ran on {len(hosts)} host(s) ({', '.join(hosts)}), {job.nodes} nodes expected")
    rank0 = next((b for b in boots if b.get("rank") == 0), {})
    if rank0 and rank0.get("port_free") is False:
        problems.append(f"MASTER_PORT {rank0.get('master_port')} was taken on the master host before rank 0 bound it")
    if problems:
        return Check("bootstrap", False, "; ".join(problems),
                     "start one task per rank with srun inside the allocation, and keep MASTER_PORT unique per job")
    init = [float(b.get("init_s", 0)) for b in boots]
    return Check("bootstrap", True, f"world size {expected}, ranks 0-{expected - 1} on {', '.join(hosts)}; master "
                 f"{rank0.get('master_addr')}:{rank0.get('master_port')} ({rank0.get('master_ip')}) reached by every rank, "
                 f"port was free; process group ({rank0.get('backend')}) up in {max(init):.2f} s")


def check_allreduce(job: ResolvedJob, result: SmokeResult) -> Check:
    """An all-reduce across every rank gives the right sum; its bus bandwidth and latency are reported."""
    joined = [r for r in result.reports if r.get("bootstrap", {}).get("init_ok")]
    if not joined:
        return _not_checked("allreduce", "no rank got a process group")
    unfinished = [_rank_of(r) for r in joined if not r.get("done") and not r.get("allreduce", {}).get("error")]
    if unfinished:
        return Check("allreduce", False, f"the all-reduce never finished on rank(s) {_short(unfinished)} "
                     "(killed or hung)", "a hang here is the network: check NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME "
                     "and the firewall between the nodes")
    reports = [r for r in joined if "allreduce" in r]
    errors = [(_rank_of(r), r["allreduce"]["error"]) for r in reports if r["allreduce"].get("error")]
    if errors:
        return Check("allreduce", False, f"all-reduce failed on rank(s) {_short([r for r, _ in errors])}: {errors[0][1]}",
                     "check the network variables (NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME) and the interconnect")
    wrong = [_rank_of(r) for r in reports if not r["allreduce"].get("correct")]
    if wrong:
        got = reports[0]["allreduce"]
        return Check("allreduce", False, f"all-reduce sum wrong on rank(s) {_short(wrong)}: got {got.get('sum')}, "
                     f"expected {got.get('expected')}", "a rank joined another job's process group: keep MASTER_PORT unique")
    r0 = next((r["allreduce"] for r in reports if _rank_of(r) == 0), reports[0]["allreduce"])
    hosts = len({str(r.get("host")) for r in reports})
    return Check("allreduce", True, f"{r0['backend']}, {r0['world_size']} ranks on {hosts} node(s): sum correct; "
                 f"{r0['bytes'] / 2**20:g} MiB in {r0['time_s'] * 1e3:.2f} ms = bus bandwidth {r0['busbw_gbps']:.3f} GB/s; "
                 f"latency {r0['latency_s'] * 1e3:.3f} ms (4 B)")


def _ifname_problems(var: str, value: str, interfaces: Sequence[str]) -> list[str]:
    """Interface names in ``value`` that match none of ``interfaces`` (NCCL's prefix / ``=`` / ``^`` rules)."""
    if value.startswith("^"):
        return []  # an exclusion list cannot name a missing interface
    exact = value.startswith("=")
    names = [n for n in value.lstrip("=").split(",") if n]
    return [n for n in names if not any((i == n) if exact else i.startswith(n) for i in interfaces)]


def check_network(job: ResolvedJob, result: SmokeResult) -> Check:
    """The network interface variables in effect agree across ranks and name interfaces that exist."""
    reports = list(result.reports)
    if not reports:
        return _not_checked("network", "no rank reported")
    settings = {json.dumps(r.get("net_env", {}), sort_keys=True) for r in reports}
    if len(settings) > 1:
        return Check("network", False, f"ranks run with different network variables: {' vs '.join(sorted(settings))}",
                     "set NCCL_*/GLOO_* variables once, in the profile's [env] table")
    env = dict(reports[0].get("net_env", {}))
    for r in reports:
        for var in IFNAME_VARS:
            if var in env:
                bad = _ifname_problems(var, env[var], r.get("interfaces", []))
                if bad:
                    return Check("network", False, f"{var}={env[var]} but {r.get('host')} has no interface "
                                 f"{', '.join(bad)} (it has {', '.join(r.get('interfaces', [])) or 'none'})",
                                 f"set {var} to an interface every node has, or unset it")
    ifaces = sorted({i for r in reports for i in r.get("interfaces", [])})
    shown = ", ".join(f"{k}={v}" for k, v in sorted(env.items())) or "no NCCL/GLOO/UCX interface variables set " \
        "(the libraries pick the interface themselves)"
    return Check("network", True, f"{shown}; interfaces on the nodes: {', '.join(ifaces) or 'none'}")


def network_figures(job: ResolvedJob, result: SmokeResult, *, time: str = "") -> NetworkFigures | None:
    """The latency and bus bandwidth of each level the probe swept (pure); None when nothing was swept.

    Each level is fitted from its lowest rank's points (every member timed the same collectives).
    """
    levels, skipped = {}, {}
    backend = "gloo"
    for report in sorted(result.reports, key=_rank_of):
        sweep = report.get("sweep") or {}
        backend = str(report.get("allreduce", {}).get("backend", backend))
        skipped.update({str(k): str(v) for k, v in dict(sweep.get("skipped", {})).items()})
        for name, level in dict(sweep.get("levels", {})).items():
            points = [(int(p[0]), float(p[1])) for p in level.get("points", []) if len(p) == 2]
            if name in levels or len(points) < 2:
                continue
            ranks, hosts = list(level.get("ranks", [])), list(level.get("hosts", []))
            where = f"{len(ranks)} ranks on {', '.join(hosts)}"
            levels[name] = level_from_points(points, len(ranks), len(hosts), source=f"measured by doctor: {where}")
    if not levels:
        return None
    part = job.partition
    return NetworkFigures(levels=levels, source="measured", cluster=job.profile.name, partition=part.name,
                          device="cuda" if backend == "nccl" else "cpu", device_type=part.gpu_type if backend == "nccl"
                          else "", backend=backend, origin=f"doctor run {result.run_dir}", time=time, skipped=skipped)


def check_network_figures(job: ResolvedJob, result: SmokeResult, figures: NetworkFigures | None) -> Check:
    """The all-reduce sweep's fitted latency and bus bandwidth per level (``data``: the network.json document)."""
    if figures is None:
        joined = [r for r in result.reports if r.get("bootstrap", {}).get("init_ok")]
        why = "no rank got a process group" if not joined else "no rank finished the all-reduce sweep"
        return Check("network_figures", None if not joined else False, why,
                     "" if not joined else "see the allreduce row; a sweep that never ends is the network")
    parts = []
    for name in ("intra", "inter"):
        level = figures.level(name)
        if level is None:
            parts.append(f"{name}-node: not measured ({figures.skipped.get(name, 'no such ranks')})")
            continue
        sizes = [s for s, _ in level.points]
        parts.append(f"{name}-node ({level.ranks} ranks): latency {level.alpha_s * 1e6:.1f} us, bus bandwidth "
                     f"{level.busbw_gbps:.3g} GB/s (peak {level.busbw_peak_gbps:.3g} GB/s; {len(sizes)} sizes, "
                     f"{_size(min(sizes))} - {_size(max(sizes))})")
    return Check("network_figures", True, "; ".join(parts), data=figures.to_dict())


def _size(n: int) -> str:
    """4 B, 64 KiB, 64 MiB."""
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


def live_checks(job: ResolvedJob, result: SmokeResult, host: HostVersions,
                figures: NetworkFigures | None = None) -> list[Check]:
    """Every check of the smoke job's rank reports, in report order.

    A job that never ran (refused by sbatch, or still pending when doctor stopped waiting) gives
    its one row: the per-rank checks would only repeat it.
    """
    if not result.job_id or (not result.finished and not result.reports):
        return [check_smoke_job(job, result)]
    return [
        check_smoke_job(job, result),
        *([check_container(job, result)] if job.spec.container is not None else []),
        check_python(job, result, host),
        check_torch_import(job, result, host),
        check_gpus_per_task(job, result),
        check_bootstrap(job, result),
        check_allreduce(job, result),
        check_network_figures(job, result, figures if figures is not None else network_figures(job, result)),
        check_network(job, result),
    ]


LIVE_CHECKS = ("smoke_job", "python", "torch_import", "gpus_per_task", "bootstrap", "allreduce", "network_figures",
               "network")


def skipped_live_checks(why: str) -> list[Check]:
    """The one row that stands for the live checks when the smoke job was not run, saying why."""
    return [_not_checked("smoke_job", why)]


# --------------------------------------------------------------------------- output
def exit_code(checks: Sequence[Check]) -> int:
    """1 when any check failed, else 0 (checks that were not run do not fail)."""
    return 1 if any(c.ok is False for c in checks) else 0


def to_json(checks: Sequence[Check]) -> str:
    """The ``--json`` output: a list of ``{check, ok, detail, hint}`` objects."""
    return json.dumps([c.to_dict() for c in checks], indent=1)


def format_table(checks: Sequence[Check]) -> str:
    """One row per check: status, name, detail, and the HINT when it failed."""
    width = max((len(c.check) for c in checks), default=5)
    rows = []
    for c in checks:
        status = {True: "ok", False: "FAIL", None: "skip"}[c.ok]
        hint = f"  HINT: {c.hint}" if c.hint and c.ok is False else ""
        rows.append(f"{status:<4}  {c.check:<{width}}  {c.detail}{hint}")
    failed = sum(1 for c in checks if c.ok is False)
    passed = sum(1 for c in checks if c.ok)
    skipped = sum(1 for c in checks if c.ok is None)
    rows.append(f"{passed} passed, {failed} failed, {skipped} not checked")
    return "\n".join(rows) + "\n"
