"""Why a study scaled as it did: where each step's time goes at every N, what ate the efficiency, what to change.

Pure functions over the steps, runs and ranks tables (:mod:`cyclone_kit.analysis.ingest`):

* :func:`phase_table`: per (study, strategy, N) the median of each phase of the steady-state step
  records (data wait, compute, exposed gradient communication, its total, the rest), and the
  cores per rank the ranks' affinity gave them;
* :func:`diagnose`: the phase that grew. Against the ideal step at N (strong: the N0 step x N0 / N,
  weak: the N0 step), each phase's excess is what it takes beyond its own ideal (data and compute
  shrink with the per-device batch in a strong study; communication's ideal is what N0 spent). On
  CPU, gloo reduces on the ranks' own cores, so the all-reduce time "hidden" behind backward
  stretches compute: up to that much of compute's excess is counted as communication;
  the largest share of the lost time is the cause. Compute that grew where the ranks had fewer
  cores than threads, or fewer cores than each rank had at N0, is the machine (shared cores), not the
  network, and then none of compute's excess is moved to communication. Measured (issue 27, 2 cores,
  ResNet-18 at 8 px): one thread instead of two costs a step 33-46 %, halving the batch from 4 to 2
  saves only 5-14 %, while backward with its 45 MB gloo all-reduce on took as long as under
  ``no_sync()`` (90.3 against 90.2 ms; the all-reduce alone takes 50 ms): a 1-rank point with 2 cores
  against 2 ranks of 1 core grows compute by itself, and moving that to the all-reduce would name a
  confident wrong cause;
  A step that waits for data 40 % of its time or more is input-bound, whether that wait grew or not;
* :func:`recommendations`: the changes that act on that cause (and on an input-bound step), and only on them.

Honesty: a point whose step records carry no phases is not broken down (the report says so); the
prediction (:mod:`cyclone_kit.analysis.forecast`) is shown only when calibrated from measured phases.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pandas as pd

from cyclone_kit.analysis.calibrate import steady_steps

#: The parts a step is split into, in stacking order, with their labels.
PARTS = (("data_time_s", "data wait"), ("compute_time_s", "compute"), ("comm_exposed_s", "exposed gradient all-reduce"),
         ("other_time_s", "rest of the step"))
#: How the diagnosis names each cause (on CPU the all-reduce also costs the cores backward runs on).
CAUSE_NAMES = {"data_time_s": "data wait", "compute_time_s": "compute", "other_time_s": "the rest of the step",
               "comm_exposed_s": "gradient all-reduce (exposed, or on CPU stretching backward on the ranks' own cores)"}
#: A phase must hold at least this share of the lost time for its recommendations to show.
CAUSE_SHARE = 1 / 3
#: A phase's growth counts (as a cause) only from this share of the step at N: below it is noise.
MATERIAL_SHARE = 0.05
#: A step that waits for data this share of its time (or more) is input-bound, grown or not.
INPUT_BOUND_SHARE = 0.4
#: Causes -> the changes that act on them.
RECOMMENDATIONS: Mapping[str, tuple[str, ...]] = {
    "comm_exposed_s": (
        "gradient compression: --set train.fp16_allreduce=true halves the bytes every step all-reduces "
        "(DDP's fp16/bf16 compression hook)",
        "bucket size: a larger train.bucket_cap_mb makes fewer, larger all-reduces where latency dominates; a "
        "smaller one starts them earlier in backward where bandwidth does",
        "more work per all-reduce: a larger per-device batch, or weak scaling (keep the per-device batch as N grows)",
    ),
    "data_time_s": (
        "more loader workers: --set train.num_workers=N (the default -1 picks from the cores per rank)",
        "node-local data: stage the dataset to the node's local disk ($TMPDIR) before training instead of "
        "reading it from the shared file system",
    ),
    "shared_cores": (
        "fewer ranks per node (or more cores per rank, --cpus-per-task): the ranks share cores, so compute slows "
        "as ranks are added; this is the machine, not the network",
    ),
    "compute_time_s": (
        "a larger per-device batch, or weak scaling: the per-device batch became too small to keep a device busy",
    ),
    "other_time_s": (
        "fixed per-step costs (optimizer bookkeeping, logging, Python) do not shrink with N: log less often "
        "(train.log_every) and check the rest of the step for host-side work",
    ),
}


@dataclass(frozen=True)
class Explanation:
    """What the report says about one study's time: its phases, the diagnosis, the prediction (or why none).

    Attributes:
        study: the study; points: its :func:`phase_table` rows.
        diagnosis: the cause of the lost efficiency (None: fewer than two points, or no phases).
        forecast: the model calibrated on the study's 1-node run (a
            :class:`~cyclone_kit.analysis.forecast.Forecast`), or None.
        no_forecast: why there is no prediction (empty when there is one).
    """

    study: str
    points: pd.DataFrame
    diagnosis: Diagnosis | None
    forecast: object | None = None
    no_forecast: str = ""


@dataclass(frozen=True)
class Diagnosis:
    """What ate the efficiency of one study between N0 and N.

    Attributes:
        world_size: the N diagnosed (the largest measured); base: N0.
        cause: the phase with the largest share of the lost time (a :data:`PARTS` column, or ``shared_cores``).
        shares: phase -> its share of the lost time (0..1; only phases that grew).
        sentence: the plain sentence for the report.
        lost_s: seconds per step lost against the ideal.
        input_bound: the largest N's step waits for data :data:`INPUT_BOUND_SHARE` of its time or more.
    """

    world_size: int
    base: int
    cause: str
    shares: Mapping[str, float]
    sentence: str
    lost_s: float
    input_bound: bool = False


def _median(frame: pd.DataFrame, column: str) -> float:
    values = pd.to_numeric(frame[column], errors="coerce").dropna() if column in frame else pd.Series(dtype=float)
    return float(values.median()) if not values.empty else math.nan


def phase_table(steps: pd.DataFrame, runs: pd.DataFrame, ranks: pd.DataFrame) -> pd.DataFrame:
    """Median phases per (study, strategy, world_size) of complete runs' steady-state step records.

    Columns: study, strategy, world_size, per_device_batch_size, records, step_time_s, the
    :data:`PARTS` columns, comm_time_s, phases (True when compute was measured), cores_per_rank,
    threads. A point without measured phases has ``phases`` False and NaN phases but its data wait.
    """
    rows = []
    complete = runs[runs["complete"].astype(bool)]
    for (study, strategy, n), group in complete.groupby(["study", "strategy", "world_size"], sort=True):
        dirs = set(group["run_dir"].astype(str))
        mine = steady_steps(steps[steps["run_dir"].astype(str).isin(dirs)]) if not steps.empty else steps
        row = {"study": study, "strategy": strategy, "world_size": int(n),
               "per_device_batch_size": _median(group, "per_device_batch_size"), "records": len(mine),
               "step_time_s": _median(mine, "step_time_s")}
        for column in (*[c for c, _ in PARTS], "comm_time_s"):
            row[column] = _median(mine, column)
        row["phases"] = not math.isnan(row["compute_time_s"])
        row["device"] = "cuda" if "device" in group and str(group["device"].iloc[0]).startswith("cuda") else "cpu"
        row["cores_per_rank"], row["threads"] = _cores(ranks, dirs)
        rows.append(row)
    return pd.DataFrame(rows)


def _cores(ranks: pd.DataFrame, dirs: set[str]) -> tuple[float, float]:
    """(cores per rank, threads per rank) of the runs ``dirs``: a machine's CPU-set union over its ranks."""
    from cyclone_kit.rundir.contract import cpu_set_ids

    if ranks.empty or "machine_id" not in ranks:
        return math.nan, math.nan
    mine = ranks[ranks["run_dir"].astype(str).isin(dirs)].dropna(subset=["machine_id"])
    if mine.empty:
        return math.nan, math.nan
    shares = []
    for (_, _), group in mine.groupby(["run_dir", "machine_id"]):
        cpus: set[int] = set()
        for text in group["cpu_set"].dropna():
            cpus |= cpu_set_ids(str(text))
        if cpus:
            shares.append(len(cpus) / len(group))
    threads = pd.to_numeric(mine.get("threads", pd.Series(dtype=float)), errors="coerce").dropna()
    return (min(shares) if shares else math.nan), (float(threads.max()) if not threads.empty else math.nan)


