"""What a scaling report may state: the honesty rules, in one place.

The report, the plots and the notebook never decide on their own whether a number can be stood
behind: they call the pure functions here (most often :func:`review`) and show its findings.

Rules (each has a test that triggers it and asserts the bogus line is gone):

1. **Fitted law.** A fitted Amdahl/Gustafson law is "no meaningful fit" (its serial fraction is
   not printed as a result, its prediction is neither stated nor drawn) when the fitted serial
   fraction sits at a bound of [0, 1] because the data want a value outside the law (speed-up
   that does not grow or falls: s = 1; speed-ups above ideal: s < 0), or when it misses the
   measured speed-ups or efficiencies beyond N0 by more than :data:`MAX_RELATIVE_RMSE` (RMSE /
   mean; the efficiencies weigh the small N as much as the large ones). A law
   through a single point beyond N0 is exact by construction: it is kept, with that caveat.
2. **Extrapolation horizon.** A meaningful law is extrapolated beyond the largest measured N by
   at most as many doublings as were measured (N0 to N max), and never by more than
   :data:`MAX_EXTRAPOLATION_DOUBLINGS`: predictions at 2x and 4x N max are given only inside it.
3. **Karp-Flatt outside [0, 1].** e < 0 means a superlinear speed-up (S > p: the work fits in
   caches, or the baseline is slow); e > 1 means the point is slower than the baseline (S < 1:
   worse than serial). Neither is a serial fraction, and the value is flagged as such.
4. **Short measurements.** A point whose runs were timed over fewer than
   :data:`MIN_STEADY_WINDOWS` steady-state windows (step records after the first one of each
   completed segment, which is the warm-up) or less than :data:`MIN_MEASURED_S` seconds of
   steady state is marked: its throughput is too noisy to trust. A time-to-solution run (a
   script without ``ck.log_step``: no step records) is timed by the launch shim over the whole
   script, start-up included: it is marked when that wall time is under :data:`MIN_MEASURED_S`.
5. **Baselines.** A comparison with an external baseline states what differs (model, dataset,
   device, precision, per-device batch). A headline ratio is given only like for like: the same
   model and precision (both stated) and, when the baseline states it, the same per-device batch.
   A different device is stated but allowed (comparing platforms is the point). The baseline
   tables still show every ratio.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from cyclone_kit.analysis.scaling import ScalingFit

#: Largest RMSE of a fit (on speed-ups and on efficiencies beyond N0, relative to their mean) still called a fit.
MAX_RELATIVE_RMSE = 0.10
#: A serial fraction this close to a bound counts as at the bound.
BOUND_TOLERANCE = 1e-3
#: At most this many doublings of N beyond the largest measured N are predicted (2 = 4x).
MAX_EXTRAPOLATION_DOUBLINGS = 2
#: A point needs at least this many steady-state step windows per run ...
MIN_STEADY_WINDOWS = 5
#: ... and at least this many seconds of steady state per run.
MIN_MEASURED_S = 5.0

_KEY = tuple[str, str]


# ---------------------------------------------------------------- rule 1 and 2: fitted laws


@dataclass(frozen=True)
class FitVerdict:
    """Whether one fitted law may be shown, and how far it may be extrapolated.

    Attributes:
        study: the study name.
        strategy: the strategy.
        meaningful: False: show "no meaningful fit" (reason) instead of the law.
        reason: why it is not meaningful, or a caveat for a meaningful one (may be empty).
        largest: the largest measured world size.
        horizon: the largest world size the law may be extrapolated to (``largest`` when none).
    """

    study: str
    strategy: str
    meaningful: bool
    reason: str
    largest: int
    horizon: int

    def targets(self, factors: Sequence[int] = (2, 4)) -> tuple[int, ...]:
        """The world sizes ``factor x largest`` that lie inside the horizon (none when not meaningful)."""
        if not self.meaningful:
            return ()
        return tuple(f * self.largest for f in factors if f * self.largest <= self.horizon)


def _amdahl_sse(s: float, p: np.ndarray, measured: np.ndarray) -> float:
    """Sum of squared errors of Amdahl's law with serial fraction ``s`` (s may lie outside [0, 1])."""
    denominator = s + (1.0 - s) / p
    if np.any(denominator <= 0):
        return math.inf
    return float(((1.0 / denominator - measured) ** 2).sum())


