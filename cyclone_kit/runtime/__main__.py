"""``python -m cyclone_kit.runtime --run-dir DIR [SPEC]``: train on this rank (run by every rank).

Also the importable entry point :func:`run_training`, used by the submitit backend and the
local launcher. A rank that fails writes ``DIR/ranks/error-rank-<rank:05d>.json`` (rank, host,
exception type, message, traceback) and exits at once with a non-zero code, without waiting
for its peers; they fail on their next collective (a closed connection, or the process-group
timeout) and exit the same way, so no rank is left hanging. Under Slurm the rank runs as the
child of a small watchdog (:mod:`cyclone_kit.runtime.watchers.rankexit`) that writes the error record and
``failure.json`` when the rank is killed by a signal and cannot write them itself.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cyclone_kit.core.errors import CycloneError


def run_training(run_dir: str | Path, spec_path: str | Path | None = None) -> int:
    """Train the job of ``run_dir`` on this process's rank (rank bootstrap from ``os.environ``).

    Args:
        run_dir: the run directory; metrics, checkpoints and per-rank records go there.
        spec_path: the job spec (``.json`` or ``.toml``); default ``run_dir/spec.json``.

    Returns:
        0 when the run completed or stopped cleanly on a signal (checkpointed, maybe requeued).

    Raises:
        CycloneError: invalid spec, environment or data (one line with a HINT).
        Exception: any training failure. In both cases the rank's error record is written first.
    """
    from cyclone_kit.config.job import load_spec
    from cyclone_kit.rundir.failures import rank_guess
    from cyclone_kit.rundir.layout import RunDir
    from cyclone_kit.runtime.env import detect
    from cyclone_kit.runtime.signals import catch_stop_signals

    environ = os.environ
    run_dir = Path(run_dir)
    rank, host = rank_guess(environ), environ.get("SLURMD_NODENAME") or socket.gethostname()
    try:
        spec = load_spec(Path(spec_path) if spec_path else RunDir(run_dir).spec)
        # Catch the requeue signal (and SIGTERM) before the slow imports below.
        stop_flag = catch_stop_signals(spec.checkpoint.signal)
        env = detect(environ)
        rank, host = env.rank, env.host or host
        spec = _kept_global_batch(spec, env.world_size, environ, rank)
        from cyclone_kit.runtime.dist import teardown
        from cyclone_kit.runtime.engine import run as train

        train(spec, run_dir, env, environ, stop_flag)
        teardown()
        return 0
    except BaseException as exc:
        from cyclone_kit.runtime.watchers.stall import park_if_stalling

        park_if_stalling()  # this rank's watchdog is ending it: the rank that waited is not blamed
        try:
            from cyclone_kit.rundir.failures import write_error_record

            write_error_record(run_dir, rank, host, exc, traceback.format_exc())
        except OSError as write_error:
            sys.stderr.write(f"cyclone_kit: could not write the error record: {write_error}\n")
        raise


def _kept_global_batch(spec: Any, world_size: int, environ: Any, rank: int) -> Any:
    """The spec of a step restarted on fewer ranks inside the job, keeping the run's global batch (plan.py)."""
    raw = str(environ.get("CYCLONE_GLOBAL_BATCH", ""))
    if not raw.isdigit() or getattr(spec, "train", None) is None:
        return spec
    import dataclasses

    from cyclone_kit.runtime.engine.plan import keep_global_batch

    train, said = keep_global_batch(spec.train, world_size, int(raw))
    if said and rank == 0:
        print(f"cyclone_kit: in-job restart on {world_size} rank(s): {said}", flush=True)
    return dataclasses.replace(spec, train=train)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the arguments, run :func:`run_training`, and exit without hanging on failure."""
    parser = argparse.ArgumentParser(prog="python -m cyclone_kit.runtime",
                                     description="Train a cyclone_kit job on this rank.")
    parser.add_argument("--run-dir", default=os.environ.get("CYCLONE_RUN_DIR"),
                        help="run directory (default: $CYCLONE_RUN_DIR)")
    parser.add_argument("spec", nargs="?", help="job spec (default: RUN_DIR/spec.json)")
    args = parser.parse_args(argv)
    if not args.run_dir:
        sys.stderr.write("error: no run directory HINT: pass --run-dir DIR (or export CYCLONE_RUN_DIR)\n")
        return 2
    from cyclone_kit.runtime.watchers import rankexit

    if rankexit.wanted(os.environ):  # under Slurm: a parent records how this rank died (see watchdog)
        rest = list(sys.argv[1:] if argv is None else argv)
        return rankexit.supervise([sys.executable, "-m", "cyclone_kit.runtime", *rest], args.run_dir)
    from cyclone_kit.rundir.failures import rank_guess

    try:
        return run_training(args.run_dir, args.spec)
    except CycloneError as e:
        _die(f"error: [rank {rank_guess(os.environ)}] {e}\n", e.exit_code)
    except KeyboardInterrupt:
        _die("error: interrupted\n", 130)
    except BaseException:
        _die(f"cyclone_kit: rank {rank_guess(os.environ)} failed:\n{traceback.format_exc()}", 1)
    return 1  # not reached


def _die(message: str, code: int) -> None:
    """Print and leave now: no process-group teardown that could wait on a dead peer."""
    sys.stderr.write(message)
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())

