"""The job's rendezvous port (MASTER_PORT): the one formula, and the pick on the batch host.

:func:`job_port` is the only port formula of the package: ``PORT_BASE + (job + step *
PORT_SPAN / STEPS_PER_JOB) % PORT_SPAN``. The sbatch templates (through :mod:`cyclone_kit.submit.render`,
which passes :data:`PORT_BASE` and :data:`PORT_SPAN` to them) start from the job's step-0 port;
the runtime (:func:`cyclone_kit.runtime.env.detect`, when MASTER_PORT is not set) takes the
port of its own step, so concurrent steps of one job differ as well.

The sbatch templates run ``python -m cyclone_kit.core.ports BASE SPAN JOB_ID`` on the first node of
the allocation (where Slurm runs the batch script, and where rank 0 and the rendezvous server
run). It prints ``BASE + JOB_ID % SPAN`` when that port is free there, else the next free one
in ``[BASE, BASE + SPAN)``: two jobs sharing a node whose ids differ by a multiple of SPAN no
longer collide, nor does a job whose port some other program holds. :func:`free_local_port` picks the
port of a run on this host alone (the local launcher, submitit's local executor) from the same range.
Imports nothing heavy.
"""

from __future__ import annotations

import secrets
import socket
import sys
from collections.abc import Callable, Iterator

#: MASTER_PORT range: [PORT_BASE, PORT_BASE + PORT_SPAN), below Linux's ephemeral ports (32768+).
PORT_BASE = 15000
PORT_SPAN = 16000
#: Distinct ports a job id leaves for its steps in :func:`job_port`.
STEPS_PER_JOB = 16


def job_port(job_id: str | int | None, step_id: str | int | None = None, *, base: int = PORT_BASE,
             span: int = PORT_SPAN) -> int:
    """The rendezvous port of a job step: ``base + (job + step * span // 16) % span`` (pure).

    Step 0 (and a missing step) gives ``base + job % span``, the port the batch script tries
    first. Distinct for any two (job, step) pairs whose job ids differ by less than
    ``span / 16`` (1000) and whose steps are below 16. Non-numeric or missing ids count as 0.
    """
    job = _int_or_zero(job_id)
    step = _int_or_zero(step_id) % STEPS_PER_JOB
    return base + (job + step * (span // STEPS_PER_JOB)) % span


def _int_or_zero(value: str | int | None) -> int:
    if isinstance(value, int):
        return max(value, 0)
    return int(value) if value and value.strip().isdigit() else 0


def candidate_ports(base: int, span: int, job_id: int) -> Iterator[int]:
    """The job's own port first, then the rest of the range in order, wrapping around (pure)."""
    first = job_port(job_id, 0, base=base, span=span) - base
    for k in range(span):
        yield base + (first + k) % span


def can_bind(port: int) -> bool:
    """True when a TCP listener could take ``port`` on every address of this host right now.

    With SO_REUSEADDR, as torch's TCPStore binds: a port held only by connections in TIME_WAIT (the
    job's own previous segment, just requeued) is free, one with a live listener is not. Without it,
    a requeued job found its own port "busy", moved to the next one, the neighbouring job id's, and
    two jobs requeued at once on one node took the same port (EADDRINUSE at the rendezvous).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def pick_port(base: int, span: int, job_id: int, free: Callable[[int], bool] = can_bind) -> int:
    """The first free port of :func:`candidate_ports`; the job's own port when none is free."""
    return next((p for p in candidate_ports(base, span, job_id) if free(p)), job_port(job_id, 0, base=base, span=span))


def free_local_port(free: Callable[[int], bool] = can_bind, start: int | None = None) -> int:
    """A rendezvous port for ranks on this host: free now, in ``[PORT_BASE, PORT_BASE + PORT_SPAN)``.

    Not the kernel's pick (``bind(("", 0))``), which is an ephemeral port (Linux: 32768-60999): between the
    pick and rank 0's bind (a new interpreter, ``import torch``: seconds) the kernel hands ports of that range
    to every other process's outgoing connections and gloo's listeners, and rank 0 could fail with
    EADDRINUSE. Ports below it are taken only by programs that ask for them by number. ``start`` (default:
    random) is where the search begins, so that two local runs started together do not both try the same
    port first.
    """
    offset = secrets.randbelow(PORT_SPAN) if start is None else start % PORT_SPAN
    return pick_port(PORT_BASE, PORT_SPAN, offset, free)


def main(argv: list[str] | None = None) -> int:
    """``python -m cyclone_kit.core.ports BASE SPAN JOB_ID``: print the port (exit 2 on bad arguments)."""
    args = sys.argv[1:] if argv is None else argv
    try:
        base, span, job = (int(a) for a in args)
        if not (base >= 1024 and span >= 1 and base + span <= 65536 and job >= 0):
            raise ValueError
    except ValueError:
        print("ERROR: usage: python -m cyclone_kit.core.ports BASE SPAN JOB_ID (integers, BASE >= 1024, BASE + SPAN "
              "<= 65536)  HINT: the sbatch templates call this; regenerate the script with cyclone-kit submit",
              file=sys.stderr)
        return 2
    print(pick_port(base, span, job))
    return 0


if __name__ == "__main__":
    sys.exit(main())
