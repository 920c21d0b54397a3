"""``cyclone-kit predict``'s library side: gather the model's inputs, check them, run it, format it.

* :func:`forecast_study`: calibrated from a study's (or run's) 1-node run (:mod:`cyclone_kit.analysis.calibrate`),
  with the prediction error at every N the study measured;
* :func:`forecast_spec`: from a job spec, with a given compute time per step (``--compute-s``, e.g. from a
  published benchmark, labelled) or, without one, the gradient all-reduce alone and the calibration run to
  make;
* :func:`resolve_network`: ``--network network.json`` (doctor's measured figures), else the partition's
  published ``[network]`` table; figures from another cluster or device type are refused.

The model itself is :mod:`cyclone_kit.analysis.predict` (pure).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cyclone_kit.analysis.predict import Calibration, Machine, MissingLevel, Prediction, Workload, comm_per_step, predict
from cyclone_kit.config.profile import ClusterProfile, Partition, load_profile
from cyclone_kit.core.errors import ValidationError
from cyclone_kit.rundir.network import NetworkFigures, load_network


@dataclass(frozen=True)
class Forecast:
    """A prediction with where its inputs came from.

    Attributes:
        prediction: the points and assumptions (None for a spec without a calibration).
        workload: what is all-reduced; network: the figures used.
        measured: world size -> measured efficiency (a study's points).
        errors: world size -> predicted - measured efficiency (percentage points / 100).
        calibration_run: the command that makes a calibration run (a spec without one).
        comm_only: (nodes, world size, seconds, algorithm) of the all-reduce per step (a spec without calibration).
        where: ``profile / partition``.
    """

    prediction: Prediction | None
    workload: Workload
    network: NetworkFigures
    measured: Mapping[int, float] = field(default_factory=dict)
    errors: Mapping[int, float] = field(default_factory=dict)
    calibration_run: str = ""
    comm_only: tuple[tuple[int, int, float, str], ...] = ()
    where: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` form."""
        return {
            "where": self.where,
            "model": self.workload.model, "gradient_bytes": self.workload.grad_bytes, "mode": self.workload.mode,
            "network": {"source": self.network.source, "origin": self.network.origin, "backend": self.network.backend},
            "points": [p.to_dict() for p in self.prediction.points] if self.prediction else [],
            "assumptions": list(self.prediction.assumptions) if self.prediction else [],
            "notes": list(self.prediction.notes) if self.prediction else [],
            "measured_efficiency": {str(k): v for k, v in self.measured.items()},
            "prediction_error": {str(k): v for k, v in self.errors.items()},
            "calibration_run": self.calibration_run,
            "comm_only": [{"nodes": m, "world_size": n, "comm_s": s, "algorithm": a} for m, n, s, a in self.comm_only],
        }


def parse_nodes(text: str) -> tuple[int, ...]:
    """``1,2,4,8`` -> (1, 2, 4, 8).

    Raises:
        ValidationError: not a comma-separated list of positive integers.
    """
    try:
        nodes = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        nodes = ()
    if not nodes or any(n < 1 for n in nodes):
        raise ValidationError(f"--nodes {text!r} is not a list of node counts", hint="write e.g. --nodes 1,2,4,8,16")
    return tuple(sorted(set(nodes)))


def check_layout(part: Partition, nodes: Sequence[int], per_node: int, where: str) -> None:
    """Every node count fits the partition, and ``per_node`` ranks divide its GPUs per node.

    Raises:
        ValidationError: too many nodes, or ranks per node that do not divide the GPUs (or exceed the CPUs).
    """
    if max(nodes) > part.nodes:
        raise ValidationError(f"--nodes {max(nodes)} but {where} has {part.nodes} nodes",
                              hint=f"predict for at most {part.nodes} nodes on this partition")
    if part.gpus_per_node:
        if per_node > part.gpus_per_node or part.gpus_per_node % per_node:
            good = ", ".join(str(k) for k in range(1, part.gpus_per_node + 1) if part.gpus_per_node % k == 0)
            raise ValidationError(f"--ntasks-per-node {per_node} does not divide the {part.gpus_per_node} GPUs per node "
                                  f"of {where}", hint=f"use --ntasks-per-node {good}")
    elif per_node > part.cpus_per_node:
        raise ValidationError(f"--ntasks-per-node {per_node} but {where} has {part.cpus_per_node} CPUs per node",
                              hint=f"use --ntasks-per-node {part.cpus_per_node} or fewer")


def resolve_network(network_path: str | None, profile: ClusterProfile, part: Partition) -> NetworkFigures:
    """The figures to predict with: ``network_path``, else the partition's published table.

    Raises:
        ValidationError: none known, or figures from another cluster, partition device or backend.
    """
    where = f"partition {part.name!r} of profile {profile.name!r}"
    if network_path is None:
        if part.network is None:
            raise ValidationError(f"no network figures for {where}",
                                  hint=f"run `cyclone-kit doctor --profile {profile.name} --partition {part.name} "
                                  "--nodes 2` and pass its network.json with --network")
        return part.network
    figures = load_network(network_path)
    device = "cuda" if part.gpus_per_node else "cpu"
    if figures.cluster and figures.cluster != profile.name:
        raise ValidationError(f"{network_path} was measured on cluster {figures.cluster!r}, not {profile.name!r}",
                              hint=f"run `cyclone-kit doctor --profile {profile.name}` there, or predict with "
                              f"--profile {figures.cluster}")
    if figures.device != device or (device == "cuda" and figures.device_type and part.gpu_type
                                    and figures.device_type.lower() != part.gpu_type.lower()):
        got = figures.device_type or figures.device
        raise ValidationError(f"{network_path} holds {got} figures, but {where} runs on {part.gpu_type or device}",
                              hint=f"run `cyclone-kit doctor --partition {part.name}` for that partition's figures")
    return figures


def prediction_errors(prediction: Prediction, measured: Mapping[int, tuple[int, int, float]]) -> dict[int, float]:
    """Predicted minus measured efficiency at every measured N the prediction holds in the same layout."""
    out = {}
    for n, (nodes, per_node, eff) in measured.items():
        point = prediction.point(n)
        if point is not None and (point.nodes, point.ranks_per_node) == (nodes, per_node):
            out[n] = point.efficiency - eff
    return out


def _predict(calibration: Calibration, workload: Workload, network: NetworkFigures, nodes: Sequence[int], per_node: int,
             machine: Machine | None) -> Prediction:
    try:
        return predict(calibration, workload, network, nodes, per_node, machine)
    except MissingLevel as e:
        what = "inside a node" if e.level == "intra" else "across nodes"
        raise ValidationError(f"the network figures ({network.origin}) have no {e.level}-node level: a layout needs "
                              f"an all-reduce {what}", hint="run `cyclone-kit doctor` with 2 nodes and 2 or more tasks "
                              "per node, or predict only layouts the figures cover") from None


def forecast_study(path: str | Path, nodes: Sequence[int], per_node: int | None = None, network_path: str | None = None,
                   profile: str | None = None, partition: str | None = None) -> Forecast:
    """Calibrate from a study (or run) directory and predict at ``nodes``.

    Raises:
        ValidationError: no usable calibration run, bad layout or network figures.
    """
    import warnings

    from cyclone_kit.analysis.ingest import MetricsWarning, load_runs
    from cyclone_kit.analysis.scaling import scaling_table

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MetricsWarning)
        data = load_runs([path], warn=False)
    return forecast_data(data, scaling_table(data.runs), nodes, per_node, network_path, profile, partition)


