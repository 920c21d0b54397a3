"""A process for tests/integration/test_prefork.py: it prints what a rank would know about itself as one JSON
line (whether torch was imported before its first line ran, its environment, session, parent, argv, working
directory, open descriptors), writes a line to stderr, then ends as ``PROBE_END`` says: ``exit:N`` or
``signal:NAME`` (to itself), or ``wait`` for a file named by ``PROBE_GO`` first."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

preloaded = "torch" in sys.modules  # before anything here imports it
print(json.dumps({"preloaded": preloaded, "rank": os.environ.get("RANK"), "pid": os.getpid(), "ppid": os.getppid(),
                  "sid": os.getsid(0), "pgid": os.getpgid(0), "argv": sys.argv, "cwd": os.getcwd(),
                  "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")), "name": __name__,
                  "stdin": sys.stdin.read()}), flush=True)
print(f"stderr of rank {os.environ.get('RANK')}", file=sys.stderr, flush=True)
end = os.environ.get("PROBE_END", "exit:0")
if end == "wait":
    while not os.path.exists(os.environ["PROBE_GO"]):
        time.sleep(0.01)
    end = "exit:0"
kind, _, value = end.partition(":")
if kind == "signal":
    os.kill(os.getpid(), getattr(signal, value))
sys.exit(int(value))
