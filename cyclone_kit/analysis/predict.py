"""A calibrated performance model of data-parallel training: what N nodes will give (pure, stdlib only).

The model, per optimizer step on N ranks (``m`` nodes x ``r`` ranks per node)::

    T(N) = T_data(N) + T_compute(N) + max(0, T_comm(N) - overlap(N)) + T_fixed

* ``T_data`` and ``T_compute`` come from a calibration run (the phases of a 1-rank or 1-node run's
  step records, :class:`Calibration`). In a strong study the per-device batch shrinks as B / N and
  both scale with it (linear in the batch: an assumption, listed; small per-GPU batches usually run
  below that line on GPUs); in a weak study they stay. Where the ranks of one machine would have
  fewer cores than threads (``cores per rank < threads``), compute is slowed by ``threads / cores``.
* ``T_comm(N)`` is the gradient all-reduce: the model's gradient bytes (parameters x the all-reduce
  dtype: 4 B, or 2 B with an fp16/bf16 compression hook), cut into DDP buckets of ``bucket_cap_mb``,
  each one all-reduce costing, on the level the ranks span (``intra`` inside a node, ``inter`` across
  nodes, :class:`Level`)::

      ring: 2 (n - 1) alpha_hop + 2 (n - 1) / n x S / busbw
      tree: 2 (ceil(log2 m) alpha_inter + (r - 1) alpha_intra) + 2 S / busbw_inter

  ``busbw`` is the bus bandwidth as nccl-tests reports it (``algbw x 2 (n - 1) / n``), so a figure
  measured by ``cyclone-kit doctor`` on this cluster plugs straight in; ``alpha_hop`` is the
  measured small-message latency over the ``2 (n - 1)`` ring steps it was measured with. NCCL
  chooses the cheaper of ring and tree across nodes (approximated here by the minimum); gloo and
  Horovod-on-gloo always use a ring.
* ``overlap(N)``: DDP starts a bucket's all-reduce while backward still runs, so the all-reduces
  of every bucket but the last can hide behind at most the backward share of compute
  (``backward_share``, 2/3 by default: backward costs about twice the forward). This is an
  estimate (the engine measures the exposed part; the model cannot see it before the run). On CPU
  (gloo) the all-reduce runs on the ranks' own cores: it hides only where a rank has a spare core
  (cores per rank > threads).
* ``T_fixed``: the rest of a step (the measured step time minus its phases) stays as measured.

Nothing here reads a file or imports torch; :mod:`cyclone_kit.analysis.calibrate` builds the inputs
(from a study's records, a job spec and a profile) and :mod:`cyclone_kit.rundir.network` owns the figures.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from cyclone_kit.rundir.network import LEVELS, Level, NetworkFigures

#: Bytes per gradient element of each all-reduce dtype.
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
#: Share of compute that is backward (the part an overlapped all-reduce can hide behind).
BACKWARD_SHARE = 2 / 3


@dataclass(frozen=True)
class Calibration:
    """Per-step phases of the calibration run (seconds, medians over its steady-state step records).

    Attributes:
        world_size: its ranks (N0); ranks_per_node its ranks per node.
        per_device_batch: its per-device batch.
        step_s, data_s, compute_s, comm_s, exposed_s, rest_s: the step and its phases.
        spread: (low, high) step time over the steady-state windows (10th/90th percentile).
        cores_per_rank: the cores each rank's affinity gave it (shared cores counted once per machine).
        threads: compute threads per rank.
        source: what was measured (run directory, records used).
    """

    world_size: int
    ranks_per_node: int
    per_device_batch: int
    step_s: float
    data_s: float
    compute_s: float
    comm_s: float = 0.0
    exposed_s: float = 0.0
    rest_s: float = 0.0
    spread: tuple[float, float] = (0.0, 0.0)
    cores_per_rank: float = 0.0
    threads: int = 1
    source: str = ""


@dataclass(frozen=True)
class Workload:
    """What each step communicates and how the batch scales.

    Attributes:
        model: model name; grad_elements its trainable parameters.
        dtype: the all-reduce dtype (``fp32``; ``fp16``/``bf16`` with a compression hook).
        bucket_mb: DDP's bucket cap (``train.bucket_cap_mb``).
        mode: ``strong`` (global batch fixed) or ``weak`` (per-device batch fixed).
        global_batch: the global batch (strong); per_device_batch the per-device one (weak).
        device: ``cpu`` or ``cuda`` (CPU: comm overlaps only with a spare core).
    """

    model: str
    grad_elements: int
    dtype: str = "fp32"
    bucket_mb: float = 25.0
    mode: str = "strong"
    global_batch: int = 0
    per_device_batch: int = 0
    device: str = "cpu"

    @property
    def grad_bytes(self) -> int:
        """Bytes all-reduced per step."""
        return self.grad_elements * DTYPE_BYTES[self.dtype]

    def buckets(self) -> list[int]:
        """Bucket sizes in bytes (DDP fills buckets up to the cap; the last one holds the rest)."""
        cap = max(1, int(self.bucket_mb * 2**20))
        full, rest = divmod(self.grad_bytes, cap)
        return [cap] * full + ([rest] if rest else [])


@dataclass(frozen=True)
class Machine:
    """Cores per machine, to tell when ranks would share cores.

    Attributes:
        cores: cores one machine gives its ranks (the union of the ranks' affinity).
        nodes_per_machine: Slurm nodes on one machine (more than 1 on an emulated cluster).
        declared_cpus: the CPUs per node the profile declares.
    """

    cores: float
    nodes_per_machine: int = 1
    declared_cpus: int = 0


@dataclass(frozen=True)
class Point:
    """The prediction at one node count."""

    nodes: int
    ranks_per_node: int
    world_size: int
    per_device_batch: float
    step_s: float
    step_low_s: float
    step_high_s: float
    data_s: float
    compute_s: float
    comm_s: float
    exposed_s: float
    rest_s: float
    samples_per_s: float
    efficiency: float
    efficiency_low: float
    efficiency_high: float
    device_hours_per_1m: float
    algorithm: str
    level: str
    cores_per_rank: float
    shared_cores: bool

    def to_dict(self) -> dict[str, float | int | str | bool]:
        """The JSON form of this point."""
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True)
class Prediction:
    """Predicted points and every assumption the numbers rest on."""

    points: tuple[Point, ...]
    assumptions: tuple[str, ...]
    notes: tuple[str, ...] = field(default=())

    def point(self, world_size: int) -> Point | None:
        """The point at ``world_size`` ranks, if predicted."""
        return next((p for p in self.points if p.world_size == world_size), None)


def ring_allreduce_s(size: float, n: int, alpha_hop_s: float, busbw_gbps: float) -> float:
    """Seconds of one ring all-reduce of ``size`` bytes over ``n`` ranks (0 for one rank)."""
    if n <= 1 or size <= 0:
        return 0.0
    return 2 * (n - 1) * alpha_hop_s + 2 * (n - 1) / n * size / (busbw_gbps * 1e9)


def tree_allreduce_s(size: float, nodes: int, per_node: int, inter: Level, intra: Level | None) -> float:
    """Seconds of one NCCL tree all-reduce: a chain inside each node, a double binary tree across nodes."""
    if nodes * per_node <= 1 or size <= 0:
        return 0.0
    hops = math.ceil(math.log2(nodes)) * inter.alpha_hop_s if nodes > 1 else 0.0
    if per_node > 1 and intra is not None:
        hops += (per_node - 1) * intra.alpha_hop_s
    bandwidth = inter.busbw_gbps if nodes > 1 else (intra.busbw_gbps if intra else inter.busbw_gbps)
    return 2 * hops + 2 * size / (bandwidth * 1e9)


def _ring_level(network: NetworkFigures, nodes: int, per_node: int) -> tuple[str, float, float]:
    """(level, alpha_hop, busbw) a ring over this layout runs at: the slowest link it crosses."""
    intra, inter = network.level("intra"), network.level("inter")
    if nodes <= 1:
        if intra is None:
            raise MissingLevel("intra")
        return "intra", intra.alpha_hop_s, intra.busbw_gbps
    if inter is None:
        raise MissingLevel("inter")
    if per_node > 1 and intra is not None:
        return "inter", max(inter.alpha_hop_s, intra.alpha_hop_s), min(inter.busbw_gbps, intra.busbw_gbps)
    return "inter", inter.alpha_hop_s, inter.busbw_gbps


class MissingLevel(Exception):
    """The network figures lack the level a layout needs."""

    def __init__(self, level: str) -> None:
        super().__init__(level)
        self.level = level


def comm_per_step(workload: Workload, network: NetworkFigures, nodes: int, per_node: int) -> tuple[float, str, str, float]:
    """(seconds, algorithm, level, last bucket's seconds) of one step's gradient all-reduces.

    Raises:
        MissingLevel: the layout spans a level the network figures do not have.
    """
    n = nodes * per_node
    if n <= 1:
        return 0.0, "none", "none", 0.0
    level, alpha, busbw = _ring_level(network, nodes, per_node)
    ring = [ring_allreduce_s(b, n, alpha, busbw) for b in workload.buckets()]
    algorithm, times = "ring", ring
    if network.backend == "nccl" and nodes > 1:
        inter = network.level("inter")
        assert inter is not None  # _ring_level checked it
        tree = [tree_allreduce_s(b, nodes, per_node, inter, network.level("intra")) for b in workload.buckets()]
        if sum(tree) < sum(ring):
            algorithm, times = "tree", tree
    return sum(times), algorithm, level, (times[-1] if times else 0.0)


def _batch_at(workload: Workload, calibration: Calibration, world_size: int) -> float:
    """Per-device batch at ``world_size`` ranks."""
    if workload.mode == "strong":
        return workload.global_batch / world_size
    return float(workload.per_device_batch or calibration.per_device_batch)


def _cores_per_rank(machine: Machine | None, per_node: int, nodes: int) -> float:
    """Cores each rank would get: a machine's cores over the ranks it would hold (0 when unknown)."""
    if machine is None or machine.cores <= 0:
        return 0.0
    ranks_on_machine = per_node * min(nodes, max(1, machine.nodes_per_machine))
    return machine.cores / ranks_on_machine


def predict_point(calibration: Calibration, workload: Workload, network: NetworkFigures, nodes: int, per_node: int,
                  machine: Machine | None = None, backward_share: float = BACKWARD_SHARE) -> Point:
    """The model at ``nodes`` x ``per_node`` ranks (see the module docstring).

    Raises:
        MissingLevel: the layout needs a network level the figures do not have.
    """
    n = nodes * per_node
    base_batch = calibration.per_device_batch
    batch = _batch_at(workload, calibration, n)
    scale = batch / base_batch if base_batch else 1.0
    cores = _cores_per_rank(machine, per_node, nodes)
    threads = max(1, calibration.threads)
    base_cores = calibration.cores_per_rank or float(threads)
    # compute runs at min(threads, cores) cores' speed: fewer cores than threads time-share them
    slowdown = min(threads, base_cores) / min(threads, cores) if cores else 1.0
    data = calibration.data_s * scale
    compute = calibration.compute_s * scale * slowdown
    comm, algorithm, level, last = comm_per_step(workload, network, nodes, per_node)
    spare_core = workload.device != "cpu" or (cores > threads if cores else False)
    overlap = min(max(0.0, comm - last), backward_share * compute) if spare_core else 0.0
    exposed = max(0.0, comm - overlap)
    fixed = calibration.rest_s
    step = data + compute + exposed + fixed
    low_f, high_f = _spread_factors(calibration)
    step_low = (data + compute) * low_f + exposed + fixed
    step_high = (data + compute) * high_f + exposed + fixed
    global_batch = batch * n
    rate = global_batch / step if step > 0 else 0.0
    base_rate = calibration.per_device_batch * calibration.world_size / calibration.step_s
    per_device = rate / n
    base_per_device = base_rate / calibration.world_size

    def eff(step_time: float) -> float:
        return (global_batch / step_time / n) / base_per_device if step_time > 0 else 0.0

    return Point(
        nodes=nodes, ranks_per_node=per_node, world_size=n, per_device_batch=batch, step_s=step,
        step_low_s=step_low, step_high_s=step_high, data_s=data, compute_s=compute, comm_s=comm, exposed_s=exposed,
        rest_s=fixed, samples_per_s=rate, efficiency=per_device / base_per_device if base_per_device else 0.0,
        efficiency_low=eff(step_high), efficiency_high=eff(step_low),
        device_hours_per_1m=(n / rate * 1e6 / 3600) if rate > 0 else math.inf, algorithm=algorithm, level=level,
        cores_per_rank=cores, shared_cores=bool(cores and cores < threads),
    )


def _spread_factors(calibration: Calibration) -> tuple[float, float]:
    """(low, high) factors of the calibration's step-time spread around its median (1, 1 when unknown)."""
    low, high = calibration.spread
    if calibration.step_s <= 0 or low <= 0 or high <= 0:
        return 1.0, 1.0
    return min(1.0, low / calibration.step_s), max(1.0, high / calibration.step_s)


def predict(calibration: Calibration, workload: Workload, network: NetworkFigures, nodes: Sequence[int], per_node: int,
            machine: Machine | None = None, backward_share: float = BACKWARD_SHARE) -> Prediction:
    """The model at every node count in ``nodes`` (``per_node`` ranks each), with its assumptions.

    Raises:
        MissingLevel: a layout needs a network level the figures do not have.
    """
    points = tuple(predict_point(calibration, workload, network, m, per_node, machine, backward_share)
                   for m in nodes)
    return Prediction(points=points, assumptions=assumptions(calibration, workload, network, machine, backward_share),
                      notes=tuple(shared_core_notes(points, calibration, machine)))


def assumptions(calibration: Calibration, workload: Workload, network: NetworkFigures, machine: Machine | None,
                backward_share: float = BACKWARD_SHARE) -> tuple[str, ...]:
    """Every assumption a prediction rests on, one sentence each."""
    mib = workload.grad_bytes / 2**20
    out = [
        f"calibration: {calibration.source or 'given'} (N0 = {calibration.world_size}, per-device batch "
        f"{calibration.per_device_batch}; step {calibration.step_s * 1e3:.1f} ms = data {calibration.data_s * 1e3:.1f}"
        f" + compute {calibration.compute_s * 1e3:.1f} + exposed comm {calibration.exposed_s * 1e3:.1f} + rest "
        f"{calibration.rest_s * 1e3:.1f} ms)",
        f"gradients: {workload.model}, {workload.grad_elements:,} parameters x {DTYPE_BYTES[workload.dtype]} B "
        f"({workload.dtype}) = {mib:.1f} MiB per step in {len(workload.buckets())} bucket(s) of at most "
        f"{workload.bucket_mb:g} MiB, one all-reduce each",
        ("strong scaling: the global batch " + f"{workload.global_batch} is split over the ranks; data and compute "
         "time scale linearly with the per-device batch (GPUs often run small batches less efficiently: then "
         "the prediction is optimistic)") if workload.mode == "strong" else
        f"weak scaling: the per-device batch stays {workload.per_device_batch or calibration.per_device_batch}; data "
        "and compute time per step stay as calibrated",
        "all-reduce: ring 2(n-1) alpha + 2(n-1)/n S / busbw on the slowest level the ranks span"
        + ("; NCCL's tree (2 log2(nodes) alpha + 2 S / busbw) where it is cheaper" if network.backend == "nccl"
           else f"; {network.backend} uses a ring"),
        (f"overlap: up to {backward_share:.0%} of compute (backward) hides the all-reduce of every bucket but the last"
         + (" where a rank has a spare core (gloo reduces on the CPU)" if workload.device == "cpu" else "")),
        "the rest of a step (optimizer bookkeeping, logging, Python) stays as calibrated",
    ]
    for name in LEVELS:
        level = network.level(name)
        if level is not None:
            kind = "published" if network.published else "measured"
            out.append(f"network {name}-node ({kind}): latency {level.alpha_s * 1e6:.1f} us at {level.ranks} ranks, "
                       f"bus bandwidth {level.busbw_gbps:.3g} GB/s; {level.source or network.origin}")
        else:
            out.append(f"network {name}-node: not known (layouts that need it are not predicted)")
    if machine is not None and machine.cores:
        out.append(f"cores: {machine.cores:g} per machine from the ranks' affinity, {machine.nodes_per_machine} "
                   f"node(s) per machine, {calibration.threads} compute thread(s) per rank"
                   + (f"; the profile declares {machine.declared_cpus} CPUs per node" if machine.declared_cpus else ""))
    return tuple(out)


def shared_core_notes(points: Sequence[Point], calibration: Calibration, machine: Machine | None) -> list[str]:
    """One sentence per point whose ranks would share cores (then compute slows, not the network)."""
    notes = []
    for p in points:
        if p.shared_cores and machine is not None:
            notes.append(
                f"at N = {p.world_size}: {p.ranks_per_node * min(p.nodes, machine.nodes_per_machine)} rank(s) on a "
                f"machine with {machine.cores:g} core(s) = {p.cores_per_rank:.2g} core(s) per rank for "
                f"{calibration.threads} thread(s): the ranks share cores, so compute slows by "
                f"{min(calibration.threads, calibration.cores_per_rank or calibration.threads) / p.cores_per_rank:.2g}x "
                "(this is the machine, not the network)"
                + (f"; the profile declares {machine.declared_cpus} CPUs per node, the ranks see {machine.cores:g}"
                   if machine.declared_cpus and machine.declared_cpus > machine.cores else ""))
    return notes
