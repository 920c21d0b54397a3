"""Compatibility alias: ``cyclone_kit.runtime.watchdog`` is :mod:`cyclone_kit.runtime.watchers.rankexit`
(``python -m cyclone_kit.runtime.watchdog -- CMD`` and older callers)."""

import sys

if __name__ == "__main__":
    import runpy

    runpy.run_module("cyclone_kit.runtime.watchers.rankexit", run_name="__main__", alter_sys=True)
else:
    from cyclone_kit.runtime.watchers import rankexit

    sys.modules[__name__] = rankexit
