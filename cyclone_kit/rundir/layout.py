"""The run directory: its layout, created whole or not at all, and the facts it records.

This module is the one owner of the run directory's file names (the metrics files are named by
the metrics contract, :mod:`cyclone_kit.rundir.contract`; the failure record's content by
:mod:`cyclone_kit.rundir.failures`). Everyone else asks a :class:`RunDir` for a path or a fact::

    RUN_DIR/
      spec.json           the resolved job spec (RunDir.spec; read_spec / write_spec)
      job.sbatch          the rendered batch script (RunDir.script; write_script)
      job_id, backend     written once submitted (write_submission; job_id / backend)
      cancel_requested    a user's `cancel` (write_cancel_request), read by the runtime's end record
      launch.json         the local launcher's record of its ranks (RunDir.launch)
      failure.json        the root cause of a failed run (RunDir.failure; cyclone_kit.rundir.failures)
      metrics.jsonl       the metrics contract (RunDir.metrics; cyclone_kit.rundir.contract)
      ranks/              rank-NNNNN.json summaries and error-rank-NNNNN.json error records
      logs/               scheduler and per-rank logs (rank-N.out / rank-N.err)
      checkpoints/        checkpoints (cyclone_kit.runtime.checkpoint)
      submitit/           submitit's own folder; submitit_job holds its job id
      network.json        a doctor run's network figures (RunDir.network; cyclone_kit.rundir.network)

    STUDY_DIR/            a sweep (StudyDir): sweep.json, submitted.json, report.sbatch, logs/,
      <point>/            and one run directory per point

A run directory is assembled under a hidden temporary name next to its final place and
renamed into place in one step; renaming onto an existing, non-empty directory fails, so two
``submit`` calls in the same second each get their own directory (``-2``, ``-3`` ...).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cyclone_kit.core.errors import ValidationError
from cyclone_kit.rundir import contract
from cyclone_kit.rundir.fileio import read_json, write_atomic

__all__ = [
    "RunDir", "StudyDir", "create_run_dir", "find_runs", "find_studies", "is_run_dir", "last_end_status",
    "remove_run_dir", "run_dir_name", "write_atomic",
]

SPEC_FILE = "spec.json"
SCRIPT_FILE = "job.sbatch"
JOB_ID_FILE = "job_id"
BACKEND_FILE = "backend"
LAUNCH_FILE = "launch.json"
FAILURE_FILE = "failure.json"
WORKER_LOGS_DIR = "workers"
LOGS_DIR = "logs"
CHECKPOINTS_DIR = "checkpoints"
PROGRESS_DIR = "progress"  # the ranks' progress records (cyclone_kit/runtime/watchers/stall.py)
SUBMITIT_DIR = "submitit"
SUBMITIT_JOB_FILE = "submitit_job"
SWEEP_FILE = "sweep.json"
SUBMITTED_FILE = "submitted.json"
REPORT_SCRIPT_FILE = "report.sbatch"
REPORT_DIR = "report"
CANCEL_FILE = "cancel_requested"
REQUEUE_REQUEST_FILE = "requeue_requested"  # a rank in a container asks the step watcher to requeue (no scontrol there)
USER_SCRIPT_DIR = "script"  # the copy of a user's training script (cyclone_kit/script.py)
SHIM_FILE = "shim.jsonl"  # the launch shim's start/end records (cyclone_kit/launch.py)
NETWORK_FILE = "network.json"  # doctor's all-reduce figures per network level (cyclone_kit/rundir/network.py)


@dataclass(frozen=True)
class RunDir:
    """A run directory's named paths and the reads and writes of what it records.

    Attributes:
        path: the directory (it need not exist yet).
    """

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    # ------------------------------------------------------------------ named paths
    @property
    def spec(self) -> Path:
        """``spec.json``: the resolved job spec."""
        return self.path / SPEC_FILE

    @property
    def script(self) -> Path:
        """``job.sbatch``: the rendered batch script."""
        return self.path / SCRIPT_FILE

    @property
    def job_id_file(self) -> Path:
        """``job_id``: the scheduler's job id, once submitted."""
        return self.path / JOB_ID_FILE

    @property
    def backend_file(self) -> Path:
        """``backend``: the name of the backend that ran the job."""
        return self.path / BACKEND_FILE

    @property
    def launch(self) -> Path:
        """``launch.json``: the local launcher's record of its ranks."""
        return self.path / LAUNCH_FILE

    @property
    def failure(self) -> Path:
        """``failure.json``: the failure record (schema: :mod:`cyclone_kit.rundir.failures`)."""
        return self.path / FAILURE_FILE

    @property
    def metrics(self) -> Path:
        """``metrics.jsonl``: the metrics contract (:mod:`cyclone_kit.rundir.contract`)."""
        return self.path / contract.METRICS_FILE

    @property
    def logs(self) -> Path:
        """``logs/``: scheduler and per-rank logs."""
        return self.path / LOGS_DIR

    @property
    def worker_logs(self) -> Path:
        """``logs/workers/``: torchrun's own file per worker (``<rdzv id>_*/attempt_<n>/<local rank>/stdout.log``
        and ``stderr.log``), written beside the job log so that no two workers' lines share one file."""
        return self.path / LOGS_DIR / WORKER_LOGS_DIR

    @property
    def ranks(self) -> Path:
        """``ranks/``: per-rank summaries and error records."""
        return self.path / contract.RANKS_DIR

    @property
    def checkpoints(self) -> Path:
        """``checkpoints/``."""
        return self.path / CHECKPOINTS_DIR

    @property
    def submitit(self) -> Path:
        """``submitit/``: submitit's own folder (pickles and its logs)."""
        return self.path / SUBMITIT_DIR

    @property
    def submitit_job_file(self) -> Path:
        """``submitit_job``: the job id submitit gave, written as soon as it is known."""
        return self.path / SUBMITIT_JOB_FILE

    @property
    def shim(self) -> Path:
        """``shim.jsonl``: rank 0's launch-shim start/end records of a user script (one pair a segment)."""
        return self.path / SHIM_FILE

    @property
    def restarts(self) -> Path:
        """``restarts.json``: the step watcher's in-job restarts (:mod:`cyclone_kit.rundir.restarts`)."""
        return self.path / "restarts.json"

    @property
    def network(self) -> Path:
        """``network.json``: a doctor run's all-reduce latency and bus bandwidth per level (rundir/network.py)."""
        return self.path / NETWORK_FILE

    def user_script_copy(self, name: str) -> Path:
        """``script/<name>``: the copy of the user's training script taken at submission."""
        return self.path / USER_SCRIPT_DIR / name

    def rank_log(self, rank: int, stream: str = "out") -> Path:
        """``logs/rank-N.out`` (``stream="err"``: ``.err``) of the local launcher."""
        return self.logs / f"rank-{rank}.{stream}"

    def rank_summary(self, rank: int) -> Path:
        """``ranks/rank-NNNNN.json``: a rank's summary (metrics contract)."""
        return self.ranks / contract.rank_summary_name(rank)

    def rank_summaries(self) -> list[Path]:
        """Every rank summary, in rank order."""
        return sorted(self.ranks.glob(contract.RANK_SUMMARY_GLOB))

    def error_record(self, rank: int) -> Path:
        """``ranks/error-rank-NNNNN.json``: a rank's own error record (:mod:`cyclone_kit.rundir.failures`)."""
        return self.ranks / f"error-rank-{rank:05d}.json"

    def error_records(self) -> list[Path]:
        """Every rank's error record, in rank order."""
        return sorted(self.ranks.glob("error-rank-*.json"))

    @property
    def progress(self) -> Path:
        """``RUN_DIR/progress``: the ranks' progress records."""
        return self.path / PROGRESS_DIR

    def progress_record(self, rank: int) -> Path:
        """``progress/rank-NNNNN.json``: a rank's progress record (:mod:`cyclone_kit.runtime.watchers.stall`)."""
        return self.progress / f"rank-{rank:05d}.json"

    def progress_records(self) -> list[Path]:
        """Every rank's progress record, in rank order."""
        return sorted(self.progress.glob("rank-*.json"))

    def past_failure(self, segment: str) -> Path:
        """``ranks/failure-SEGMENT.json``: the failure record of an earlier segment of a requeued run."""
        safe = "".join(c if c.isalnum() or c in "-_" else "-" for c in segment)
        return self.ranks / f"failure-{safe}.json"

    def past_failures(self) -> list[Path]:
        """The failure records of earlier segments."""
        return sorted(self.ranks.glob("failure-*.json"))

    # ------------------------------------------------------------------ reads and writes
    def is_run_dir(self) -> bool:
        """A run directory holds the resolved ``spec.json``."""
        return self.spec.is_file()

    def read_spec(self) -> dict[str, Any]:
        """The decoded ``spec.json`` ({} when missing or unreadable)."""
        data = read_json(self.spec)
        return data if isinstance(data, dict) else {}

    def write_spec(self, text: str) -> None:
        """Replace ``spec.json`` atomically."""
        write_atomic(self.spec, text)

    def write_script(self, text: str) -> None:
        """Write ``job.sbatch`` atomically, executable."""
        write_atomic(self.script, text)
        self.script.chmod(0o755)

    def set_threads(self, threads: int) -> None:
        """Record the threads each rank really gets in ``spec.json`` (``resources.cpus_per_task``)."""
        data = read_json(self.spec)
        if not isinstance(data, dict):
            return
        resources = data.get("resources")
        if isinstance(resources, dict) and resources.get("cpus_per_task") != threads:
            data["resources"] = {**resources, "cpus_per_task": threads}
            write_atomic(self.spec, json.dumps(data, indent=2, sort_keys=True) + "\n")

    def job_id(self) -> str | None:
        """The recorded job id (None before submission)."""
        return _read_line(self.job_id_file)

    def backend(self) -> str | None:
        """The name of the backend recorded at submission (None before)."""
        return _read_line(self.backend_file)

    def submitit_job_id(self) -> str | None:
        """The job id submitit gave (None before it is known)."""
        return _read_line(self.submitit_job_file)

    def write_job_id(self, job_id: str) -> None:
        """Record the job id."""
        write_atomic(self.job_id_file, f"{job_id}\n")

    def write_backend(self, backend: str) -> None:
        """Record the backend's name."""
        write_atomic(self.backend_file, f"{backend}\n")

    def write_submission(self, job_id: str, backend: str) -> None:
        """Record the job id and the backend of a submitted run."""
        self.write_job_id(job_id)
        self.write_backend(backend)

    @property
    def cancel_file(self) -> Path:
        """``cancel_requested``: the job id a user's ``cancel`` stopped (written before scancel)."""
        return self.path / CANCEL_FILE

    def write_cancel_request(self, job_id: str) -> None:
        """Record that the user cancels job ``job_id`` (so the run ends "cancelled", not "preempted")."""
        write_atomic(self.cancel_file, f"{job_id}\n")

    def cancel_requested(self) -> bool:
        """True when the user cancelled the job this run directory records (a later resubmission is not)."""
        cancelled = _read_line(self.cancel_file)
        return cancelled is not None and cancelled == self.job_id()

    @property
    def requeue_request(self) -> Path:
        """``requeue_requested``: the job id a rank asked the step watcher to requeue (a rank in a container,
        which has no ``scontrol``: :func:`cyclone_kit.runtime.signals.requeue`)."""
        return self.path / REQUEUE_REQUEST_FILE

    def write_requeue_request(self, job_id: str) -> None:
        """Ask the step watcher, outside the container, to requeue job ``job_id`` when the step has ended."""
        write_atomic(self.requeue_request, f"{job_id}\n")

    def take_requeue_request(self, job_id: str) -> bool:
        """True (and the request removed) when a rank asked to requeue job ``job_id``; another job's is left."""
        asked = _read_line(self.requeue_request)
        if asked is None or asked != job_id:
            return False
        self.requeue_request.unlink(missing_ok=True)
        return True

    def stop_status(self) -> str:
        """The end status of a run stopped by a signal: ``cancelled`` after a user's cancel, else ``preempted``."""
        return "cancelled" if self.cancel_requested() else "preempted"

    def write_submitit_job_id(self, job_id: str) -> None:
        """Record the job id submitit gave."""
        write_atomic(self.submitit_job_file, f"{job_id}\n")

    def write_launch(self, doc: Mapping[str, Any]) -> None:
        """Write ``launch.json``."""
        write_atomic(self.launch, json.dumps(doc, indent=2) + "\n")

    def read_launch(self) -> dict[str, Any] | None:
        """The decoded ``launch.json`` (None when missing)."""
        data = read_json(self.launch)
        return data if isinstance(data, dict) else None

    def end_record(self) -> dict[str, Any] | None:
        """The last ``end`` record in ``metrics.jsonl`` (None if there is none)."""
        return last_end_record(self.metrics)

    def start_record(self) -> dict[str, Any] | None:
        """The last ``start`` record in ``metrics.jsonl`` (None if there is none)."""
        return last_record(self.metrics, "start")

    def newest_checkpoint(self) -> Path | None:
        """The checkpoint written last (None when there is none)."""
        found = [p for p in self.checkpoints.glob("*") if not p.name.startswith(".")] if self.checkpoints.is_dir() else []
        return max(found, key=lambda p: p.stat().st_mtime_ns) if found else None

    def end_status(self) -> str | None:
        """The status of the last ``end`` record in ``metrics.jsonl`` (None if there is none)."""
        return last_end_status(self.metrics)

    def script_warning(self) -> str:
        """What the launch shim found wrong with a script's last segment ('' when nothing), e.g.
        ``4 ranks ran as 4 independent copies ...`` (its ``end`` record in ``shim.jsonl``)."""
        end = last_end_record(self.shim)
        return str(end.get("warning") or "") if end else ""

    @classmethod
    def create(cls, runs_dir: Path, name: str, spec_text: str, files: Mapping[str, str | bytes] | None = None,
               when: float | None = None) -> RunDir:
        """Create ``runs_dir/<name>-<stamp>[-k]/`` holding ``spec.json`` (and ``files``), all or nothing."""
        return cls(create_run_dir(runs_dir, name, {SPEC_FILE: spec_text, **(files or {})}, when))


