"""The code that runs inside the job, on every rank.

* :mod:`~cyclone_kit.runtime.env` — ``detect(environ) -> DistEnv`` (pure; no torch).
* :mod:`~cyclone_kit.runtime.dist` — device choice, threads, process group (torch imported lazily).
* :mod:`~cyclone_kit.runtime.engine.models`, :mod:`~cyclone_kit.runtime.engine.data` — models by name, data sets
  and loaders (never downloaded).
* :mod:`~cyclone_kit.runtime.engine.dataparallel` — the engine: one loop, strategies (DDP, FSDP2, Horovod) as
  small plug-ins, AMP, accumulation, LR scaling + warm-up, validation, exact resume;
  :mod:`~cyclone_kit.runtime.engine.pipeline` — the pipeline strategy's own loop on the same session.
* :mod:`~cyclone_kit.runtime.session` — one run segment's shared path (set-up, metrics, stop
  agreement, checkpoints, end record, requeue, teardown): the public API (:mod:`cyclone_kit.api`)
  and the built-in engines (``train``, ``pipeline``) all go through it.
* :mod:`~cyclone_kit.runtime.checkpoint`, :mod:`~cyclone_kit.runtime.signals`,
  :mod:`~cyclone_kit.runtime.metrics` — atomic checkpoints, stop/requeue on signals, and the
  metrics contract (schema 1).

Entry points: ``python -m cyclone_kit.runtime --run-dir DIR [SPEC]`` and
:func:`cyclone_kit.runtime.__main__.run_training` ``(run_dir, spec_path=None) -> int``.
"""
