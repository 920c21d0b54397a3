"""The code that runs inside the job, on every rank (docs/ARCHITECTURE.md draws a rank's start).

Bootstrap: :mod:`~cyclone_kit.runtime.env` (``detect(environ) -> DistEnv``, pure, no torch),
:mod:`~cyclone_kit.runtime.dist` (device, threads, process group), :mod:`~cyclone_kit.runtime.signals`
(stop/requeue on signals), :mod:`~cyclone_kit.runtime.hvd` (Horovod's bootstrap),
:mod:`~cyclone_kit.runtime.torchcompat` (what differs between torch releases).

The launch shim for users' scripts: :mod:`~cyclone_kit.runtime.launch`, :mod:`~cyclone_kit.runtime.pgcheck`,
:mod:`~cyclone_kit.runtime.importhook`.

The session: :mod:`~cyclone_kit.runtime.session` — one run segment's shared path (set-up, metrics, stop
agreement, checkpoints, end record, requeue, teardown) under the public API (:mod:`cyclone_kit.api`) and
the built-in engine alike; :mod:`~cyclone_kit.runtime.metrics` (the records, schema 1),
:mod:`~cyclone_kit.runtime.phases` (step phases), :mod:`~cyclone_kit.runtime.power` (GPU energy).

Rooms: :mod:`~cyclone_kit.runtime.engine` (the built-in engine: one loop skeleton, the data-parallel and
pipeline engines, plan, data, models), :mod:`~cyclone_kit.runtime.checkpoint` (format, atomic write,
checksum, newest good; FSDP shards; pipeline stages), :mod:`~cyclone_kit.runtime.watchers` (job step,
rank exit, stall, a script's steps).

Entry points: ``python -m cyclone_kit.runtime --run-dir DIR [SPEC]`` and
:func:`cyclone_kit.runtime.__main__.run_training` ``(run_dir, spec_path=None) -> int``. ``stepwatch`` and
``watchdog`` here are compatibility aliases of two watchers (rendered batch scripts name them).
"""
