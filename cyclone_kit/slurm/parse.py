"""Pure parsers for Slurm's output: sbatch --parsable, squeue -O, sacct --parsable2, scontrol show job.

Each parser takes the raw text a command printed and returns :class:`JobInfo` records; text it
cannot read raises :class:`~cyclone_kit.core.errors.ParseError` quoting that text. The formats the
parsers expect are the ones :mod:`cyclone_kit.slurm.argv` asks for; the tests hold real output
captured from Slurm 22.05.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from dataclasses import dataclass

from cyclone_kit.core.errors import ParseError
from cyclone_kit.slurm import hostlist
from cyclone_kit.slurm.argv import SACCT_FIELDS, SQUEUE_FIELDS
from cyclone_kit.slurm.states import JobState, parse_state

_RAW_QUOTE = 500


@dataclass(frozen=True)
class JobInfo:
    """One Slurm job (or one array task) as the scheduler reports it.

    Attributes:
        job_id: ``"123"``, or ``"123_4"`` for an array task (``"123_[5-9]"`` for pending tasks).
        name: the job name.
        state: the normalised state; ``raw_state`` keeps Slurm's own spelling.
        nodes: number of nodes allocated (requested, while pending).
        nodelist: the allocated nodes as a hostlist, ``""`` while pending.
        elapsed: seconds the job has run.
        reason: why it waits or ended (``PartitionNodeLimit``, ``NonZeroExitCode``); ``""`` for none.
        exit_code: exit status of the batch script once finished, else ``None``.
        restart_count: times the job was requeued; ``None`` where the source does not say (sacct).
        signal: the signal that ended the batch script, if any (``0`` for none), else ``None``.
        raw_state: the state exactly as Slurm printed it (``CANCELLED by 0``).
        source: the command the record came from: ``squeue``, ``sacct`` or ``scontrol``.
    """

    job_id: str
    name: str
    state: JobState
    nodes: int
    nodelist: str
    elapsed: int
    reason: str
    exit_code: int | None
    restart_count: int | None
    signal: int | None = None
    raw_state: str = ""
    source: str = ""

    @property
    def hosts(self) -> list[str]:
        """The allocated host names, expanded."""
        return hostlist.expand(self.nodelist) if self.nodelist else []


def _fail(what: str, raw: str, why: str) -> ParseError:
    """A ParseError quoting (the start of) the raw text."""
    shown = raw if len(raw) <= _RAW_QUOTE else raw[:_RAW_QUOTE] + "..."
    return ParseError(
        f"cannot parse {what} ({why}); raw output: {shown!r}",
        hint="this Slurm prints a format cyclone_kit does not know; report it with the raw output",
    )


def parse_sbatch_parsable(text: str) -> str:
    """The job id from ``sbatch --parsable`` output: ``"123"`` or ``"123;cluster"`` -> ``"123"``.

    Raises:
        ParseError: the last non-empty line is not ``<digits>[;<cluster>]``.
    """
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    match = re.fullmatch(r"(\d+)(?:;(\S+))?", lines[-1]) if lines else None
    if match is None:
        raise _fail("sbatch --parsable output", text, "expected a job id like 123 or 123;cluster")
    return match.group(1)


_DURATION = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")


def parse_duration(text: str) -> int:
    """Seconds in a Slurm duration: ``"0:07"``, ``"12:03:04"``, ``"1-02:03:04"``, ``"2-03"``.

    Slurm writes ``MM:SS`` and ``HH:MM:SS`` with an optional ``D-`` prefix; after a ``D-`` the
    fields are ``HH[:MM[:SS]]``.

    Raises:
        ParseError: the text is not a duration (``UNLIMITED``, ``INVALID``, ``N/A`` included).
    """
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise _fail("a Slurm duration", text, "expected [D-]HH:MM:SS or MM:SS")
    days, first, second, third = match.groups()
    if days is not None:  # D-HH[:MM[:SS]]
        hours, minutes, seconds = int(first), int(second or 0), int(third or 0)
    elif third is not None:  # HH:MM:SS
        hours, minutes, seconds = int(first), int(second), int(third)
    elif second is not None:  # MM:SS
        hours, minutes, seconds = 0, int(first), int(second)
    else:  # a bare number is minutes, as in --time=30
        hours, minutes, seconds = 0, int(first), 0
    return ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + seconds


def _duration(text: str, what: str, raw: str) -> int:
    """A duration field, failing with the whole raw output quoted."""
    try:
        return parse_duration(text)
    except ParseError:
        raise _fail(what, raw, f"{text!r} is not a duration") from None


def _split_exit(text: str, what: str, raw: str) -> tuple[int, int]:
    """``"3:0"`` -> (exit status 3, signal 0)."""
    match = re.fullmatch(r"(\d+):(\d+)", text.strip())
    if match is None:
        raise _fail(what, raw, f"exit code {text!r} is not CODE:SIGNAL")
    return int(match.group(1)), int(match.group(2))


def _int(text: str, what: str, raw: str) -> int:
    """An integer field; ``"3-3"`` (a min-max node count) gives its minimum."""
    match = re.fullmatch(r"(\d+)(?:-\d+)?", text.strip())
    if match is None:
        raise _fail(what, raw, f"{text!r} is not a number")
    return int(match.group(1))


def _reason(text: str) -> str:
    """Slurm's reason, with its placeholders for "no reason" made empty."""
    text = text.strip()
    return "" if text in ("None", "(null)", "") else text


