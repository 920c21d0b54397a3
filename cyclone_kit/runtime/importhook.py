"""Run a function on a module once it is imported, without importing it (the launch shim's hooks).

The shim watches a user's script from inside its process: :mod:`cyclone_kit.runtime.pgcheck` wraps
``torch.distributed.init_process_group`` and Horovod's ``init``, :mod:`cyclone_kit.runtime.watchers.scriptsteps`
registers a step hook on ``torch.optim``. Neither may import torch for a script that does not, so
:func:`after_import` puts one finder first on :data:`sys.meta_path`: it lets the real finders load a
watched module and calls its functions on the module right after it ran. A module loaded already is
handed to the function at once. A function that raises never breaks the script's import. Stdlib only.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from typing import Any

#: Module name -> the functions run on it after its import, in registration order.
_HOOKS: dict[str, list[Callable[[Any], None]]] = {}


def after_import(name: str, fn: Callable[[Any], None]) -> None:
    """Call ``fn(module)`` once module ``name`` is imported (now, when it is loaded already)."""
    if name in sys.modules:
        with contextlib.suppress(Exception):
            fn(sys.modules[name])
    hooks = _HOOKS.setdefault(name, [])
    if fn not in hooks:
        hooks.append(fn)
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


class _Finder:
    """A meta-path finder that lets the real finders load a watched module, then runs its hooks."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        hooks = _HOOKS.get(fullname)
        if not hooks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module

        def exec_module(module: Any) -> None:
            original(module)
            for fn in list(hooks):
                with contextlib.suppress(Exception):  # never break the script's import
                    fn(module)

        with contextlib.suppress(AttributeError, TypeError):
            loader.exec_module = exec_module
        return spec
