"""What a user's target names, and how each job in it stands: the library under ``status`` and ``logs``.

A target is whatever the user has in hand:

* a run directory (``runs/smoke-20260101-120000``),
* a study directory (a sweep: every point's run, then the report job),
* a job id cyclone_kit submitted, found under ``--runs-dir``: a run's ``job_id``, or a study's
  report job (``submitted.json``),
* any other Slurm job id (``status`` only: its logs are wherever that job put them).

:func:`rows` turns a target into one :class:`JobRow` per job, asking the backend each run
directory recorded (:func:`cyclone_kit.backends.base.handle_of`); a job Slurm has forgotten
falls back to what its run directory recorded. Nothing here prints.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cyclone_kit.backends.base import JobHandle
from cyclone_kit.core.errors import CycloneError, SlurmError, ValidationError
from cyclone_kit.rundir import failures
from cyclone_kit.rundir.layout import RunDir, StudyDir, find_runs, find_studies
from cyclone_kit.rundir.summary import read_run
from cyclone_kit.slurm.parse import JobInfo
from cyclone_kit.slurm.states import JobState, explain_state

#: States that make ``status`` exit 1 (a user's CANCELLED is no failure; PREEMPTED may be requeued).
FAILED_STATES = frozenset({JobState.FAILED, JobState.TIMEOUT, JobState.NODE_FAIL, JobState.OUT_OF_MEMORY})


@dataclass(frozen=True)
class Target:
    """What a status/logs argument names.

    Attributes:
        kind: ``run``, ``study``, ``report`` (a study's report job) or ``job`` (a bare Slurm job id).
        path: the run or study directory (None for a bare job id).
        job_id: the job id given (``report`` and ``job``), else None.
    """

    kind: str
    path: Path | None
    job_id: str | None = None


@dataclass(frozen=True)
class JobRow:
    """One line of the status table and what the caller needs beyond it.

    Attributes:
        job_id, name, state, nodes, elapsed, reason: the table's columns.
        failed: the job failed (:data:`FAILED_STATES`, or its run recorded a root cause).
        waiting: the job has not started (pending, held, requeued, suspended).
        note: why it waits, in words (see :func:`cyclone_kit.slurm.states.explain_state`).
        root_cause: a failed run's first failure (of its last segment), as one line.
        warnings: what the run recorded that the user should know (a damaged checkpoint skipped).
        history: a requeued run's segments in words (``completed (2 segments: NODE_FAIL on c2,
            then completed)``), None for a run of one segment.
        restarts: the run's in-job restarts, one line each (:func:`cyclone_kit.rundir.restarts.restart_line`).
    """

    job_id: str
    name: str
    state: JobState
    nodes: str = "-"
    elapsed: str = "-"
    reason: str = "-"
    failed: bool = False
    waiting: bool = False
    note: str | None = None
    root_cause: str | None = None
    warnings: tuple[str, ...] = ()
    history: str | None = None
    restarts: tuple[str, ...] = ()

    def cells(self) -> list[str]:
        """The table's columns as text."""
        return [self.job_id, self.name, self.state.value, self.nodes, self.elapsed, self.reason]


def _is_job_id(text: str) -> bool:
    return text.replace("_", "").isdigit()


def resolve_target(target: str, runs_dir: Path) -> Target:
    """Say what ``target`` names (see the module docstring).

    Raises:
        ValidationError: a path that is neither a run nor a study directory.
    """
    path = Path(target)
    if path.is_dir():
        if StudyDir(path).is_study():
            return Target("study", path)
        read_run(path)  # raises the precise error for a directory that is no run directory
        return Target("run", path)
    if not _is_job_id(target):
        read_run(path)  # raises: does not exist
    for run_dir in find_runs(runs_dir):
        if RunDir(run_dir).job_id() == target:
            return Target("run", run_dir, target)
    for study in find_studies(runs_dir):
        if study.report_job_id() == target:
            return Target("report", study.path, target)
    return Target("job", None, target)


def _elapsed(seconds: int) -> str:
    from cyclone_kit.slurm.walltime import format_time

    return format_time(seconds) if seconds else "00:00:00"


def _row(info: JobInfo, name: str, *, cause: str | None = None, scheduler: bool = True) -> JobRow:
    note = explain_state(info.job_id, info.state, info.reason, info.restart_count)
    return JobRow(info.job_id, name or info.name, info.state,
                  str(info.nodes) if scheduler and info.nodes else "-",
                  _elapsed(info.elapsed) if scheduler and info.nodes else "-", info.reason or "-",
                  failed=info.state in FAILED_STATES or (cause is not None and info.state is not JobState.CANCELLED
                                                          and not info.state.is_active),
                  waiting=note is not None, note=note, root_cause=cause)


#: What a backend answered for a job, keyed by (backend, job id): its state, or why there is none.
Known = Mapping[tuple[str, str], "JobInfo | CycloneError"]