def _nodelist(text: str) -> str:
    """A nodelist, with Slurm's placeholders for "no nodes yet" made empty."""
    text = text.strip()
    return "" if text in ("(null)", "None assigned", "") else text


def parse_squeue(text: str) -> list[JobInfo]:
    """Parse ``squeue --noheader -O`` output in :data:`~cyclone_kit.slurm.argv.SQUEUE_FIELDS` order.

    Every field ends with ``|``; the job name comes last, so a ``|`` inside a name is kept.
    squeue's ``exit_code`` is a raw wait status (``768`` = exit 3, ``15`` = killed by SIGTERM);
    it is reported only once the job is finished.

    Raises:
        ParseError: a line does not have the expected fields.
    """
    jobs = []
    n = len(SQUEUE_FIELDS)
    for line in text.splitlines():
        if not line.strip():
            continue
        if not line.endswith("|"):
            raise _fail("squeue output", text, f"line {line!r} does not end with '|'")
        parts = line[:-1].split("|", n - 1)
        if len(parts) != n:
            raise _fail("squeue output", text, f"line {line!r} has {len(parts)} fields, expected {n}")
        job_id, raw_state, nodes, nodelist, used, reason, restarts, status, name = parts
        state = parse_state(raw_state)
        wait_status = _int(status, "squeue exit_code", text)
        finished = state.is_terminal or state is JobState.PREEMPTED
        jobs.append(
            JobInfo(
                job_id=job_id.strip(),
                name=name,
                state=state,
                nodes=_int(nodes, "squeue node count", text),
                nodelist=_nodelist(nodelist),
                elapsed=_duration(used, "squeue TimeUsed", text),
                reason=_reason(reason),
                exit_code=(wait_status >> 8) & 0xFF if finished else None,
                restart_count=_int(restarts, "squeue restart count", text),
                signal=wait_status & 0x7F if finished else None,
                raw_state=raw_state.strip(),
                source="squeue",
            )
        )
    return jobs


def parse_sacct(text: str) -> list[JobInfo]:
    """Parse ``sacct --noheader --parsable2 --allocations`` output in SACCT_FIELDS order.

    The job name is the last field, so a ``|`` inside a name is kept. sacct does not report
    restarts, so ``restart_count`` is ``None``.

    Raises:
        ParseError: a line does not have the expected fields.
    """
    jobs = []
    n = len(SACCT_FIELDS)
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = line.split("|", n - 1)
        if len(parts) != n:
            raise _fail("sacct output", text, f"line {line!r} has {len(parts)} fields, expected {n}")
        job_id, raw_state, nodes, nodelist, elapsed, reason, exit_text, name = parts
        state = parse_state(raw_state)
        code, sig = _split_exit(exit_text, "sacct output", text)
        finished = state.is_terminal or state is JobState.PREEMPTED
        jobs.append(
            JobInfo(
                job_id=job_id.strip(),
                name=name,
                state=state,
                nodes=_int(nodes, "sacct node count", text),
                nodelist=_nodelist(nodelist),
                elapsed=_int(elapsed, "sacct ElapsedRaw", text),
                reason=_reason(reason),
                exit_code=code if finished else None,
                restart_count=None,
                signal=sig if finished else None,
                raw_state=raw_state.strip(),
                source="sacct",
            )
        )
    return jobs


# A key is a word (with the : / . characters some keys have) right after whitespace or the start.
_SCONTROL_KEY = re.compile(r"(?:^|(?<=\s))([A-Za-z][A-Za-z0-9_:/.]*)=")


def parse_scontrol_fields(record: str) -> dict[str, str]:
    """Split one ``scontrol show job`` record (multi-line or ``-o``) into its Key=Value fields.

    Values may contain spaces (``JobName=my run``) and ``=`` (``TRES=cpu=1,node=1``); a value
    holding a space followed by ``word=`` is ambiguous in scontrol's format and is cut there.
    """
    fields: dict[str, str] = {}
    matches = list(_SCONTROL_KEY.finditer(record))
    for i, match in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(record)
        fields.setdefault(match.group(1), record[match.end() : end].strip())
    return fields


