"""Compatibility alias: ``python -m cyclone_kit.launch`` (job scripts rendered before the re-layout) runs
:mod:`cyclone_kit.runtime.launch`. A requeued job re-runs its old script, so this path must keep working."""

import runpy

if __name__ == "__main__":
    runpy.run_module("cyclone_kit.runtime.launch", run_name="__main__", alter_sys=True)
