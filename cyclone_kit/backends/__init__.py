"""Backends submit a prepared run directory somewhere: ``slurm``, ``submitit`` or ``local``.

A backend is a small object with ``name``, ``submit``, ``status`` and ``cancel``; backends
are registered here by name and imported lazily (submitit and torch only when chosen).
"""

from __future__ import annotations

import importlib
from typing import Any

from cyclone_kit.errors import ValidationError

#: name -> "module:class"
BACKENDS = {
    "slurm": "cyclone_kit.backends.slurm:SlurmBackend",
    "submitit": "cyclone_kit.backends.submitit_:SubmititBackend",
    "local": "cyclone_kit.backends.local:LocalBackend",
}


def get_backend(name: str, **kwargs: Any) -> Any:
    """Instantiate the backend registered as ``name``."""
    target = BACKENDS.get(name)
    if target is None:
        raise ValidationError(f"unknown backend {name!r}", hint=f"use one of: {', '.join(BACKENDS)}")
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)(**kwargs)
