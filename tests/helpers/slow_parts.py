"""Made conditions for tests whose verdict needs one: a slow network, a slow file system.

A study that must come out communication-bound or input-bound cannot hope the machine makes it so
(2 ranks on 2 cores stretch compute as much as the all-reduce, a 5x faster disk decodes faster).
:func:`slow_parts_env` writes a ``sitecustomize.py`` that the ranks' interpreters import at start-up
(it rides on ``PYTHONPATH``, which the launchers pass on) and that, only when the module is imported,
wraps:

* DDP's default all-reduce hook (``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``, the
  one the engine's timed hook calls): each bucket's result is ready ``allreduce_delay_s`` later, on
  the collective's own thread, not backward's: a link of that latency, seen by the engine as exposed
  communication, and costing no core;
* torchvision's ImageFolder loader (``torchvision.datasets.folder.pil_loader``): each image is read
  ``load_delay_s`` late: a slow shared file system, costing no core.

Each delay is a sleep, so the condition is the same on a machine 5x faster or slower; the product's
code is untouched (the patch wraps torch's and torchvision's functions, which the product calls).
"""

from __future__ import annotations

import os
from pathlib import Path

SITECUSTOMIZE = '''\
"""Written by tests/helpers/slow_parts.py: sleeps injected into torch's all-reduce hook / torchvision's loader."""
import importlib.abc
import importlib.machinery
import sys
import time

ALLREDUCE_DELAY_S = {allreduce}
LOAD_DELAY_S = {load}


def _slow_allreduce(module):
    original = module.allreduce_hook

    def allreduce_hook(state, bucket):
        def late(fut):
            time.sleep(ALLREDUCE_DELAY_S)
            return fut.value()
        return original(state, bucket).then(late)

    module.allreduce_hook = allreduce_hook


def _slow_loader(module):
    original = module.pil_loader

    def pil_loader(path):
        time.sleep(LOAD_DELAY_S)
        return original(path)

    module.pil_loader = pil_loader


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a patch on a module right after it is first executed."""

    def __init__(self, patches):
        self.patches = patches

    def find_spec(self, fullname, path, target=None):
        patch = self.patches.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


_PATCHES = {{}}
if ALLREDUCE_DELAY_S > 0:
    _PATCHES["torch.distributed.algorithms.ddp_comm_hooks.default_hooks"] = _slow_allreduce
if LOAD_DELAY_S > 0:
    _PATCHES["torchvision.datasets.folder"] = _slow_loader
if _PATCHES:
    sys.meta_path.insert(0, _AfterImport(_PATCHES))
'''


def slow_parts_env(folder: Path, *, allreduce_delay_s: float = 0.0, load_delay_s: float = 0.0) -> dict[str, str]:
    """Write the ``sitecustomize.py`` into ``folder``; returns the environment that makes every rank load it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE.format(allreduce=float(allreduce_delay_s),
                                                                  load=float(load_delay_s)))
    path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path}
