"""Compatibility alias: ``cyclone_kit.runtime.stepwatch`` is :mod:`cyclone_kit.runtime.watchers.jobstep`
(batch scripts run it with ``-m``; a requeued job re-runs its old script)."""

import sys

if __name__ == "__main__":
    import runpy

    runpy.run_module("cyclone_kit.runtime.watchers.jobstep", run_name="__main__", alter_sys=True)
else:
    from cyclone_kit.runtime.watchers import jobstep

    sys.modules[__name__] = jobstep