def _wants_outside(fit: ScalingFit, p: np.ndarray, measured: np.ndarray) -> str:
    """'below'/'above' when the least-squares serial fraction lies outside [0, 1], else ''."""
    s = fit.serial_fraction
    if fit.law == "gustafson":
        x = p - 1.0
        raw = float(((p - measured) * x).sum() / (x * x).sum())
        return "below" if raw < -BOUND_TOLERANCE else "above" if raw > 1.0 + BOUND_TOLERANCE else ""
    step = 1e-3
    if s <= BOUND_TOLERANCE and _amdahl_sse(s - step, p, measured) < _amdahl_sse(s, p, measured):
        return "below"
    if s >= 1.0 - BOUND_TOLERANCE:
        return "above"  # s = 1: Amdahl predicts no speed-up at all, whatever the data
    return ""


def fit_verdict(fit: ScalingFit, group: pd.DataFrame) -> FitVerdict:
    """Apply rules 1 and 2 to one fit and the scaling-table rows it was fitted to.

    Args:
        fit: the fitted law.
        group: that study/strategy's rows of the scaling table (``world_size``, ``speedup``).
    """
    group = group.dropna(subset=["speedup"])
    largest = int(group["world_size"].max())
    p = group["world_size"].to_numpy(dtype=float) / fit.base_world_size
    measured = group["speedup"].to_numpy(dtype=float)
    beyond = p > 1
    p, measured = p[beyond], measured[beyond]
    doublings = math.floor(math.log2(largest / fit.base_world_size) + 1e-9)
    horizon = largest * 2 ** min(doublings, MAX_EXTRAPOLATION_DOUBLINGS)
    outside = _wants_outside(fit, p, measured)
    reason = ""
    if outside == "above":
        reason = (f"the speed-up does not grow with N (best {measured.max():.2f} at p up to {p.max():g}): "
                  f"the fitted serial fraction hits its upper bound 1")
    elif outside == "below":
        reason = ("the speed-ups are above ideal (superlinear): the fitted serial fraction hits its lower "
                  "bound 0, so the law cannot describe them")
    else:
        predicted = fit.predict(p * fit.base_world_size)
        on_speedup = float(np.sqrt(np.mean((predicted - measured) ** 2)) / np.mean(measured))
        on_efficiency = float(np.sqrt(np.mean(((predicted - measured) / p) ** 2)) / np.mean(measured / p))
        relative = max(on_speedup, on_efficiency)
        if relative > MAX_RELATIVE_RMSE:
            reason = (f"the law misses the measured speed-ups by {100 * on_speedup:.0f} % RMSE and the "
                      f"efficiencies by {100 * on_efficiency:.0f} % (limit {100 * MAX_RELATIVE_RMSE:.0f} %)")
    if reason:
        return FitVerdict(fit.study, fit.strategy, False, reason, largest, largest)
    caveat = ""
    if measured.size == 1:
        caveat = "one point beyond N0: the law passes through it exactly, so the data do not test it"
    return FitVerdict(fit.study, fit.strategy, True, caveat, largest, horizon)


def fit_verdicts(table: pd.DataFrame, fits: Sequence[ScalingFit]) -> dict[_KEY, FitVerdict]:
    """:func:`fit_verdict` for every fit, keyed by (study, strategy)."""
    out = {}
    for fit in fits:
        group = table[(table["study"] == fit.study) & (table["strategy"] == fit.strategy)]
        if not group.empty:
            out[(fit.study, fit.strategy)] = fit_verdict(fit, group)
    return out


def meaningful_fits(table: pd.DataFrame, fits: Sequence[ScalingFit]) -> list[ScalingFit]:
    """The fits that rule 1 lets the report show."""
    verdicts = fit_verdicts(table, fits)
    return [f for f in fits if (v := verdicts.get((f.study, f.strategy))) is not None and v.meaningful]


# ---------------------------------------------------------------- rule 3: Karp-Flatt


