"""The job's rendezvous port (MASTER_PORT), picked on the batch host when the job starts.

The sbatch templates run ``python -m cyclone_kit.ports BASE SPAN JOB_ID`` on the first node of
the allocation (where Slurm runs the batch script, and where rank 0 and the rendezvous server
run). It prints ``BASE + JOB_ID % SPAN`` when that port is free there, else the next free one
in ``[BASE, BASE + SPAN)``: two jobs sharing a node whose ids differ by a multiple of SPAN no
longer collide, nor does a job whose port some other program holds. Imports nothing heavy.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable, Iterator


def candidate_ports(base: int, span: int, job_id: int) -> Iterator[int]:
    """The job's own port first, then the rest of the range in order, wrapping around (pure)."""
    first = job_id % span
    for k in range(span):
        yield base + (first + k) % span


def can_bind(port: int) -> bool:
    """True when a TCP listener could take ``port`` on every address of this host right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def pick_port(base: int, span: int, job_id: int, free: Callable[[int], bool] = can_bind) -> int:
    """The first free port of :func:`candidate_ports`; the job's own port when none is free."""
    return next((p for p in candidate_ports(base, span, job_id) if free(p)), base + job_id % span)


def main(argv: list[str] | None = None) -> int:
    """``python -m cyclone_kit.ports BASE SPAN JOB_ID``: print the port (exit 2 on bad arguments)."""
    args = sys.argv[1:] if argv is None else argv
    try:
        base, span, job = (int(a) for a in args)
        if not (base >= 1024 and span >= 1 and base + span <= 65536 and job >= 0):
            raise ValueError
    except ValueError:
        print("ERROR: usage: python -m cyclone_kit.ports BASE SPAN JOB_ID (integers, BASE >= 1024, BASE + SPAN "
              "<= 65536)  HINT: the sbatch templates call this; regenerate the script with cyclone-kit submit",
              file=sys.stderr)
        return 2
    print(pick_port(base, span, job))
    return 0


if __name__ == "__main__":
    sys.exit(main())
