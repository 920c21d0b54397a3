"""The built-in engine: ``run`` trains a spec on this rank with the engine of its strategy.

* :mod:`~cyclone_kit.runtime.engine.loop` — the one loop skeleton (epochs and steps, the stop/requeue
  check, metrics records, checkpoint cadence, the stall watcher's beat, validation) both engines run;
* :mod:`~cyclone_kit.runtime.engine.dataparallel` — DDP, FSDP2 and Horovod as plug-ins (:class:`Strategy`)
  of one engine; :mod:`~cyclone_kit.runtime.engine.pipeline` (+ ``pipeline_split``) — the pipeline's;
* :mod:`~cyclone_kit.runtime.engine.plan` (schedule maths, precision, the segment's start record),
  :mod:`~cyclone_kit.runtime.engine.data` and :mod:`~cyclone_kit.runtime.engine.models` (never downloaded).

Both engines take the same arguments, write the same metrics contract through the same
:class:`~cyclone_kit.runtime.session.Session`, checkpoint through :mod:`cyclone_kit.runtime.checkpoint`,
and return the end status (``completed`` or ``preempted``). Each is imported only when its strategy
runs: the public API (``ck.*``) and the session never import the engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from cyclone_kit.config.job import JobSpec
from cyclone_kit.runtime.env import DistEnv
from cyclone_kit.runtime.signals import StopFlag

#: Strategies with an engine of their own (everything else is a plug-in of engine/dataparallel.py); all share engine/loop.py.
OWN_LOOPS = ("pipeline",)


def run(spec: JobSpec, run_dir: Path, env: DistEnv, environ: Mapping[str, str], stop_flag: StopFlag | None = None) -> str:
    """Train ``spec`` on this rank with the engine of its strategy; returns the end status."""
    if spec.train.strategy == "pipeline":
        from cyclone_kit.runtime.engine.pipeline import train_pipeline

        return train_pipeline(spec, run_dir, env, environ, stop_flag)
    from cyclone_kit.runtime.engine.dataparallel import train

    return train(spec, run_dir, env, environ, stop_flag)