def ask_backends(handles: Sequence[JobHandle]) -> dict[tuple[str, str], JobInfo | CycloneError]:
    """Ask each backend once for all of its jobs among ``handles`` (Slurm: one squeue, one sacct)."""
    from cyclone_kit.backends import get_backend

    by_backend: dict[str, list[JobHandle]] = {}
    for handle in handles:
        by_backend.setdefault(handle.backend, []).append(handle)
    known: dict[tuple[str, str], JobInfo | CycloneError] = {}
    for backend, group in by_backend.items():
        try:
            infos: Mapping[str, JobInfo] = get_backend(backend).status_many(group)
            problem: CycloneError = SlurmError("not known to the scheduler",
                                               hint="it left the controller and accounting (sacct) has no record")
        except CycloneError as e:
            infos, problem = {}, e
        for handle in group:
            known[(backend, handle.job_id)] = infos.get(handle.job_id) or problem
    return known


def run_rows(run_dirs: Sequence[Path]) -> list[JobRow]:
    """The rows of many run directories, each backend asked once for all of them (see :func:`run_row`)."""
    from cyclone_kit.backends.base import handle_of

    handles = [h for h in (handle_of(p) for p in run_dirs) if h is not None]
    known = ask_backends(handles) if handles else {}
    return [run_row(p, known=known) for p in run_dirs]


def run_row(run_dir: Path, *, known: Known | None = None) -> JobRow:
    """The row of one run directory, asked through the backend it recorded (or looked up in
    ``known``, what :func:`ask_backends` found for many runs at once).

    A job the scheduler no longer knows (it left the controller and there is no accounting) is
    shown as its run directory recorded it (the end record; a root cause means FAILED).
    """
    from cyclone_kit.backends import get_backend
    from cyclone_kit.backends.base import handle_of
    from cyclone_kit.backends.local import run_dir_status

    rec = read_run(run_dir)
    handle = handle_of(run_dir)
    if handle is None:  # never submitted: what the run directory itself says
        row = _row(run_dir_status("-", run_dir), rec.name, cause=rec.root_cause, scheduler=False)
        return dataclasses.replace(row, warnings=rec.notes)
    try:
        answer = known.get((handle.backend, handle.job_id)) if known is not None else None
        if isinstance(answer, CycloneError):
            raise answer
        info = answer if answer is not None else get_backend(handle.backend).status(handle)
    except CycloneError as e:
        info = run_dir_status(handle.job_id, run_dir)
        if rec.end_status == "cancelled":
            info = JobInfo(handle.job_id, rec.name, JobState.CANCELLED, 0, "", 0, "", None, None)
        row = _row(info, rec.name, cause=rec.root_cause, scheduler=False)
        return dataclasses.replace(row, reason=f"from the run directory ({str(e).split(';')[0]})",
                                   warnings=rec.notes, history=_history(run_dir, None), restarts=_restarts(run_dir))
    return dataclasses.replace(_row(info, rec.name, cause=rec.root_cause), warnings=rec.notes,
                               history=_history(run_dir, get_backend(handle.backend), handle.job_id),
                               restarts=_restarts(run_dir))


def _restarts(run_dir: Path) -> tuple[str, ...]:
    """The run's in-job restarts and its fall-backs to the requeue in words, oldest first (``restarts.json``,
    written by the step watcher)."""
    from cyclone_kit.rundir.restarts import fallback_line, read_fallbacks, read_restarts, restart_line

    limit = RunDir(run_dir).read_spec().get("checkpoint", {}).get("max_restarts")
    lines = [(str(r.get("restart_time") or ""), restart_line(r, limit if isinstance(limit, int) else None))
             for r in read_restarts(run_dir)]
    lines += [(str(f.get("time") or ""), fallback_line(f)) for f in read_fallbacks(run_dir)]
    return tuple(line for _, line in sorted(lines, key=lambda pair: pair[0]))


def _history(run_dir: Path, backend: object, job_id: str | None = None) -> str | None:
    """The segments of a requeued run in words; accounting's state of each run of the job where
    the backend keeps one (``attempts``: NODE_FAIL, PREEMPTED ... as Slurm says)."""
    segments = failures.segment_history(run_dir)
    if len(segments) < 2:
        return None
    states: list[str] = []
    attempts = getattr(backend, "attempts", None)
    if attempts is not None and job_id:
        try:
            states = [a.raw_state or a.state.value for a in attempts(job_id)]
        except CycloneError:
            states = []  # no accounting: the run directory's own records tell it
    # accounting has one entry per run of the job (a requeue), a run may hold several segments (in-job restarts)
    runs = [s.get("restart_count") for s in segments]
    by_segment = [states[r] if isinstance(r, int) and 0 <= r < len(states) else "" for r in runs]
    return failures.history_line(segments, by_segment if all(isinstance(r, int) for r in runs) else states)


def job_row(job_id: str, name: str = "") -> JobRow:
    """The row of a Slurm job that has no run directory (a study's report job, a bare id).

    Raises:
        SlurmError: Slurm does not know the job or cannot be reached.
    """
    from cyclone_kit.backends.slurm import SlurmBackend

    return _row(SlurmBackend().status(job_id), name)


