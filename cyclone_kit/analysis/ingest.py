"""Find ``metrics.jsonl`` files and read them into pandas tables.

The training runtime writes one JSON object a line (``kind`` + ``schema``: 2, and 1 before the step
phases were added; both are read, a schema 1 record with the phase columns null): ``start``,
``step``, ``epoch`` and ``end`` records, as :mod:`cyclone_kit.rundir.contract` defines them (file
names, field names and schema version come from there). A requeued run appends another ``start ... end``
segment to the same file. This module turns those files into:

* a **runs** table: one row per run (per ``metrics.jsonl``), with the setup from its ``start``
  records, its final status, and its throughput (see :func:`summarize_run`);
* a **steps** table: every ``step`` record, tagged with its run and segment;
* an **epochs** table and a **ranks** table (per-rank summaries in ``<run>/ranks/*.json``).

Reading never crashes on bad data: a line that is not a JSON object with a ``kind`` is
skipped and counted as corrupt (a truncated last line, written by a crash, is the common
case); a record with a schema version not in :data:`READ_SCHEMAS` is skipped and counted as unsupported. Each
file with skipped lines produces one :class:`MetricsWarning`.

Study names: a run belongs to the study named by the nearest ``sweep.json`` in its directory
or any ancestor. Without one, the study is the name of the directory given by the user
when that directory holds runs below it; a run directory or a ``metrics.jsonl`` given
directly is labelled ``<model>-<dataset>`` from its ``start`` record.

The parsing core (:func:`parse_metrics_text`, :func:`summarize_run`) is pure; only
:func:`find_metrics_files` and :func:`load_runs` touch the file system.
"""

from __future__ import annotations

import json
import math
import warnings
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from cyclone_kit.core.errors import ValidationError
from cyclone_kit.rundir import contract
from cyclone_kit.rundir.layout import SWEEP_FILE, RunDir
from cyclone_kit.rundir.restarts import read_restarts

#: The contract's names (:mod:`cyclone_kit.rundir.contract`), under the names this module always used.
METRICS_FILENAME = contract.METRICS_FILE
SWEEP_FILENAME = SWEEP_FILE
SCHEMA_VERSION = contract.SCHEMA
#: The schema versions read (schema 2 only added the step phases and the start record's timing fields).
READ_SCHEMAS = frozenset(contract.READ_SCHEMAS)

#: Fields copied from each ``step`` record into the steps table (the phases null for schema 1 records).
STEP_FIELDS = contract.STEP_FIELDS
#: Numeric columns of the steps table.
STEP_NUMERIC = ("step", "epoch", "loss", "step_time_s", "data_time_s", "samples_per_s", *contract.PHASE_FIELDS)

#: Columns of the runs table, in order.
RUN_COLUMNS = (
    "study",
    "run_dir",
    "run_id",
    "point",
    "repeat",
    "declared_mode",
    "strategy",
    "world_size",
    "num_nodes",
    "local_world_size",
    "per_device_batch_size",
    "global_batch_size",
    "model",
    "dataset",
    "precision",
    "launcher",
    "device",
    "device_name",
    "hostnames",
    "slurm_job_id",
    "start_time",
    "end_time",
    "torch_version",
    "torchvision_version",
    "cyclone_kit_version",
    "git_commit",
    "restart_count",
    "phase_timing",
    "comm_timing",
    "segments",
    "status",
    "complete",
    "incomplete_reason",
    "samples_per_s",
    "steps",
    "wall_time_s",
    "val_accuracy",
    "step_records",
    "corrupt_lines",
    "unsupported_lines",
    "truncated",
    "samples_per_run",
    "warning",
    "metrics_path",
)


class MetricsWarning(UserWarning):
    """A metrics file had lines that were skipped (corrupt, truncated or another schema)."""


@dataclass
class _Segment:
    """One ``start ... end`` segment of a run while parsing (private, mutable)."""

    start: dict[str, Any] | None = None
    end: dict[str, Any] | None = None
    step_records: int = 0
    last_step: Any = None
    last_val_accuracy: Any = None


