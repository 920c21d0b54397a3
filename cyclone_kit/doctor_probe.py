"""Compatibility alias: ``python -m cyclone_kit.doctor_probe`` (job scripts rendered before the re-layout) runs
:mod:`cyclone_kit.doctor.probe`. A requeued job re-runs its old script, so this path must keep working."""

import runpy

if __name__ == "__main__":
    runpy.run_module("cyclone_kit.doctor.probe", run_name="__main__", alter_sys=True)
