"""``logs``: print (or follow) the logs of a run, a study or a job id; root cause of a failure first.

A job that has not started says so instead of printing nothing (``job 44 is PENDING
(JobHeldUser): ...; no logs yet``); with ``-f`` it waits for the job to start, saying so, and
then follows the logs until the job ends.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``logs``."""
    p = sub.add_parser("logs", help="print or follow the logs of a run, a study or a job id",
                       description="Print the logs of a run directory, of every point and the report job of a "
                                   "study directory, or of a job id cyclone_kit submitted (found under --runs-dir). "
                                   "A job that has not started says why it waits.")
    p.add_argument("target", help="run directory, study directory, or a job id whose run is under --runs-dir")
    p.add_argument("-f", "--follow", action="store_true",
                   help="keep printing new lines until the job ends (waits for a pending job to start)")
    p.add_argument("--runs-dir", default="runs", help="where to look up a job id (default: ./runs)")
    p.add_argument("-n", "--lines", type=int, default=0, help="only the last N lines of each log (default: all)")
    p.add_argument("--poll", type=float, default=1.0, help=argparse.SUPPRESS)
    p.set_defaults(func=run)


def is_text(head: bytes) -> bool:
    """Whether a file that starts with ``head`` is a text log (no NUL byte, mostly printable; pure).

    A binary file in ``logs/`` (a TensorBoard event file, a pickle) is named, not printed.
    """
    if b"\0" in head:
        return False
    if not head:
        return True
    text = head.decode("utf-8", errors="replace")
    odd = sum(1 for c in text if c == "\ufffd" or (ord(c) < 32 and c not in "\t\n\r\f\b\x1b"))
    return odd <= len(text) // 20


def _print_new(source, offsets: dict[Path, int], lines: int) -> bool:  # type: ignore[no-untyped-def]
    """Print what is new in the source's log files; True when any file has content."""
    seen = False
    for path in source.files():
        try:
            data = path.read_bytes()
        except OSError:
            continue
        seen = seen or bool(data)
        start = offsets.get(path, 0)
        if len(data) > start:
            name = path.relative_to(source.base) if path.is_relative_to(source.base) else path
            if start == 0 and not is_text(data[:8192]):
                print(f"==> {name} <== binary file ({len(data)} bytes), not shown")
                offsets[path] = -1  # named once; never printed
                continue
            if start < 0:  # a binary file, named once
                continue
            text = data[start:].decode(errors="replace")
            if start == 0:
                print(f"==> {name} <==")
                if lines:
                    text = "\n".join(text.splitlines()[-lines:]) + "\n"
            sys.stdout.write(text)
            sys.stdout.flush()
            offsets[path] = len(data)
    return seen


def run(args: argparse.Namespace) -> int:
    """Print the logs; with ``-f`` keep following them until every job is over."""
    from cyclone_kit.backends import lookup

    target = lookup.resolve_target(args.target, Path(args.runs_dir))
    sources = lookup.log_sources(target)
    if target.kind == "run":
        from cyclone_kit.rundir.summary import read_run

        cause = read_run(target.path).root_cause  # type: ignore[arg-type]
        if cause:
            print(f"root cause: {cause}")
    offsets: dict[Path, int] = {}
    said: dict[str, str] = {}  # source label -> the last waiting line printed
    done: set[str] = set()
    while True:
        for source in sources:
            if source.label in done:
                continue
            has_logs = _print_new(source, offsets, args.lines)
            ended = source.ended() if args.follow else False
            if not has_logs and not ended:
                row = source.state()
                prefix = f"{source.label}: " if len(sources) > 1 else ""
                if row.waiting and said.get(source.label) != row.note:
                    tail = "; waiting for it to start (Ctrl-C stops waiting)" if args.follow else "; no logs yet"
                    print(f"{prefix}{row.note}{tail}", flush=True)
                    said[source.label] = row.note or ""
                elif not row.waiting and said.get(source.label) and said[source.label] != "started":
                    print(f"{prefix}job {row.job_id} is {row.state.value}; waiting for its logs", flush=True)
                    said[source.label] = "started"
                elif not row.waiting and not args.follow:
                    what = f"job {row.job_id} is {row.state.value}" if row.job_id != "-" else "never submitted or run"
                    print(f"{prefix}{what}; no logs yet", flush=True)
            if ended:
                _print_new(source, offsets, args.lines)  # what it wrote while ending
                done.add(source.label)
        if not args.follow or len(done) == len(sources):
            for source in sources:
                if source.run_dir is not None:
                    _stop_footer(source.run_dir, offsets)
            return 0
        time.sleep(args.poll)


def _stop_footer(run_dir: Path, offsets: dict[Path, int]) -> None:
    """After a stop (cancel, signal), say where the run ended and its last checkpoint, from the run directory.

    When Slurm cancels a job, srun may be gone before it forwarded the ranks' last lines (the
    checkpoint they wrote on the signal, the end line): the end record and the checkpoint exist,
    the log does not say so. This line does.
    """
    from cyclone_kit.rundir.layout import RunDir

    rd = RunDir(run_dir)
    end = rd.end_record()
    if not end or end.get("status") not in ("cancelled", "preempted"):
        return
    said = f"{end.get('status')} at step {end.get('steps')}/"
    text = "".join(p.read_text(errors="replace") for p, at in offsets.items()
                   if at >= 0 and p.is_relative_to(rd.path) and p.is_file())
    if said in text:
        return
    newest = rd.newest_checkpoint()
    where = f"; last checkpoint written: {newest.relative_to(rd.path)}" if newest else "; no checkpoint written"
    print(f"cyclone_kit: {end.get('status')} at step {end.get('steps')} (from {rd.metrics.name}: the job's output "
          f"stopped before its last lines){where}")