def _fewer_cores(base: Mapping[str, float], top: Mapping[str, float]) -> bool:
    """Each rank at N had fewer cores than each rank at N0 (the ranks split a machine's cores; NaN: unknown)."""
    low, high = top.get("cores_per_rank", math.nan), base.get("cores_per_rank", math.nan)
    return not (math.isnan(low) or math.isnan(high)) and low < high


def _ideal(base: Mapping[str, float], column: str, scale: float) -> float:
    """A phase's ideal at N: data and compute shrink with the per-device batch; the others stay as at N0."""
    value = base.get(column, 0.0)
    value = 0.0 if value is None or math.isnan(value) else value
    return value * scale if column in ("data_time_s", "compute_time_s") else value


def diagnose(points: pd.DataFrame) -> Diagnosis | None:
    """The cause of the lost efficiency at the largest N of one study's :func:`phase_table` rows.

    None when fewer than two points, or the compared points lack phases.
    """
    points = points.sort_values("world_size")
    if len(points) < 2:
        return None
    base, top = points.iloc[0].to_dict(), points.iloc[-1].to_dict()
    if not top["phases"]:
        return None
    n0, n = int(base["world_size"]), int(top["world_size"])
    scale = top["per_device_batch_size"] / base["per_device_batch_size"] if base["per_device_batch_size"] else 1.0
    ideal = base["step_time_s"] * scale
    if not base["phases"]:  # a 1-rank calibration without phases: all but data is compute there
        base = {**base, "compute_time_s": base["step_time_s"] - (base["data_time_s"] or 0.0), "comm_exposed_s": 0.0,
                "other_time_s": 0.0}
    excess = {c: (top[c] if not math.isnan(top[c]) else 0.0) - _ideal(base, c, scale) for c, _ in PARTS}
    fewer = _fewer_cores(base, top)
    if top.get("device") == "cpu" and not math.isnan(top["comm_time_s"]) and excess["compute_time_s"] > 0 and not fewer:
        # gloo reduces on the ranks' own cores: the part "hidden" behind backward stretches compute instead
        hidden = max(0.0, top["comm_time_s"] - (top["comm_exposed_s"] or 0.0))
        moved = min(hidden, excess["compute_time_s"])
        excess["compute_time_s"] -= moved
        excess["comm_exposed_s"] += moved
    grew = {c: v for c, v in excess.items() if v > MATERIAL_SHARE * top["step_time_s"]}
    lost = top["step_time_s"] - ideal
    data_share = (top["data_time_s"] or 0.0) / top["step_time_s"] if top["step_time_s"] else 0.0
    bound = data_share >= INPUT_BOUND_SHARE
    input_note = (f" The step waits for data {100 * data_share:.0f} % of its time at N = {n}: the run is input-bound, "
                  "so more devices wait faster, they do not train faster.") if bound else ""
    if lost <= MATERIAL_SHARE * top["step_time_s"] or not grew:
        what = "no longer than the ideal" if lost <= 0 else f"{100 * lost / top['step_time_s']:.0f} % longer than the ideal"
        return Diagnosis(n, n0, "", {}, f"At N = {n} the step took {what}: no phase grew materially."
                         + input_note, max(0.0, lost), bound)
    total = sum(grew.values())
    shares = {c: v / total for c, v in sorted(grew.items(), key=lambda kv: -kv[1])}
    cause = next(iter(shares))
    shared = not math.isnan(top["cores_per_rank"]) and not math.isnan(top["threads"]) and \
        top["cores_per_rank"] < top["threads"]
    labels = dict(PARTS)
    if cause == "compute_time_s" and shared:
        cause = "shared_cores"
        what = (f"compute that slowed because the ranks share cores ({top['cores_per_rank']:.2g} core(s) per rank for "
                f"{top['threads']:.0f} thread(s)), not the network")
    elif cause == "compute_time_s" and fewer:
        cause = "shared_cores"
        what = (f"compute that slowed because each rank had fewer cores at N = {n} ({top['cores_per_rank']:.2g}) than "
                f"at N = {n0} ({base['cores_per_rank']:.2g}): the ranks split the machine's cores, not the network")
    else:
        what = CAUSE_NAMES[cause]
    flat = [labels[c] for c, _ in PARTS if c not in grew or shares.get(c, 0) < 0.05]
    sentence = (f"At N = {n}, {100 * next(iter(shares.values())):.0f} % of the lost efficiency is {what}"
                + (f"; {' and '.join(flat)} {'is' if len(flat) == 1 else 'are'} flat" if flat else "") + ".")
    return Diagnosis(n, n0, cause, shares, sentence + input_note, lost, bound)