@dataclass(frozen=True)
class StudyDir:
    """A study (sweep) directory: ``sweep.json``, ``submitted.json``, ``report.sbatch``, one run dir per point."""

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    @property
    def sweep(self) -> Path:
        """``sweep.json``: the study record the analysis reads."""
        return self.path / SWEEP_FILE

    @property
    def submitted(self) -> Path:
        """``submitted.json``: the job id (and outcome) of every point."""
        return self.path / SUBMITTED_FILE

    @property
    def report_script(self) -> Path:
        """``report.sbatch``: the report job."""
        return self.path / REPORT_SCRIPT_FILE

    @property
    def report(self) -> Path:
        """``report/``: where the report job writes."""
        return self.path / REPORT_DIR

    @property
    def logs(self) -> Path:
        """``logs/``: the report job's logs."""
        return self.path / LOGS_DIR

    def run(self, name: str) -> RunDir:
        """The run directory of the point ``name``."""
        return RunDir(self.path / name)

    def is_study(self) -> bool:
        """A study directory holds ``sweep.json``."""
        return self.sweep.is_file()

    def read_sweep(self) -> dict[str, Any]:
        """The decoded ``sweep.json`` ({} when missing or unreadable)."""
        data = read_json(self.sweep)
        return data if isinstance(data, dict) else {}

    def read_submitted(self) -> dict[str, Any] | None:
        """The decoded ``submitted.json`` (None before the study was submitted or run)."""
        data = read_json(self.submitted)
        return data if isinstance(data, dict) else None

    def report_job_id(self) -> str | None:
        """The report job's id, when a report job was submitted."""
        report = (self.read_submitted() or {}).get("report")
        job_id = report.get("job_id") if isinstance(report, dict) else None
        return str(job_id) if job_id else None

    def point_dirs(self) -> list[RunDir]:
        """Every point's run directory: as ``submitted.json`` lists them, else the run directories inside."""
        entries = (self.read_submitted() or {}).get("runs")
        if isinstance(entries, list) and entries:
            names = [str(e.get("run_dir") or e.get("name")) for e in entries if isinstance(e, dict)]
            return [self.run(n) for n in dict.fromkeys(names)]
        return [RunDir(p) for p in sorted(self.path.iterdir()) if p.is_dir() and is_run_dir(p)]