def parse_scontrol_job(text: str) -> list[JobInfo]:
    """Parse ``scontrol show job`` output (one or more records) into :class:`JobInfo` records.

    Array tasks get ids like ``123_4`` (``123_[5-9]`` for a pending range).

    Raises:
        ParseError: a record lacks JobId, JobState, NumNodes, RunTime or ExitCode.
    """
    records = [r for r in re.split(r"(?m)^(?=JobId=)", text) if r.strip()]
    jobs = []
    for record in records:
        fields = parse_scontrol_fields(record)
        missing = [k for k in ("JobId", "JobState", "NumNodes", "RunTime", "ExitCode") if k not in fields]
        if missing:
            raise _fail("scontrol show job output", text, f"missing {', '.join(missing)}")
        job_id = fields["JobId"]
        task = fields.get("ArrayTaskId")
        if task:
            job_id = f"{fields.get('ArrayJobId', job_id)}_{task if task.isdigit() else f'[{task}]'}"
        state = parse_state(fields["JobState"])
        code, sig = _split_exit(fields["ExitCode"], "scontrol show job output", text)
        finished = state.is_terminal or state is JobState.PREEMPTED
        jobs.append(
            JobInfo(
                job_id=job_id,
                name=fields.get("JobName", ""),
                state=state,
                nodes=_int(fields["NumNodes"], "scontrol NumNodes", text),
                nodelist=_nodelist(fields.get("NodeList", "")),
                elapsed=_duration(fields["RunTime"], "scontrol RunTime", text),
                reason=_reason(fields.get("Reason", "")),
                exit_code=code if finished else None,
                restart_count=_int(fields.get("Restarts", "0"), "scontrol Restarts", text),
                signal=sig if finished else None,
                raw_state=fields["JobState"],
                source="scontrol",
            )
        )
    return jobs


# When an array's tasks are in different states, the job as a whole is in the first of these.
_ARRAY_PRECEDENCE = (
    JobState.RUNNING,
    JobState.COMPLETING,
    JobState.SUSPENDED,
    JobState.REQUEUED,
    JobState.PENDING,
    JobState.PREEMPTED,
    JobState.NODE_FAIL,
    JobState.OUT_OF_MEMORY,
    JobState.TIMEOUT,
    JobState.FAILED,
    JobState.CANCELLED,
    JobState.COMPLETED,
    JobState.UNKNOWN,
)


def array_task_ids(text: str) -> frozenset[int]:
    """The task ids of squeue's array-task field: ``[0-3,7%2]`` -> {0, 1, 2, 3, 7}; ``5`` -> {5} (pure).

    Anything else (a parent id's empty field) gives the empty set.
    """
    body = text.strip()
    if body.startswith("[") and body.endswith("]"):
        body = body[1:-1]
    body = body.split("%", 1)[0]
    ids: set[int] = set()
    for part in body.split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            return frozenset()
        ids.update(range(int(low), int(high or low) + 1))
    return frozenset(ids)


def select_job(job_id: str, records: Iterable[JobInfo]) -> JobInfo | None:
    """The record for ``job_id`` among a command's records, or ``None`` when there is none.

    An exact id match wins; a task id (``"123_7"``) also matches the one record squeue gives for
    the tasks still pending together (``"123_[0-49]"``). Asking for an array job's parent id (``"123"``) when only its tasks
    (``"123_0"``, ``"123_[1-3]"``) are listed gives one summary record: the most active task
    state (running before pending before failed before completed), the sum of nodes, and the
    worst exit code.
    """
    records = list(records)
    for record in records:
        if record.job_id == job_id:
            return record
    parent, _, task = job_id.partition("_")
    if task.isdigit():  # a task of an array still pending as one record: 123_[0-49%5]
        for record in records:
            head, _, tasks_text = record.job_id.partition("_")
            if head == parent and int(task) in array_task_ids(tasks_text):
                return dataclasses.replace(record, job_id=job_id)
        return None
    tasks = [r for r in records if r.job_id.split("_", 1)[0] == job_id]
    if not tasks:
        return None
    states = {t.state for t in tasks}
    state = next(s for s in _ARRAY_PRECEDENCE if s in states)
    first = next(t for t in tasks if t.state is state)
    codes = [t.exit_code for t in tasks if t.exit_code is not None]
    restarts = [t.restart_count for t in tasks if t.restart_count is not None]
    return JobInfo(
        job_id=job_id,
        name=first.name,
        state=state,
        nodes=sum(t.nodes for t in tasks),
        nodelist=hostlist.collect(sorted({h for t in tasks for h in t.hosts})),
        elapsed=max(t.elapsed for t in tasks),
        reason=first.reason,
        exit_code=max(codes) if codes and state.is_terminal else None,
        restart_count=max(restarts) if restarts else None,
        signal=first.signal,
        raw_state=first.raw_state,
        source=first.source,
    )