def karp_flatt_flag(e: float) -> str:
    """What a Karp-Flatt value outside [0, 1] means ('' inside it, or for nan)."""
    if e is None or pd.isna(e):
        return ""
    if e < -BOUND_TOLERANCE:
        return "superlinear (S > p): e < 0 is not a serial fraction"
    if e > 1.0 + BOUND_TOLERANCE:
        return "worse than serial (S < 1): slower than the baseline, e > 1 is not a serial fraction"
    return ""


# ---------------------------------------------------------------- rule 4: measurement length


def measurement_spans(steps: pd.DataFrame, runs: pd.DataFrame) -> pd.DataFrame:
    """Steady-state windows and seconds each complete run was timed over.

    A window is one step record; it covers ``step - previous step`` steps at ``step_time_s``
    each. The first record of each segment is the warm-up and is not counted.

    Returns:
        Columns ``run_dir``, ``steady_windows``, ``measured_s`` (one row per complete run).
    """
    columns = ["run_dir", "steady_windows", "measured_s"]
    complete = runs[runs["complete"].astype(bool)]
    if complete.empty:
        return pd.DataFrame(columns=columns)
    keys = complete["run_dir"].astype(str).tolist()
    windows = dict.fromkeys(keys, 0)
    seconds = dict.fromkeys(keys, 0.0)
    if not steps.empty:
        frame = steps[["run_dir", "segment", "step", "step_time_s"]].copy()
        frame["run_dir"] = frame["run_dir"].astype(str)
        frame = frame[frame["run_dir"].isin(windows)]
        frame["covered"] = frame.groupby(["run_dir", "segment"], sort=False)["step"].diff()
        ok = (frame["covered"] > 0) & np.isfinite(frame["step_time_s"])
        frame = frame[ok]
        frame["seconds"] = frame["covered"] * frame["step_time_s"]
        for run_dir, group in frame.groupby("run_dir", sort=False):
            windows[str(run_dir)] = len(group)
            seconds[str(run_dir)] = float(group["seconds"].sum())
    return pd.DataFrame([(k, windows[k], seconds[k]) for k in keys], columns=columns)


#: The strategy label of a script timed as a whole by the launch shim (cyclone_kit/runtime/launch.py).
TIME_TO_SOLUTION = "time-to-solution"


def short_solution(wall_time_s: float) -> str:
    """Why a time-to-solution run is too short to trust ('' when long enough; pure)."""
    if math.isnan(wall_time_s) or wall_time_s < MIN_MEASURED_S:
        return f"{wall_time_s:.1f} s of wall time for the whole script (need {MIN_MEASURED_S:g} s)"
    return ""


def short_measurement(windows: int, seconds: float) -> str:
    """Why a run's measurement is too short to trust ('' when long enough)."""
    problems = []
    if windows < MIN_STEADY_WINDOWS:
        problems.append(f"{windows} steady-state step record(s) (need {MIN_STEADY_WINDOWS})")
    if seconds < MIN_MEASURED_S:
        problems.append(f"{seconds:.1f} s of steady state (need {MIN_MEASURED_S:g} s)")
    return "; ".join(problems)


# ---------------------------------------------------------------- rule 5: baselines


@dataclass(frozen=True)
class BaselineVerdict:
    """How one external baseline compares with one study at its largest N.

    Attributes:
        baseline: the baseline name.
        study: the study name.
        strategy: the strategy.
        world_size: the N compared (the study's largest).
        differences: what differs, e.g. ``model resnet50 vs resnet18`` (empty: nothing known differs).
        like_for_like: whether a headline ratio may be given.
        why_not: why not (empty when like for like).
        label: the baseline as the report names it, e.g. ``ref (V100, 1 device(s))``.
    """

    baseline: str
    study: str
    strategy: str
    world_size: int
    differences: tuple[str, ...]
    like_for_like: bool
    why_not: str
    label: str = ""

    @property
    def refusal(self) -> str:
        """The one-line refusal of a headline ratio ('' when like for like)."""
        if self.like_for_like:
            return ""
        differs = f"; differs: {'; '.join(self.differences)}" if self.differences else ""
        return (f"{self.study} ({self.strategy}) vs {self.label or self.baseline}: no headline ratio, "
                f"not like for like ({self.why_not}{differs}).")