def forecast_data(data: Any, table: Any, nodes: Sequence[int] | None = None, per_node: int | None = None,
                  network_path: str | None = None, profile: str | None = None, partition: str | None = None
                  ) -> Forecast:
    """As :func:`forecast_study`, on runs already read (:class:`~cyclone_kit.analysis.ingest.Ingested` and its
    scaling table); ``nodes`` None: the measured node counts and two doublings beyond the largest.

    Raises:
        ValidationError: no usable calibration run, bad layout or network figures.
    """
    from cyclone_kit.analysis.calibrate import study_inputs

    inputs = study_inputs(data, table)
    prof = load_profile(profile or inputs.profile or "local")
    part_name = partition or inputs.partition
    part = prof.partition(part_name) if part_name else prof.default_partition
    per_node = per_node or max((k for _, k, _ in inputs.measured.values()), default=1)
    measured_nodes = sorted({m for m, k, _ in inputs.measured.values() if k == per_node})
    if nodes is None:
        top = max(measured_nodes, default=1)
        nodes = [m for m in (*measured_nodes, 2 * top, 4 * top) if m <= part.nodes] or [1]
    check_layout(part, nodes, per_node, f"partition {part.name!r} of profile {prof.name!r}")
    network = resolve_network(network_path, prof, part)
    machine = inputs.machine
    if machine is not None:
        machine = Machine(cores=machine.cores, nodes_per_machine=machine.nodes_per_machine,
                          declared_cpus=part.cpus_per_node)
    prediction = _predict(inputs.calibration, inputs.workload, network, sorted({*nodes, *measured_nodes}), per_node,
                          machine)
    return Forecast(prediction=prediction, workload=inputs.workload, network=network,
                    measured={n: e for n, (_, _, e) in inputs.measured.items()},
                    errors=prediction_errors(prediction, inputs.measured), where=f"{prof.name} / {part.name}")


def calibration_command(spec_path: str, profile: str, partition: str) -> str:
    """The short 1-rank calibration run ``predict`` asks for when it has none."""
    return (f"cyclone-kit submit {spec_path} --profile {profile} --partition {partition} --nodes 1 "
            "--ntasks-per-node 1 --set train.steps=60 --set train.log_every=5   # then: cyclone-kit predict RUN_DIR ...")


