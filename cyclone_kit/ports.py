"""Compatibility alias: ``python -m cyclone_kit.ports`` (job scripts rendered before the re-layout) runs
:mod:`cyclone_kit.core.ports`. A requeued job re-runs its old script, so this path must keep working."""

import runpy

if __name__ == "__main__":
    runpy.run_module("cyclone_kit.core.ports", run_name="__main__", alter_sys=True)