def sweep_file_of(directory: Path) -> Path:
    """``directory/sweep.json`` (for the analysis' search upwards)."""
    return Path(directory) / SWEEP_FILE


def _read_line(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def run_dir_name(name: str, when: float | None = None) -> str:
    """``<name>-<YYYYmmdd-HHMMSS>`` in UTC (pure given ``when``)."""
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime(time.time() if when is None else when))}"


def create_run_dir(runs_dir: Path, name: str, files: Mapping[str, str | bytes], when: float | None = None) -> Path:
    """Create ``runs_dir/<name>-<stamp>[-k]/`` holding ``files`` plus an empty ``logs/``.

    Raises:
        ValidationError: ``runs_dir`` cannot be created or written.
    """
    runs_dir = Path(runs_dir)
    try:
        runs_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=runs_dir))
    except OSError as e:
        raise ValidationError(
            f"cannot create a run directory in {str(runs_dir)!r}: {e.strerror}",
            hint="pass --runs-dir with a writable directory",
        ) from None
    try:
        (tmp / LOGS_DIR).mkdir()
        for rel, data in files.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            write_atomic(tmp / rel, data)
        os.chmod(tmp, 0o755)
        base = run_dir_name(name, when)
        for k in range(1, 1000):
            target = runs_dir / (base if k == 1 else f"{base}-{k}")
            try:
                os.rename(tmp, target)
                return target
            except OSError:
                if not target.exists():
                    raise
        raise ValidationError(f"too many runs named {base!r}", hint="use --name to pick another job name")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_run_dir(path: Path) -> None:
    """Remove a run directory that never got going (submission failed)."""
    shutil.rmtree(path, ignore_errors=True)


