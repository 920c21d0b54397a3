"""Issue 15.3: the NVML energy meter (GPU only) and its absence elsewhere."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cyclone_kit.runtime import metrics as mx
from cyclone_kit.runtime import power


def test_integrate_power_is_the_trapezoid_rule() -> None:
    assert power.integrate_power([0.0, 1.0, 3.0], [100.0, 200.0, 200.0]) == pytest.approx(150.0 + 400.0)
    assert power.integrate_power([0.0], [300.0]) == 0.0


def test_no_meter_on_cpu_or_without_a_driver() -> None:
    assert power.start_meter(torch.device("cpu")) is None
    if not torch.cuda.is_available():  # pynvml installed or not, no NVML library here: not measured
        assert power.start_meter(torch.device("cuda", 0)) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU with NVML (bench/gpu_check.sh runs it)")
def test_meter_reads_energy_on_a_gpu() -> None:
    pytest.importorskip("pynvml")
    meter = power.start_meter(torch.device("cuda", 0))
    assert meter is not None
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(50):
        x = x @ x / 4096
    torch.cuda.synchronize()
    joules = meter.stop()
    assert joules is not None and joules > 0


def test_rank_summary_carries_energy(tmp_path: Path) -> None:
    path = mx.write_rank_summary(tmp_path, 0, "g1", "cuda:0", 10.0, 1024, energy_j=12.5)
    assert json.loads(path.read_text())["energy_j"] == 12.5
    path = mx.write_rank_summary(tmp_path, 1, "c1", "cpu", 10.0, 1024)
    assert "energy_j" not in json.loads(path.read_text())