@dataclass(frozen=True)
class ParsedMetrics:
    """The content of one metrics file.

    Attributes:
        segments: per segment, a mapping with ``start`` and ``end`` records (or None),
            ``step_records`` (count), ``last_step`` and ``last_val_accuracy``.
        steps: every ``step`` record, in file order.
        step_segments: the segment index of each ``step`` record.
        epochs: every ``epoch`` record (with a ``segment`` key added).
        corrupt_lines: lines that were not a JSON object with a string ``kind``.
        unsupported_lines: records whose ``schema`` is not in :data:`READ_SCHEMAS`.
        truncated: True when the last line is cut off (corrupt and no final newline).
        corrupt_line_numbers: the (1-based) line numbers of the corrupt lines.
        refused: (line number, why) of each record refused for a field of the wrong type
            (``"step": "abc"``); the other records of the file are kept.
    """

    segments: tuple[Mapping[str, Any], ...]
    steps: Sequence[Mapping[str, Any]]
    step_segments: Sequence[int]
    epochs: tuple[Mapping[str, Any], ...]
    corrupt_lines: int
    unsupported_lines: int
    truncated: bool
    corrupt_line_numbers: tuple[int, ...] = ()
    refused: tuple[tuple[int, str], ...] = ()

    def steps_frame(self) -> pd.DataFrame:
        """The step records as a DataFrame: :data:`STEP_FIELDS` plus ``segment``."""
        frame = pd.DataFrame(list(self.steps), columns=list(STEP_FIELDS))
        frame["segment"] = list(self.step_segments)
        return frame


try:  # pandas' C JSON parser: ~1.5x faster than json.loads on large files; exact with precise_float.
    from pandas.io.json import ujson_loads as _ujson_loads

    def _fast_loads(text: str) -> Any:
        """Decode with pandas' ujson (precise floats)."""
        return _ujson_loads(text, precise_float=True)

except ImportError:  # pragma: no cover - depends on the pandas version
    _fast_loads = json.loads


def _decode(text: str) -> tuple[list[Any], Sequence[int], list[int], bool]:
    """Decode every non-blank line: (values, their line numbers, corrupt line numbers, last line truncated).

    Fast path: the whole file as one JSON array, accepted only when it decodes to exactly one
    value per line. Anything else (a corrupt, blank or split line) takes the exact per-line
    path with the standard library.
    """
    body = text.strip()
    if not body:
        return [], (), [], False
    try:
        values = _fast_loads("[" + body.replace("\n", ",") + "]")
    except ValueError:
        values = None
    if isinstance(values, list) and len(values) == body.count("\n") + 1:
        first = text[: len(text) - len(text.lstrip())].count("\n") + 1
        return values, range(first, first + len(values)), [], False
    loads = json.loads
    values = []
    numbers: list[int] = []
    corrupt: list[int] = []
    truncated = False
    lines = text.split("\n")
    last_index = len(lines) - 1
    for index, line in enumerate(lines):
        if not line or line.isspace():
            continue
        try:
            values.append(loads(line))
            numbers.append(index + 1)
        except ValueError:
            corrupt.append(index + 1)
            # The last line without a trailing newline is a write cut short by a crash.
            truncated = truncated or index == last_index
    return values, numbers, corrupt, truncated


_NUMBER_TYPES = frozenset({int, float, type(None)})


def _refusal(record: Mapping[str, Any]) -> str | None:
    """Why a step record breaks the contract's types (cheap check first: this is the hot path)."""
    if (record.get("step").__class__ is int and record.get("loss").__class__ in _NUMBER_TYPES
            and record.get("samples_per_s").__class__ in _NUMBER_TYPES
            and record.get("step_time_s").__class__ in _NUMBER_TYPES):
        return None
    return contract.type_error(record)