def is_run_dir(path: Path) -> bool:
    """A run directory holds the resolved ``spec.json``."""
    return RunDir(path).is_run_dir()


def last_end_record(metrics: Path) -> dict[str, Any] | None:
    """The last ``end`` record in a ``metrics.jsonl`` (None if there is none)."""
    return last_record(metrics, "end")


def last_record(metrics: Path, kind: str) -> dict[str, Any] | None:
    """The last record of ``kind`` in a ``metrics.jsonl`` (None if there is none)."""
    found = None
    try:
        lines = Path(metrics).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("kind") == kind:
            found = rec
    return found


def last_end_status(metrics: Path) -> str | None:
    """The status of the last ``end`` record in a ``metrics.jsonl`` (None if there is none)."""
    rec = last_end_record(metrics)
    return None if rec is None else str(rec.get("status"))


def find_runs(runs_dir: Path) -> list[Path]:
    """Run directories directly below ``runs_dir`` (and one level into studies), newest first."""
    runs_dir = Path(runs_dir)
    if not runs_dir.is_dir():
        return []
    found = [p for p in runs_dir.iterdir() if p.is_dir() and is_run_dir(p)]
    found += [p for study in runs_dir.iterdir() if study.is_dir() and not is_run_dir(study)
              for p in study.iterdir() if p.is_dir() and is_run_dir(p)]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def find_studies(runs_dir: Path) -> list[StudyDir]:
    """Study directories directly below ``runs_dir``, newest first."""
    runs_dir = Path(runs_dir)
    if not runs_dir.is_dir():
        return []
    found = [StudyDir(p) for p in runs_dir.iterdir() if p.is_dir() and StudyDir(p).is_study()]
    return sorted(found, key=lambda s: s.path.stat().st_mtime, reverse=True)
