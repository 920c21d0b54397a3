"""Backends submit a prepared run directory somewhere: ``slurm``, ``submitit`` or ``local``.

Every backend implements :class:`cyclone_kit.backends.base.Backend` (``plan``: a
:class:`~cyclone_kit.backends.plan.SubmissionPlan`, ``schedule``, ``submit_run``, ``status``,
``cancel``, ``log_files``); backends are registered here by name and imported lazily (submitit
and torch only when chosen).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from cyclone_kit.core.errors import ValidationError, did_you_mean

if TYPE_CHECKING:
    from cyclone_kit.backends.base import Backend

#: name -> "module:class"
BACKENDS = {
    "slurm": "cyclone_kit.backends.slurm:SlurmBackend",
    "submitit": "cyclone_kit.backends.submitit_:SubmititBackend",
    "local": "cyclone_kit.backends.local:LocalBackend",
}


def check_backend_name(name: str) -> str:
    """``name`` when a backend is registered under it (imports nothing; dry runs check it too).

    Raises:
        ValidationError: no such backend (with the closest name, when one is close).
    """
    if name not in BACKENDS:
        raise ValidationError(f"unknown backend {name!r}",
                              hint=did_you_mean([name], list(BACKENDS)) + f"use one of: {', '.join(BACKENDS)}")
    return name


def get_backend(name: str, **kwargs: Any) -> Backend:
    """Instantiate the backend registered as ``name``."""
    module, cls = BACKENDS[check_backend_name(name)].split(":")
    return getattr(importlib.import_module(module), cls)(**kwargs)