def recommendations(diagnosis: Diagnosis | None) -> tuple[str, ...]:
    """The changes that act on the diagnosed cause (and on any other phase with a third of the loss).

    An input-bound step gets the loader's changes too, first: it waits for data most of its time,
    so they act on more of it than any change to what grew.
    """
    if diagnosis is None:
        return ()
    causes = ([diagnosis.cause] if diagnosis.cause else []) + [
        c for c, s in diagnosis.shares.items()
        if s >= CAUSE_SHARE and c != diagnosis.cause and not (diagnosis.cause == "shared_cores" and c == "compute_time_s")]
    if diagnosis.input_bound:
        causes = ["data_time_s", *[c for c in causes if c != "data_time_s"]]
    return tuple(r for c in causes for r in RECOMMENDATIONS.get(c, ()))


def breakdown_rows(points: pd.DataFrame) -> list[tuple[str, ...]]:
    """The "where the time goes" table rows: N, step ms, then each part in ms and share of the step."""
    rows = []
    for _, p in points.sort_values("world_size").iterrows():
        cells = [str(int(p["world_size"])), f"{1e3 * p['step_time_s']:.1f}"]
        for column, _ in PARTS:
            value = p[column]
            if column == "data_time_s" or p["phases"]:
                cells.append("" if math.isnan(value) else f"{1e3 * value:.1f} ({100 * value / p['step_time_s']:.0f} %)")
            else:
                cells.append("not measured")
        comm = p["comm_time_s"]
        cells.append("" if math.isnan(comm) else f"{1e3 * comm:.1f}")
        cells.append("" if math.isnan(p["cores_per_rank"]) else f"{p['cores_per_rank']:.2g}")
        rows.append(tuple(cells))
    return rows


def breakdown_header() -> tuple[str, ...]:
    """The header of :func:`breakdown_rows`."""
    return ("N", "step (ms)", *[f"{label} (ms)" for _, label in PARTS], "all-reduce total (ms)", "cores per rank")


def error_rows(measured: Mapping[int, float], predicted: Mapping[int, tuple[float, float, float]],
               nodes: Mapping[int, int]) -> list[tuple[str, ...]]:
    """N, nodes, measured efficiency, predicted efficiency (band), error in points: measured N first, then the rest."""
    rows = []
    for n in sorted(predicted):
        eff, low, high = predicted[n]
        meas = measured.get(n)
        rows.append((str(n), str(nodes.get(n, "")), "" if meas is None else f"{100 * meas:.1f} %",
                     f"{100 * eff:.1f} % ({100 * low:.1f} - {100 * high:.1f})",
                     "" if meas is None else f"{100 * (eff - meas):+.1f}"))
    return rows


def studies_with_phases(points: pd.DataFrame) -> Sequence[str]:
    """Studies with at least one point whose step records carry measured phases."""
    return sorted(set(points[points["phases"]]["study"])) if not points.empty else []