def forecast_spec(spec_path: str | Path, nodes: Sequence[int], per_node: int | None = None,
                  network_path: str | None = None, profile: str | None = None, partition: str | None = None,
                  compute_s: float | None = None, compute_source: str = "") -> Forecast:
    """Predict for a job spec: with ``compute_s`` (one device's compute per step at the spec's batch), else the
    all-reduce alone plus the calibration run to make.

    Raises:
        ValidationError: bad spec, layout, model or network figures.
    """
    from cyclone_kit.analysis.calibrate import workload_from_spec
    from cyclone_kit.config.job import load_spec, spec_to_dict

    spec = load_spec(spec_path)
    prof = load_profile(profile or spec.resources.profile)
    part = prof.partition(partition or spec.resources.partition) if (partition or spec.resources.partition) \
        else prof.default_partition
    per_node = per_node or spec.resources.ntasks_per_node or part.gpus_per_node or 1
    where = f"partition {part.name!r} of profile {prof.name!r}"
    check_layout(part, nodes, per_node, where)
    network = resolve_network(network_path, prof, part)
    batch = spec.train.batch_size
    workload = workload_from_spec(spec_to_dict(spec), mode="weak", global_batch=batch, per_device_batch=batch,
                                  device="cuda" if part.gpus_per_node else "cpu")
    if compute_s is None:
        rows = []
        for m in nodes:
            try:
                seconds, algorithm, _, _ = comm_per_step(workload, network, m, per_node)
            except MissingLevel as e:
                raise ValidationError(f"the network figures have no {e.level}-node level",
                                      hint="run `cyclone-kit doctor` with 2 nodes and several tasks per node") from None
            rows.append((m, m * per_node, seconds, algorithm))
        return Forecast(prediction=None, workload=workload, network=network, comm_only=tuple(rows),
                        calibration_run=calibration_command(str(spec_path), prof.name, part.name),
                        where=f"{prof.name} / {part.name}")
    if not compute_s > 0:
        raise ValidationError(f"--compute-s {compute_s:g} is not positive", hint="give seconds per step, e.g. 0.7")
    calibration = Calibration(world_size=1, ranks_per_node=1, per_device_batch=batch, step_s=compute_s, data_s=0.0,
                              compute_s=compute_s, source=compute_source or f"given: --compute-s {compute_s:g} "
                              f"(one device's compute per step at batch {batch}; data loading not included)")
    prediction = _predict(calibration, workload, network, nodes, per_node, None)
    return Forecast(prediction=prediction, workload=workload, network=network, where=f"{prof.name} / {part.name}")


def format_forecast(forecast: Forecast) -> str:
    """The text ``predict`` prints: a table per N, then the errors, notes and assumptions."""
    w, net = forecast.workload, forecast.network
    label = "published (not measured here)" if net.published else "measured"
    lines = [f"predict: {w.model} on {forecast.where}, {w.mode} scaling; network figures {label}: {net.origin}"]
    if forecast.prediction is None:
        lines.append(f"gradient all-reduce per step ({w.grad_bytes / 2**20:.1f} MiB, {net.backend}):")
        lines += [f"  {m:>3} node(s), N = {n:>4}: {s * 1e3:9.2f} ms ({a})" for m, n, s, a in forecast.comm_only]
        lines.append("no step-time prediction without a calibration: run one short 1-rank calibration run,")
        lines.append(f"  {forecast.calibration_run}")
        lines.append("  or pass --compute-s SECONDS (one device's compute per step, e.g. from a published benchmark)")
        return "\n".join(lines) + "\n"
    head = (f"{'nodes':>5} {'N':>5} {'step ms':>10} {'band ms':>17} {'samples/s':>11} {'efficiency':>11} "
            f"{'band':>13} {'dev-h/1M':>9}  comm ms (exposed, algorithm)")
    lines.append(head)
    for p in forecast.prediction.points:
        lines.append(
            f"{p.nodes:>5} {p.world_size:>5} {p.step_s * 1e3:>10.1f} {p.step_low_s * 1e3:>8.1f}-{p.step_high_s * 1e3:<8.1f}"
            f" {p.samples_per_s:>11.1f} {100 * p.efficiency:>10.1f}% {100 * p.efficiency_low:>6.1f}-"
            f"{100 * p.efficiency_high:<5.1f}% {p.device_hours_per_1m:>9.3g}  {p.comm_s * 1e3:.1f} "
            f"({p.exposed_s * 1e3:.1f}, {p.algorithm})" + ("  [ranks share cores]" if p.shared_cores else ""))
    for n, err in sorted(forecast.errors.items()):
        lines.append(f"measured at N = {n}: efficiency {100 * forecast.measured[n]:.1f} %, predicted "
                     f"{100 * forecast.prediction.point(n).efficiency:.1f} %: error {100 * err:+.1f} points")
    lines += [f"note: {n}" for n in forecast.prediction.notes]
    lines.append("assumptions:")
    lines += [f"  - {a}" for a in forecast.prediction.assumptions]
    return "\n".join(lines) + "\n"


def forecast_json(forecast: Forecast) -> str:
    """The ``--json`` output."""
    return json.dumps(forecast.to_dict(), indent=1)