def parse_metrics_text(text: str) -> ParsedMetrics:
    """Parse the text of a ``metrics.jsonl`` file; never raises on bad lines.

    Records before the first ``start`` form a segment without a start record. Unknown
    record kinds (with a schema that is read) are ignored, for forward compatibility.

    Args:
        text: the whole file content.

    Returns:
        The parsed segments, step records, epoch records and skipped-line counts.
    """
    values, numbers, corrupt_at, truncated = _decode(text)
    corrupt = len(corrupt_at)
    refused: list[tuple[int, str]] = []
    segments: list[_Segment] = []
    current: _Segment | None = None
    steps: list[dict[str, Any]] = []
    step_segments: list[int] = []
    step_append, segment_append = steps.append, step_segments.append
    epochs: list[dict[str, Any]] = []
    unsupported = 0
    index = -1  # the current segment
    for record, line in zip(values, numbers, strict=True):
        kind = record.get("kind") if isinstance(record, dict) else None
        if kind.__class__ is not str:
            corrupt += 1
            corrupt_at.append(line)
            continue
        if record.get("schema") not in READ_SCHEMAS:
            unsupported += 1
            continue
        if kind == "step":  # the hot path: most records are steps
            problem = _refusal(record)
            if problem is not None:
                refused.append((line, problem))
                continue
            if current is None:
                current = _Segment()
                segments.append(current)
                index = 0
            step_append(record)
            segment_append(index)
            continue
        problem = contract.type_error(record)
        if problem is not None:
            refused.append((line, problem))
            continue
        if kind == "start":
            current = _Segment(start=record)
            segments.append(current)
            index = len(segments) - 1
            continue
        if current is None:
            current = _Segment()
            segments.append(current)
            index = 0
        if kind == "epoch":
            epochs.append({**record, "segment": index})
            if record.get("val_accuracy") is not None:
                current.last_val_accuracy = record.get("val_accuracy")
        elif kind == "end":
            current.end = record
    # Per-segment step counts and last step: step_segments is sorted, so bisect it.
    for number, segment in enumerate(segments):
        first, end = bisect_left(step_segments, number), bisect_right(step_segments, number)
        segment.step_records = end - first
        if end > first:
            segment.last_step = steps[end - 1].get("step")
    return ParsedMetrics(
        segments=tuple(
            {
                "start": seg.start,
                "end": seg.end,
                "step_records": seg.step_records,
                "last_step": seg.last_step,
                "last_val_accuracy": seg.last_val_accuracy,
            }
            for seg in segments
        ),
        steps=steps,
        step_segments=step_segments,
        epochs=tuple(epochs),
        corrupt_lines=corrupt,
        unsupported_lines=unsupported,
        truncated=truncated,
        corrupt_line_numbers=tuple(sorted(corrupt_at)),
        refused=tuple(refused),
    )


def _lines_text(numbers: Sequence[int], most: int = 5) -> str:
    shown = ", ".join(str(n) for n in numbers[:most])
    return f"line{'s' if len(numbers) > 1 else ''} {shown}" + (f" and {len(numbers) - most} more" if len(numbers) > most else "")


def quality_notes(parsed: ParsedMetrics) -> list[str]:
    """What was dropped from a metrics file and why, and which steps had a loss that was not finite (pure).

    The good records of a file are always kept; each note says how many lines were left out.
    """
    notes = []
    kept = sum(1 for _ in parsed.steps) + len(parsed.epochs) + sum(
        (seg["start"] is not None) + (seg["end"] is not None) for seg in parsed.segments)
    what = []
    if parsed.corrupt_lines:
        where = f" ({_lines_text(parsed.corrupt_line_numbers)})" if parsed.corrupt_line_numbers else ""
        cut = " (last line truncated)" if parsed.truncated else ""
        what.append(f"{parsed.corrupt_lines} corrupt line(s){cut}{where}")
    if parsed.unsupported_lines:
        what.append(f"{parsed.unsupported_lines} record(s) with a schema other than "
                    f"{' or '.join(str(v) for v in sorted(READ_SCHEMAS))}")
    if parsed.refused:
        reasons = "; ".join(f"line {n}: {why}" for n, why in parsed.refused[:3])
        more = f"; and {len(parsed.refused) - 3} more" if len(parsed.refused) > 3 else ""
        what.append(f"{len(parsed.refused)} record(s) with a field of the wrong type ({reasons}{more})")
    if what:
        notes.append(f"skipped {' and '.join(what)}; kept the {kept} good record(s)")
    bad = [r.get("step") for r in parsed.steps
           if isinstance(r.get("loss"), str) or (r.get("nonfinite_steps") or 0) > 0]
    if bad:
        shown = ", ".join(str(b) for b in bad[:5]) + (f" ... {bad[-1]}" if len(bad) > 5 else "")
        notes.append(f"the loss was not finite (NaN or infinite) in {len(bad)} step record(s): step(s) {shown}")
    return notes


