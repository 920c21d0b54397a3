"""The code that runs inside the job, on every rank.

* :mod:`~cyclone_kit.runtime.env` — ``detect(environ) -> DistEnv`` (pure; no torch).
* :mod:`~cyclone_kit.runtime.dist` — device choice, threads, process group (torch imported lazily).
* :mod:`~cyclone_kit.runtime.models`, :mod:`~cyclone_kit.runtime.data` — models by name, data sets
  and loaders (never downloaded).
* :mod:`~cyclone_kit.runtime.train` — the engine (DDP / FSDP2 dispatch, AMP, accumulation,
  LR scaling + warm-up, validation, exact resume).
* :mod:`~cyclone_kit.runtime.checkpoint`, :mod:`~cyclone_kit.runtime.signals`,
  :mod:`~cyclone_kit.runtime.metrics` — atomic checkpoints, stop/requeue on signals, and the
  metrics contract (schema 1).

Entry points: ``python -m cyclone_kit.runtime --run-dir DIR [SPEC]`` and
:func:`cyclone_kit.runtime.__main__.run_training` ``(run_dir, spec_path=None) -> int``.
"""