def _known(value: object) -> str:
    """A stripped string, or '' for missing values."""
    if value is None or (not isinstance(value, str) and pd.isna(value)):
        return ""
    text = str(value).strip()
    return "" if text.lower() in ("", "nan", "none", "<na>") else text


def _ours(runs: pd.DataFrame, column: str) -> list[str]:
    """The study's distinct known values of a column, in order."""
    if column not in runs:
        return []
    return list(dict.fromkeys(v for v in (_known(x) for x in runs[column]) if v))


def _same_device(a: str, b: str) -> bool:
    """Device names that name the same part (``V100`` and ``Tesla V100-SXM2-32GB``)."""
    a, b = a.lower(), b.lower()
    return a in b or b in a


def _batch_text(value: object) -> str:
    """An integral batch size as text ('' when unknown)."""
    text = _known(value)
    try:
        return str(int(float(text))) if text else ""
    except ValueError:
        return text


def baseline_verdict(base: Mapping[str, object], study_runs: pd.DataFrame, row: Mapping[str, object]) -> BaselineVerdict:
    """Apply rule 5 to one baseline row against one study's point (usually its largest N).

    Args:
        base: a baseline row (``name``, ``device``, ``model``, ``dataset``, ``precision``,
            optionally ``batch_per_device``).
        study_runs: the study's complete runs (``model``, ``dataset``, ``device``, ``device_name``,
            ``precision``).
        row: the scaling-table row compared (``study``, ``strategy``, ``world_size``,
            ``per_device_batch_size``).
    """
    differences: list[str] = []
    refuse: list[str] = []
    for column in ("model", "precision", "dataset"):
        theirs = _known(base.get(column))
        ours = _ours(study_runs, column)
        if theirs and ours and theirs.lower() not in {o.lower() for o in ours}:
            differences.append(f"{column} {theirs} vs {', '.join(ours)}")
            if column != "dataset":
                refuse.append(f"{column} differs")
        elif not theirs and column != "dataset":
            refuse.append(f"the baseline does not state its {column}")
    kinds = {"cpu": "CPU", "cuda": "GPU"}
    devices = _ours(study_runs, "device_name") or [kinds.get(d.split(":")[0], d) for d in _ours(study_runs, "device")]
    theirs_device = _known(base.get("device"))
    if theirs_device and devices and not any(_same_device(theirs_device, d) for d in devices):
        differences.append(f"device {theirs_device} vs {', '.join(devices)}")
    theirs_batch = _batch_text(base.get("batch_per_device"))
    ours_batch = _batch_text(row.get("per_device_batch_size"))
    if theirs_batch and ours_batch and theirs_batch != ours_batch:
        differences.append(f"per-device batch {theirs_batch} vs {ours_batch}")
        refuse.append("per-device batch differs")
    devices = _known(base.get("devices")) or "1"
    return BaselineVerdict(
        label=f"{base.get('name')} ({theirs_device or 'device unknown'}, {devices} device(s))",
        baseline=str(base.get("name")),
        study=str(row.get("study")),
        strategy=str(row.get("strategy")),
        world_size=int(row.get("world_size")),  # type: ignore[arg-type]
        differences=tuple(differences),
        like_for_like=not refuse,
        why_not="; ".join(refuse),
    )


# ---------------------------------------------------------------- all rules together


@dataclass(frozen=True)
class PointFlag:
    """A flag on one point of the scaling table.

    Attributes:
        study: the study.
        strategy: the strategy.
        world_size: the point's N.
        rule: ``"karp_flatt"`` or ``"short"``.
        text: what it means, one line.
    """

    study: str
    strategy: str
    world_size: int
    rule: str
    text: str