def _number(value: Any) -> float:
    """Return value as a finite-or-nan float (nan for None, strings, booleans)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return math.nan
    return float(value)


def _integer(value: Any) -> int | None:
    """Return value as an int when it is an integral number, else None."""
    number = _number(value)
    if math.isnan(number) or number != int(number):
        return None
    return int(number)


def summarize_run(parsed: ParsedMetrics) -> dict[str, Any]:
    """Summarise one parsed metrics file as a row of the runs table (without path columns).

    Rules:
        * The setup (world size, batch sizes, model, ...) comes from the first ``start``
          record; ``restart_count`` is the largest seen; hostnames are the union over all
          segments, in order of appearance.
        * ``status`` is the ``status`` of the last segment's ``end`` record, or
          ``"incomplete"`` when the last segment has no ``end`` (crash, still running, or a
          truncated file).
        * A run is ``complete`` when its status is ``"completed"`` and it has a numeric
          throughput. Only complete runs enter the scaling table.
        * ``samples_per_s`` (the run's throughput) is the mean of the ``samples_per_s`` of its
          segments whose ``end`` status is ``"completed"``: a requeued run (``preempted``
          then ``completed``) counts once, with the steady-state throughput of the segment(s)
          that ran to completion; a preempted segment's figure includes the stop and the
          checkpoint, so it is left out.
        * ``wall_time_s`` is the sum over all segments with an ``end`` record.

    Args:
        parsed: the result of :func:`parse_metrics_text`.

    Returns:
        A mapping with the runs-table columns that depend only on the file content.
    """
    segments = parsed.segments
    starts = [seg["start"] for seg in segments if seg["start"] is not None]
    first: Mapping[str, Any] = starts[0] if starts else {}
    versions = first.get("versions") if isinstance(first.get("versions"), dict) else {}
    hostnames: list[str] = []
    for start in starts:
        hosts = start.get("hostnames")
        for host in hosts if isinstance(hosts, list) else []:
            if str(host) not in hostnames:
                hostnames.append(str(host))
    restarts = [_integer(s.get("restart_count")) for s in starts]
    restarts_known = [r for r in restarts if r is not None]

    ends = [seg["end"] for seg in segments if seg["end"] is not None]
    last_end = segments[-1]["end"] if segments else None
    status = str(last_end.get("status")) if last_end is not None else "incomplete"
    completed = [_number(e.get("samples_per_s")) for e in ends if e.get("status") == "completed"]
    completed = [v for v in completed if not math.isnan(v)]
    throughput = sum(completed) / len(completed) if completed else math.nan
    wall = [_number(e.get("wall_time_s")) for e in ends]
    wall = [w for w in wall if not math.isnan(w)]

    reason = ""
    if not segments:
        reason = "no records"
    elif not starts:
        reason = "no start record"
    elif _integer(first.get("world_size")) is None:
        reason = "start record has no world_size"
    elif last_end is None:
        reason = "no end record (crashed, still running, or truncated)"
    elif status == "preempted":
        reason = "preempted and not resumed"
    elif status == "cancelled":
        reason = "cancelled by the user (cyclone-kit cancel)"
    elif status != "completed":
        reason = f"ended with status {status!r}"
    elif not completed:
        reason = "end record has no samples_per_s"
    # the launch shim's finding (e.g. "4 ranks ran as 4 independent copies"): not a point of a scaling study
    warning = str(last_end.get("warning") or "") if last_end is not None else ""
    if not reason and warning:
        reason = f"not a scaling measurement: {warning}"
    complete = reason == ""

    steps = _integer(last_end.get("steps")) if last_end is not None else None
    if steps is None:
        known = [_integer(seg["last_step"]) for seg in segments]
        known_steps = [s for s in known if s is not None]
        steps = max(known_steps) if known_steps else None
    val_accuracy = next(
        (seg["last_val_accuracy"] for seg in reversed(segments) if seg["last_val_accuracy"] is not None),
        None,
    )
    slurm_job_id = first.get("slurm_job_id")
    return {
        "run_id": first.get("run_id"),
        "strategy": first.get("strategy") or "unknown",
        "world_size": _integer(first.get("world_size")),
        "num_nodes": _integer(first.get("num_nodes")),
        "local_world_size": _integer(first.get("local_world_size")),
        "per_device_batch_size": _integer(first.get("per_device_batch_size")),
        "global_batch_size": _integer(first.get("global_batch_size")),
        "model": first.get("model"),
        "dataset": first.get("dataset"),
        "precision": first.get("precision"),
        "launcher": first.get("launcher"),
        "device": first.get("device"),
        "device_name": first.get("device_name"),
        "hostnames": ",".join(hostnames),
        "slurm_job_id": None if slurm_job_id is None else str(slurm_job_id),
        "start_time": first.get("time"),
        "end_time": last_end.get("time") if last_end is not None else None,
        "torch_version": versions.get("torch"),
        "torchvision_version": versions.get("torchvision"),
        "cyclone_kit_version": versions.get("cyclone_kit"),
        "git_commit": first.get("git_commit"),
        "restart_count": max(restarts_known) if restarts_known else max(len(starts) - 1, 0),
        "phase_timing": next((s["phase_timing"] for s in starts if s.get("phase_timing")), None),
        "comm_timing": next((s["comm_timing"] for s in starts if s.get("comm_timing")), None),
        "segments": len(segments),
        "status": status,
        "complete": complete,
        "incomplete_reason": reason,
        "samples_per_s": throughput if complete else math.nan,
        "steps": steps,
        "wall_time_s": sum(wall) if wall else math.nan,
        "val_accuracy": _number(val_accuracy),
        "step_records": sum(seg["step_records"] for seg in segments),
        "corrupt_lines": parsed.corrupt_lines,
        "unsupported_lines": parsed.unsupported_lines,
        "truncated": parsed.truncated,
        "samples_per_run": _integer(first.get("samples_per_run")),
        "warning": warning,
    }


@dataclass(frozen=True)
class SweepInfo:
    """What a ``sweep.json`` says about the runs below it.

    Attributes:
        path: the directory holding ``sweep.json``.
        study: the study name.
        mode: ``"strong"``, ``"weak"`` or None when absent.
        points: resolved run directory -> that point's mapping (name, repeat, ...).
    """

    path: Path
    study: str
    mode: str | None
    points: Mapping[Path, Mapping[str, Any]] = field(default_factory=dict)


def parse_sweep(directory: Path, data: Any) -> SweepInfo:
    """Build a :class:`SweepInfo` from the decoded content of ``directory/sweep.json``.

    Raises:
        ValueError: when ``data`` is not a sweep record.
    """
    if not isinstance(data, dict) or data.get("kind", "sweep") != "sweep":
        raise ValueError("not a sweep record")
    study = data.get("study")
    mode = data.get("mode")
    points: dict[Path, Mapping[str, Any]] = {}
    for point in data.get("points") or []:
        if isinstance(point, dict) and isinstance(point.get("run_dir"), str):
            points[(directory / point["run_dir"]).resolve()] = point
    return SweepInfo(
        path=directory,
        study=str(study) if study else directory.name,
        mode=mode if mode in ("strong", "weak") else None,
        points=points,
    )


@dataclass(frozen=True)
class Ingested:
    """Everything read from a set of metrics files.

    Attributes:
        runs: one row per run (columns :data:`RUN_COLUMNS`).
        steps: every step record: ``run_dir``, ``segment`` and :data:`STEP_FIELDS`.
        epochs: every epoch record: ``run_dir``, ``segment`` and the contract's ``EPOCH_FIELDS``
            (``epoch``, ``val_accuracy``, ``epoch_time_s``, ``time``).
        ranks: per-rank summaries: ``run_dir`` and the contract's ``RANK_SUMMARY_FIELDS`` (``rank``,
            ``host``, ``device``, ``samples_per_s``, ``peak_memory_bytes``) and
            ``RANK_SUMMARY_OPTIONAL_FIELDS`` (``energy_j``: NVML, GPU runs only; empty elsewhere).
        warnings: one line per problem found (also emitted as :class:`MetricsWarning`).
        restarts: (run_dir, entry) per in-job restart of a run (``restarts.json``,
            :mod:`cyclone_kit.rundir.restarts`), oldest first.
    """

    runs: pd.DataFrame
    steps: pd.DataFrame
    epochs: pd.DataFrame
    ranks: pd.DataFrame
    warnings: tuple[str, ...]
    restarts: tuple[tuple[str, dict[str, Any]], ...] = ()

    @property
    def complete_runs(self) -> pd.DataFrame:
        """The runs that count in the scaling table."""
        return self.runs[self.runs["complete"]]

    @property
    def incomplete_runs(self) -> pd.DataFrame:
        """The runs left out of the scaling table, with the reason."""
        return self.runs[~self.runs["complete"]]


def find_metrics_files(paths: Iterable[str | Path]) -> list[tuple[Path, Path]]:
    """Find every ``metrics.jsonl`` below the given directories (or the files themselves).

    Args:
        paths: study directories, run directories, or ``metrics.jsonl`` files.

    Returns:
        ``(metrics_file, given_path)`` pairs, sorted by file within each given path, without
        duplicates.

    Raises:
        ValidationError: a path does not exist, or a directory holds no ``metrics.jsonl``.
    """
    found: list[tuple[Path, Path]] = []
    seen: set[Path] = set()
    for raw in paths:
        given = Path(raw)
        if given.is_file():
            files = [given]
        elif given.is_dir():
            files = sorted(given.rglob(METRICS_FILENAME))
            if not files:
                raise ValidationError(
                    f"no {METRICS_FILENAME} found under {given}",
                    hint="pass a study directory (runs/<study>) or a run directory that holds "
                    f"{METRICS_FILENAME}; runs that never started write none",
                )
        else:
            raise ValidationError(
                f"{given} does not exist", hint="pass an existing study or run directory"
            )
        for file in files:
            key = file.resolve()
            if key not in seen:
                seen.add(key)
                found.append((file, given))
    return found


def _load_sweep(directory: Path, cache: dict[Path, SweepInfo | None], notes: list[str]) -> SweepInfo | None:
    """Return the sweep of the nearest ancestor (or self) holding ``sweep.json``, cached."""
    chain: list[Path] = []
    result: SweepInfo | None = None
    for candidate in (directory, *directory.parents):
        if candidate in cache:
            result = cache[candidate]
            break
        chain.append(candidate)
        sweep_file = candidate / SWEEP_FILENAME
        if sweep_file.is_file():
            try:
                result = parse_sweep(candidate, json.loads(sweep_file.read_text(encoding="utf-8")))
            except (OSError, ValueError) as exc:
                notes.append(f"{sweep_file}: ignored ({exc})")
                continue
            break
    for visited in chain:
        cache[visited] = result
    return result


def _read_rank_files(run_dir: Path, notes: list[str]) -> list[dict[str, Any]]:
    """Read ``run_dir/ranks/rank-*.json``; unreadable files become notes."""
    rows = []
    for file in RunDir(run_dir).rank_summaries():
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as exc:
            notes.append(f"{file}: ignored ({exc})")
            continue
        row = {name: data.get(name) for name in (*contract.RANK_SUMMARY_FIELDS, *contract.RANK_SUMMARY_OPTIONAL_FIELDS,
                                                 *contract.RANK_SUMMARY_CPU_FIELDS)}
        row.update(rank=_integer(row["rank"]), samples_per_s=_number(row["samples_per_s"]),
                   peak_memory_bytes=_number(row["peak_memory_bytes"]), energy_j=_number(row["energy_j"]),
                   cpu_cores=_number(row["cpu_cores"]), threads=_number(row["threads"]))
        rows.append(row)
    return rows


def _fallback_study(given: Path, metrics_file: Path, summary: Mapping[str, Any]) -> str:
    """Study label for a run outside any sweep (see the module docstring)."""
    if given.is_dir() and metrics_file.parent.resolve() != given.resolve():
        return given.resolve().name
    label = "-".join(str(summary[k]) for k in ("model", "dataset") if summary.get(k))
    return label or metrics_file.parent.resolve().parent.name or "study"


def load_runs(paths: Sequence[str | Path] | str | Path, *, warn: bool = True) -> Ingested:
    """Find and read every ``metrics.jsonl`` below ``paths`` into tables.

    Args:
        paths: study directories, run directories or metrics files (one or several).
        warn: emit each problem as a :class:`MetricsWarning` (it is always in ``.warnings``).

    Returns:
        The runs, steps, epochs and ranks tables and the list of problems found.

    Raises:
        ValidationError: a path does not exist or holds no metrics file.
    """
    if isinstance(paths, str | Path):
        paths = [paths]
    notes: list[str] = []
    sweep_cache: dict[Path, SweepInfo | None] = {}
    run_rows: list[dict[str, Any]] = []
    step_frames: list[pd.DataFrame] = []
    epoch_rows: list[dict[str, Any]] = []
    rank_rows: list[dict[str, Any]] = []
    restart_rows: list[tuple[str, dict[str, Any]]] = []
    any_records = False
    for metrics_file, given in find_metrics_files(paths):
        run_dir = metrics_file.parent
        try:
            text = metrics_file.read_bytes().decode("utf-8", errors="replace")
        except OSError as exc:
            notes.append(f"{metrics_file}: unreadable ({exc})")
            continue
        parsed = parse_metrics_text(text)
        any_records = any_records or bool(parsed.segments or parsed.steps or parsed.epochs)
        summary = summarize_run(parsed)
        notes.extend(f"{metrics_file}: {note}" for note in quality_notes(parsed))
        sweep = _load_sweep(run_dir.resolve(), sweep_cache, notes)
        point = sweep.points.get(run_dir.resolve(), {}) if sweep is not None else {}
        key = str(run_dir)
        run_rows.append(
            {
                **summary,
                "study": sweep.study if sweep is not None else _fallback_study(given, metrics_file, summary),
                "run_dir": key,
                "point": point.get("name"),
                "repeat": _integer(point.get("repeat")),
                "declared_mode": sweep.mode if sweep is not None else None,
                "metrics_path": str(metrics_file),
            }
        )
        if parsed.steps:
            frame = parsed.steps_frame()
            frame.insert(0, "run_dir", key)
            step_frames.append(frame)
        epoch_rows.extend({"run_dir": key, **e} for e in parsed.epochs)
        rank_rows.extend({"run_dir": key, **r} for r in _read_rank_files(run_dir, notes))
        restart_rows.extend((key, entry) for entry in read_restarts(run_dir))

    if not any_records:
        raise ValidationError(
            f"no metrics record could be read under {', '.join(str(p) for p in paths)} "
            f"({len(run_rows)} metrics file(s), all empty or corrupt)",
            hint="point report at runs that have started (their metrics.jsonl holds a start record)",
        )
    runs = pd.DataFrame(run_rows, columns=list(RUN_COLUMNS))
    for column in ("world_size", "num_nodes", "local_world_size", "per_device_batch_size",
                   "global_batch_size", "repeat", "steps"):
        runs[column] = runs[column].astype("Int64")
    runs["complete"] = runs["complete"].astype(bool)
    for column in ("samples_per_s", "wall_time_s", "val_accuracy"):
        runs[column] = runs[column].astype(float)

    step_columns = ["run_dir", *STEP_FIELDS, "segment"]
    steps = pd.concat(step_frames, ignore_index=True) if step_frames else pd.DataFrame(columns=step_columns)
    steps = steps[step_columns]
    steps["run_dir"] = steps["run_dir"].astype("category")
    steps["loss"] = [contract.decode_loss(v) for v in steps["loss"]]  # "NaN", "Infinity": the values they name
    for column in STEP_NUMERIC:
        steps[column] = pd.to_numeric(steps[column], errors="coerce")

    epochs = pd.DataFrame(epoch_rows)
    epoch_columns = ["run_dir", "segment", *contract.EPOCH_FIELDS]
    for column in epoch_columns:
        if column not in epochs:
            epochs[column] = pd.Series(dtype=float)
    epochs = epochs[epoch_columns]
    ranks = pd.DataFrame(rank_rows, columns=["run_dir", *contract.RANK_SUMMARY_FIELDS,
                                             *contract.RANK_SUMMARY_OPTIONAL_FIELDS, *contract.RANK_SUMMARY_CPU_FIELDS])
    if warn:
        for note in notes:
            warnings.warn(note, MetricsWarning, stacklevel=2)
    return Ingested(runs=runs, steps=steps, epochs=epochs, ranks=ranks, warnings=tuple(notes),
                    restarts=tuple(restart_rows))