def _report_row(study: StudyDir) -> JobRow | None:
    report = (study.read_submitted() or {}).get("report")
    if not isinstance(report, dict):
        return None
    name = f"{study.read_sweep().get('study', study.path.name)}-report"
    if report.get("job_id"):
        try:
            return job_row(str(report["job_id"]), name)
        except CycloneError as e:
            return JobRow(str(report["job_id"]), name, JobState.UNKNOWN, reason=str(e).split(";")[0])
    if "exit_code" in report:  # a foreground study: the report ran in the sweep's own process
        ok = report["exit_code"] == 0
        return JobRow("-", name, JobState.COMPLETED if ok else JobState.FAILED, failed=not ok)
    return None


def study_rows(study: StudyDir) -> list[JobRow]:
    """One row per point of the study, then the report job's."""
    rows = run_rows([rd.path for rd in study.point_dirs() if rd.is_run_dir()])
    report = _report_row(study)
    return rows + ([report] if report else [])


def rows(target: Target) -> list[JobRow]:
    """The rows of everything ``target`` names."""
    if target.kind == "run":
        return [run_row(target.path)]  # type: ignore[arg-type]
    if target.kind == "study":
        return study_rows(StudyDir(target.path))  # type: ignore[arg-type]
    if target.kind == "report":
        study = StudyDir(target.path)  # type: ignore[arg-type]
        return [job_row(str(target.job_id), f"{study.read_sweep().get('study', study.path.name)}-report")]
    return [job_row(str(target.job_id))]


@dataclass(frozen=True)
class LogSource:
    """A job whose logs ``logs`` prints: a label, where its log files are, how to ask its state.

    Attributes:
        label: the job as the user knows it (``run smoke-...``, ``report of strong-...``).
        base: the directory log paths are shown relative to.
        files: lists the job's log files now.
        state: the job's row now (state, reason, why it waits).
        ended: True once the job will write no more (its run's end record, or a terminal state).
        run_dir: the run directory (None for a report job).
    """

    label: str
    base: Path
    files: Callable[[], list[Path]]
    state: Callable[[], JobRow]
    ended: Callable[[], bool]
    run_dir: Path | None = None


def _run_files(run_dir: Path) -> list[Path]:
    from cyclone_kit.backends import get_backend
    from cyclone_kit.backends.base import handle_of
    from cyclone_kit.backends.base import log_files as run_logs

    handle = handle_of(run_dir)
    if handle is None:
        return run_logs(JobHandle("", "local", run_dir))
    return get_backend(handle.backend).log_files(handle)


def _run_ended(run_dir: Path) -> bool:
    """Whether ``logs -f`` has all of a run's output: a scheduler's job once the scheduler says it ended
    (rank 0 writes its end record before its last lines reach the job's log, and a failed segment may
    be requeued), a run here once its records say so."""
    from cyclone_kit.backends.base import handle_of

    handle = handle_of(run_dir)
    if handle is None or handle.backend == "local":
        rd = RunDir(run_dir)
        if rd.end_status() in ("completed", "failed", "cancelled") or failures.root_cause(rd.path):
            return True
        if handle is None:
            return False
    row = run_row(run_dir)
    return row.state.is_terminal or row.state is JobState.UNKNOWN


def _run_source(run_dir: Path, base: Path) -> LogSource:
    return LogSource(f"run {run_dir.name}", base, lambda: _run_files(run_dir), lambda: run_row(run_dir),
                     lambda: _run_ended(run_dir), run_dir)


def _report_source(study: StudyDir, job_id: str | None, base: Path) -> LogSource:
    def files() -> list[Path]:
        return sorted(p for p in study.logs.glob("*") if p.is_file()) if study.logs.is_dir() else []

    def state() -> JobRow:
        if job_id is None:
            return JobRow("-", "report", JobState.COMPLETED)
        try:
            return job_row(job_id, "report")
        except CycloneError:
            return JobRow(job_id, "report", JobState.UNKNOWN)

    def ended() -> bool:
        row = state()
        return row.state.is_terminal or row.state is JobState.UNKNOWN

    return LogSource(f"report of {study.path.name}", base, files, state, ended)


def log_sources(target: Target) -> list[LogSource]:
    """The jobs whose logs ``target`` names: a run's, or every point's and the report job's of a study.

    Raises:
        ValidationError: a bare job id cyclone_kit did not submit under the runs directory.
    """
    if target.kind == "run":
        return [_run_source(target.path, target.path)]  # type: ignore[arg-type]
    if target.kind in ("study", "report"):
        study = StudyDir(target.path)  # type: ignore[arg-type]
        report = _report_source(study, study.report_job_id(), study.path)
        if target.kind == "report":
            return [report]
        sources = [_run_source(rd.path, study.path) for rd in study.point_dirs() if rd.is_run_dir()]
        return sources + ([report] if study.read_submitted() and (study.read_submitted() or {}).get("report") else [])
    raise ValidationError(f"no run or study under the runs directory has job {target.job_id}",
                          hint="give the run or study directory (printed by submit and sweep), or --runs-dir "
                               "where it was created")