@dataclass(frozen=True)
class Review:
    """Every finding of the rules for one report.

    Attributes:
        fits: rule 1/2 verdicts keyed by (study, strategy).
        points: rule 3/4 flags, in table order.
        baselines: rule 5 verdicts.
        spans: per complete run, the steady-state windows and seconds (rule 4's input).
    """

    fits: Mapping[_KEY, FitVerdict] = field(default_factory=dict)
    points: tuple[PointFlag, ...] = ()
    baselines: tuple[BaselineVerdict, ...] = ()
    spans: pd.DataFrame = field(default_factory=pd.DataFrame)

    def fit(self, study: str, strategy: str) -> FitVerdict | None:
        """The verdict on one study/strategy's fit, if it has one."""
        return self.fits.get((study, strategy))

    def notes(self, study: str, strategy: str, world_size: int) -> tuple[str, ...]:
        """Short notes on one point (for a table cell)."""
        out = []
        for flag in self.points:
            if (flag.study, flag.strategy, flag.world_size) == (study, strategy, world_size):
                out.append(flag.text.split(":")[0] if flag.rule == "karp_flatt" else "measured too briefly")
        return tuple(out)

    def baseline(self, name: str, study: str, strategy: str) -> BaselineVerdict | None:
        """The verdict on one baseline against one study/strategy."""
        for verdict in self.baselines:
            if (verdict.baseline, verdict.study, verdict.strategy) == (name, study, strategy):
                return verdict
        return None

    @property
    def warnings(self) -> tuple[str, ...]:
        """Every finding as one line, for the report's Warnings section and the notebook."""
        lines = []
        for verdict in self.fits.values():
            if not verdict.meaningful:
                lines.append(f"{verdict.study} ({verdict.strategy}): no meaningful fit: {verdict.reason}.")
        for flag in self.points:
            lines.append(f"{flag.study} ({flag.strategy}) N={flag.world_size}: {flag.text}.")
        lines += [verdict.refusal for verdict in self.baselines if not verdict.like_for_like]
        return tuple(lines)


def review(
    runs: pd.DataFrame,
    steps: pd.DataFrame,
    table: pd.DataFrame,
    fits: Sequence[ScalingFit],
    baselines: pd.DataFrame | None = None,
) -> Review:
    """Apply every rule to one report's data (pure).

    Args:
        runs: the runs table.
        steps: the steps table.
        table: the scaling table.
        fits: the fitted laws.
        baselines: external baseline rows, or None.
    """
    verdicts = fit_verdicts(table, fits)
    spans = measurement_spans(steps, runs)
    by_run = spans.set_index("run_dir") if not spans.empty else spans
    complete = runs[runs["complete"].astype(bool)]
    flags: list[PointFlag] = []
    for _, row in table.iterrows():
        study, strategy, n = str(row["study"]), str(row["strategy"]), int(row["world_size"])
        meaning = karp_flatt_flag(row["karp_flatt"])
        if meaning:
            flags.append(PointFlag(study, strategy, n, "karp_flatt",
                                   f"{meaning} (Karp-Flatt e = {float(row['karp_flatt']):.4f})"))
        mine = complete[(complete["study"] == study) & (complete["strategy"] == strategy)
                        & (complete["world_size"] == n)]
        problems = []
        for run_dir, wall in zip(mine["run_dir"].astype(str), mine["wall_time_s"], strict=True):
            if strategy == TIME_TO_SOLUTION:  # no step records: the shim's wall time of the whole script
                problem = short_solution(float(wall))
                if problem:
                    problems.append(problem)
            elif run_dir in by_run.index:
                span = by_run.loc[run_dir]
                problem = short_measurement(int(span["steady_windows"]), float(span["measured_s"]))
                if problem:
                    problems.append(problem)
        if problems:
            flags.append(PointFlag(study, strategy, n, "short",
                                   f"measured over too little to trust: {problems[0]}"
                                   + (f" ({len(problems)} of {len(mine)} runs)" if len(mine) > 1 else "")))
    base_verdicts: list[BaselineVerdict] = []
    if baselines is not None and not baselines.empty:
        for (study, _strategy), group in table.groupby(["study", "strategy"], sort=False):
            top = group.loc[group["world_size"].idxmax()]
            study_runs = complete[complete["study"] == study]
            for _, base in baselines.iterrows():
                base_verdicts.append(baseline_verdict(base.to_dict(), study_runs, top.to_dict()))
    return Review(fits=verdicts, points=tuple(flags), baselines=tuple(base_verdicts), spans=spans)

