"""The rank side's watchers, each named for what it watches (docs/ARCHITECTURE.md has the table).

* :mod:`~cyclone_kit.runtime.watchers.jobstep` — the job's step (``srun``), from the batch host: a
  step whose ranks failed, vanished or stalled is ended; restarts inside the job; the requeue.
* :mod:`~cyclone_kit.runtime.watchers.rankexit` — one rank's process, from its parent: how it died
  when it cannot say so itself (a signal), recorded.
* :mod:`~cyclone_kit.runtime.watchers.stall` — a rank's step progress, from a thread inside it: a
  stalled step ends the job within a bound, naming the rank that stopped.
* :mod:`~cyclone_kit.runtime.watchers.scriptsteps` — a user's script's optimizer steps, which feed the
  stall watcher when the script does not call ``ck.log_step``.

All are stdlib only (no torch, no training code). ``cyclone_kit.runtime.stepwatch`` and
``cyclone_kit.runtime.watchdog`` are compatibility aliases (batch scripts and older callers name them).
"""
