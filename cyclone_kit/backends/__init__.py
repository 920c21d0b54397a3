"""Backends submit a prepared run directory somewhere: ``slurm``, ``submitit`` or ``local``.

Every backend implements :class:`cyclone_kit.backends.base.Backend` (``submit_run``, ``status``,
``cancel``, ``log_files``); backends are registered here by name and imported lazily (submitit
and torch only when chosen).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from cyclone_kit.errors import ValidationError

if TYPE_CHECKING:
    from cyclone_kit.backends.base import Backend

#: name -> "module:class"
BACKENDS = {
    "slurm": "cyclone_kit.backends.slurm:SlurmBackend",
    "submitit": "cyclone_kit.backends.submitit_:SubmititBackend",
    "local": "cyclone_kit.backends.local:LocalBackend",
}


def get_backend(name: str, **kwargs: Any) -> Backend:
    """Instantiate the backend registered as ``name``."""
    target = BACKENDS.get(name)
    if target is None:
        raise ValidationError(f"unknown backend {name!r}", hint=f"use one of: {', '.join(BACKENDS)}")
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)(**kwargs)
