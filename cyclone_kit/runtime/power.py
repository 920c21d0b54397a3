"""GPU energy of one rank from NVML (``nvidia-ml-py``, optional; GPU runs only).

:func:`start_meter` returns an :class:`EnergyMeter` for the rank's CUDA device, or None when the
device is not a GPU, ``pynvml`` is not installed, or NVML cannot start (no driver): energy is
then "not measured", never a guess. The meter prefers the driver's cumulative energy counter
(``nvmlDeviceGetTotalEnergyConsumption``, Volta and newer: exact, no thread); on older GPUs it
samples ``nvmlDeviceGetPowerUsage`` on a daemon thread and integrates (:func:`integrate_power`).
The result goes into the rank summary as ``energy_j`` (see :mod:`cyclone_kit.runtime.metrics`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

#: Seconds between power samples when the GPU has no energy counter.
SAMPLE_INTERVAL_S = 0.2


def integrate_power(times_s: Sequence[float], watts: Sequence[float]) -> float:
    """Joules from power samples (trapezoid rule; pure). Fewer than two samples give 0."""
    total = 0.0
    for i in range(1, min(len(times_s), len(watts))):
        total += 0.5 * (watts[i] + watts[i - 1]) * (times_s[i] - times_s[i - 1])
    return total


class EnergyMeter:
    """Energy one GPU uses between :meth:`start` and :meth:`stop`.

    Args:
        nvml: the ``pynvml`` module (initialised).
        handle: the NVML device handle.
        clock: a monotonic clock (for tests of the sampling path).
    """

    def __init__(self, nvml: Any, handle: Any, clock: Callable[[], float] = time.monotonic) -> None:
        self._nvml, self._handle, self._clock = nvml, handle, clock
        self._counter_start: float | None = None
        self._times: list[float] = []
        self._watts: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> EnergyMeter:
        """Read the energy counter, or start sampling power when there is none."""
        try:
            self._counter_start = float(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))  # mJ
        except Exception:  # NVML raises NVMLError_NotSupported on pre-Volta GPUs
            self._counter_start = None
            self._sample()
            self._thread = threading.Thread(target=self._loop, name="ck-nvml-power", daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        """One power sample (mW -> W)."""
        self._times.append(self._clock())
        self._watts.append(float(self._nvml.nvmlDeviceGetPowerUsage(self._handle)) / 1000.0)

    def _loop(self) -> None:
        while not self._stop.wait(SAMPLE_INTERVAL_S):
            try:
                self._sample()
            except Exception:  # a failing sample ends sampling, not training
                return

    def stop(self) -> float | None:
        """Joules used since :meth:`start` (None when nothing could be read)."""
        try:
            if self._counter_start is not None:
                now = float(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))
                return max(now - self._counter_start, 0.0) / 1000.0
            self._stop.set()
            if self._thread is not None:
                self._thread.join(timeout=5)
            self._sample()
        except Exception:
            return None
        joules = integrate_power(self._times, self._watts)
        return joules if len(self._times) >= 2 else None


def _handle(nvml: Any, torch_device: Any) -> Any:
    """The NVML handle of a torch CUDA device: by UUID, else by the visible-device index."""
    import os

    import torch

    props = torch.cuda.get_device_properties(torch_device)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        text = str(uuid)
        try:
            return nvml.nvmlDeviceGetHandleByUUID(text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}")
        except Exception:  # fall back to the index
            pass
    index = torch_device.index or 0
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if index < len(visible) and visible[index].isdigit():
        index = int(visible[index])
    return nvml.nvmlDeviceGetHandleByIndex(index)


def start_meter(torch_device: Any) -> EnergyMeter | None:
    """An started :class:`EnergyMeter` for a CUDA ``torch.device``; None where NVML cannot measure."""
    if getattr(torch_device, "type", None) != "cuda":
        return None
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        return EnergyMeter(pynvml, _handle(pynvml, torch_device)).start()
    except Exception:  # no driver, no permission, MIG: energy is "not measured"
        return None
