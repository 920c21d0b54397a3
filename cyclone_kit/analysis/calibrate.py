"""The inputs of a prediction, read from a study: the calibration run's phases, the workload, the cores.

:func:`study_inputs` takes what :func:`cyclone_kit.analysis.ingest.load_runs` read and finds the
calibration run (the smallest complete run, one node), the median of each phase of its steady
state step records (the first record of a segment is warm-up), the workload its ``spec.json``
describes (model, classes, image size, bucket cap, fp16 compression) and the cores each machine
gave its ranks (the union of the ranks' affinity per machine id, from the rank summaries).

Honesty: a run whose step records carry no phases (schema 1, or a script without
``ck.instrument``) calibrates nothing; :func:`calibration_from_steps` refuses it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pandas as pd

from cyclone_kit.analysis.gradients import parameter_count
from cyclone_kit.analysis.predict import Calibration, Machine, Workload
from cyclone_kit.core.errors import ValidationError
from cyclone_kit.rundir.contract import cpu_set_ids

#: The step-record phases the model needs (schema 2; :mod:`cyclone_kit.rundir.contract`).
PHASES = ("data_time_s", "compute_time_s", "comm_time_s", "comm_exposed_s", "other_time_s")
#: Data sets with one channel (everything else is RGB).
ONE_CHANNEL = ("fashion_mnist",)


@dataclass(frozen=True)
class StudyInputs:
    """What a study gives a prediction.

    Attributes:
        workload, calibration, machine: the model's inputs (:mod:`cyclone_kit.analysis.predict`).
        run_dir: the calibration run; profile, partition: where it ran (from its spec).
        measured: world size -> (nodes, ranks per node, measured efficiency) of every complete point.
    """

    workload: Workload
    calibration: Calibration
    machine: Machine | None
    run_dir: str
    profile: str
    partition: str
    measured: Mapping[int, tuple[int, int, float]]


def workload_from_spec(spec: Mapping[str, Any], *, mode: str, global_batch: int, per_device_batch: int,
                       device: str) -> Workload:
    """The :class:`Workload` of a job spec's ``[train]`` table (``spec.json`` or a job TOML as a dict).

    Raises:
        ValidationError: a model whose gradient size is not known.
    """
    train = dict(spec.get("train") or {})
    if "model" not in train:
        raise ValidationError("the run's spec names no built-in model (a script job, or no spec.json): its gradient "
                              "size is not known", hint="predict from a study of the built-in engine, or from a job "
                              "spec whose [train] names the model")
    model = str(train["model"])
    channels = 1 if train.get("dataset") in ONE_CHANNEL else 3
    elements = parameter_count(model, int(train.get("num_classes", 10)), int(train.get("image_size", 32)), channels)
    dtype = "fp16" if train.get("fp16_allreduce") else "fp32"
    return Workload(model=model, grad_elements=elements, dtype=dtype, bucket_mb=float(train.get("bucket_cap_mb", 25)),
                    mode=mode, global_batch=global_batch, per_device_batch=per_device_batch, device=device)


def steady_steps(steps: pd.DataFrame) -> pd.DataFrame:
    """The step records after the first of each segment (warm-up), all of them when that leaves none."""
    if steps.empty or "segment" not in steps:
        return steps
    first = steps.groupby("segment")["step"].transform("min")
    rest = steps[steps["step"] != first]
    return rest if not rest.empty else steps


def calibration_from_steps(steps: pd.DataFrame, run: Mapping[str, Any], cores_per_rank: float, threads: int
                           ) -> Calibration:
    """The median phases of one run's steady-state step records.

    Raises:
        ValidationError: the records carry no phases (nothing to calibrate from).
    """
    steady = steady_steps(steps)
    if steady.empty:
        raise ValidationError(f"run {run['run_dir']} has no step records to calibrate from",
                              hint="calibrate from a run that logged steps (train.log_every)")
    med = {p: _median(steady, p) for p in PHASES}
    times = pd.to_numeric(steady["step_time_s"], errors="coerce").dropna()
    step = float(times.median())
    derived = ""
    if med["compute_time_s"] is None:
        # schema 1 records: only step and data time. A 1-rank run communicates no gradients, so compute
        # (with the rest of the step) is step - data; with more ranks that would hide the all-reduce.
        if int(run["world_size"]) != 1 or med["data_time_s"] is None:
            raise ValidationError(
                f"run {run['run_dir']}: its step records carry no measured compute/communication phases",
                hint="calibrate from a 1-rank run, or from a run of this version's built-in engine (or ck.instrument)")
        med.update(compute_time_s=max(0.0, step - med["data_time_s"]), other_time_s=0.0)
        derived = "; compute = step - data (phases not recorded; a 1-rank run communicates nothing)"
    med = {k: v or 0.0 for k, v in med.items()}
    rest = max(0.0, step - med["data_time_s"] - med["compute_time_s"] - med["comm_exposed_s"])
    return Calibration(
        world_size=int(run["world_size"]), ranks_per_node=int(run["local_world_size"] or 1),
        per_device_batch=int(run["per_device_batch_size"]), step_s=step, data_s=med["data_time_s"],
        compute_s=med["compute_time_s"], comm_s=med["comm_time_s"], exposed_s=med["comm_exposed_s"], rest_s=rest,
        spread=(float(times.quantile(0.1)), float(times.quantile(0.9))), cores_per_rank=cores_per_rank,
        threads=max(1, threads),
        source=f"run {run['run_dir']} ({len(steady)} steady-state step records, medians{derived})",
    )


def _median(steps: pd.DataFrame, column: str) -> float | None:
    """Median of a phase column, None when the records do not carry it."""
    if column not in steps:
        return None
    values = pd.to_numeric(steps[column], errors="coerce").dropna()
    return float(values.median()) if not values.empty else None


def machine_cores(ranks: pd.DataFrame, runs: pd.DataFrame) -> tuple[Machine | None, dict[str, float]]:
    """(the machine, run_dir -> cores per rank) from the rank summaries' affinity and machine ids.

    A machine's cores are the union of the CPU sets its ranks were allowed (a run's ranks on one
    machine id share them); ``nodes_per_machine`` is the most Slurm hosts seen with one machine id.
    """
    if ranks.empty or "machine_id" not in ranks or ranks["machine_id"].isna().all():
        return None, {}
    known = ranks.dropna(subset=["machine_id"])
    cores: dict[str, set[int]] = {}
    hosts: dict[str, set[str]] = {}
    for _, r in known.iterrows():
        cores.setdefault(r["machine_id"], set()).update(cpu_set_ids(str(r.get("cpu_set") or "")))
        hosts.setdefault(r["machine_id"], set()).add(str(r["host"]))
    per_run: dict[str, float] = {}
    for run_dir, group in known.groupby("run_dir"):
        share = [len(cores[m]) / n for m, n in group["machine_id"].value_counts().items() if cores[m]]
        if share:
            per_run[str(run_dir)] = min(share)
    widest = max(cores.values(), key=len)
    return Machine(cores=float(len(widest)), nodes_per_machine=max(len(h) for h in hosts.values())), per_run


def pick_calibration_run(runs: pd.DataFrame) -> Mapping[str, Any]:
    """The complete run to calibrate from: one node, the fewest ranks, then the newest.

    Raises:
        ValidationError: no complete run on one node.
    """
    complete = runs[runs["complete"].astype(bool) & (pd.to_numeric(runs["num_nodes"], errors="coerce") == 1)]
    if complete.empty:
        raise ValidationError("no complete 1-node run to calibrate from",
                              hint="run the study's 1-GPU (or 1-node) point first, or pass a job spec and --compute-s")
    smallest = complete[complete["world_size"] == complete["world_size"].min()]
    return smallest.sort_values("start_time").iloc[-1].to_dict()


def measured_efficiency(table: pd.DataFrame, runs: pd.DataFrame) -> dict[int, tuple[int, int, float]]:
    """World size -> (nodes, ranks per node, efficiency) of every point of the scaling table."""
    out = {}
    for _, row in table.iterrows():
        n = int(row["world_size"])
        same = runs[(runs["world_size"] == n) & runs["complete"].astype(bool)]
        per_node = int(same["local_world_size"].dropna().iloc[0]) if not same.empty else 1
        out[n] = (int(row["num_nodes"]), per_node, float(row["efficiency"]))
    return out


def study_inputs(data: Any, table: pd.DataFrame) -> StudyInputs:
    """Calibration, workload and cores from an ingested study (:class:`~cyclone_kit.analysis.ingest.Ingested`).

    Raises:
        ValidationError: no complete 1-node run, a run without phases, or an unknown model.
    """
    from cyclone_kit.analysis.scaling import infer_mode
    from cyclone_kit.rundir.layout import RunDir

    runs = data.runs
    run = pick_calibration_run(runs)
    spec = RunDir(run["run_dir"]).read_spec()
    machine, per_run = machine_cores(data.ranks, runs)
    ranks = data.ranks[data.ranks["run_dir"].astype(str) == str(run["run_dir"])] if not data.ranks.empty else data.ranks
    threads = int(pd.to_numeric(ranks.get("threads", pd.Series(dtype=float)), errors="coerce").dropna().max()) \
        if not ranks.empty and "threads" in ranks and ranks["threads"].notna().any() else 1
    steps = data.steps[data.steps["run_dir"].astype(str) == str(run["run_dir"])]
    calibration = calibration_from_steps(steps, run, per_run.get(str(run["run_dir"]), 0.0), threads)
    study = runs[runs["study"] == run["study"]]
    mode = infer_mode(study)
    mode = mode if mode in ("strong", "weak") else "strong"
    device = "cuda" if str(run["device"]).startswith("cuda") else "cpu"
    workload = workload_from_spec(spec, mode=mode, global_batch=int(run["global_batch_size"]),
                                  per_device_batch=int(run["per_device_batch_size"]), device=device)
    resources = dict(spec.get("resources") or {})
    return StudyInputs(workload=workload, calibration=calibration, machine=machine, run_dir=str(run["run_dir"]),
                       profile=str(resources.get("profile", "")), partition=str(resources.get("partition", "")),
                       measured=measured_efficiency(table[table["study"] == run["study"]], study))
