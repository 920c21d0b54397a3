"""The built-in engine's entry: the one data-parallel loop (:mod:`~cyclone_kit.runtime.engine.dataparallel`) or the pipeline's.

Both take the same arguments, write the same metrics contract through the same
:class:`~cyclone_kit.runtime.session.Session`, and return the end status (``completed`` or
``preempted``). Each is imported only when its strategy runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from cyclone_kit.config.job import JobSpec
from cyclone_kit.runtime.env import DistEnv
from cyclone_kit.runtime.signals import StopFlag

#: Strategies with a loop of their own (everything else is a plug-in of runtime/train.py).
OWN_LOOPS = ("pipeline",)


def run(spec: JobSpec, run_dir: Path, env: DistEnv, environ: Mapping[str, str], stop_flag: StopFlag | None = None) -> str:
    """Train ``spec`` on this rank with the engine of its strategy; returns the end status."""
    if spec.train.strategy == "pipeline":
        from cyclone_kit.runtime.engine.pipeline import train_pipeline

        return train_pipeline(spec, run_dir, env, environ, stop_flag)
    from cyclone_kit.runtime.engine.dataparallel import train

    return train(spec, run_dir, env, environ, stop_flag)
