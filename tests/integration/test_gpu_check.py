"""bench/gpu_check.sh where torch is preinstalled and nothing else is: its preflight names every missing
package, a wheelhouse made here brings the pure-Python ones (installed into a folder of the run's own),
and the CPU dry run then runs every stage. The Python is a fresh venv that sees only torch's image."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.cli import REPO
from tests.helpers.torch_only import torch_only_python

#: Hang guards (not performance bounds): the CPU dry run took 270 s on this 2-core machine at load ~8
#: and ~450 s at load ~24 (2026-12-01), under its own budget of 1500 s; a venv takes ~15 s. pytest's
#: own limit is longer, so the subprocess reports first.
GPU_CHECK_HANG_S = 1800
PREFLIGHT_HANG_S = 120


def _gpu_check(python: Path, *args: str, out: Path | None = None, timeout: float = GPU_CHECK_HANG_S,
               ) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # A budget no run reaches: the script's own time budget skips stages on a slow or busy machine, so
    # GPU_CHECK_HANG_S (the subprocess timeout) is the only hang guard, and every stage runs.
    env.update(PYTHON=str(python), PYTHONUNBUFFERED="1", CK_BENCH_QUICK="1", CK_GPU_CHECK_BUDGET_S=str(10**6),
               **({"OUT": str(out)} if out else {}))
    return subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _states(stdout: str) -> dict[str, str]:
    return dict(re.findall(r"^preflight: (\S+)\s+(.+)$", stdout, re.M))


@pytest.mark.timeout(PREFLIGHT_HANG_S + 30)
def test_preflight_names_every_missing_package_and_runs_no_stage(tmp_path: Path) -> None:
    venv = tmp_path / "bare"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(venv)],
                   check=True, timeout=PREFLIGHT_HANG_S)
    proc = _gpu_check(venv / "bin" / "python", "--cpu-dry-run", "--wheelhouse", str(tmp_path / "none"),
                      timeout=PREFLIGHT_HANG_S)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert set(_states(proc.stdout).values()) == {"MISSING"}
    [error] = [line for line in proc.stdout.splitlines() if line.startswith("error: missing:")]
    for dist in ("torch", "torchvision", "numpy", "pillow", "python-hostlist"):
        assert f"{dist} (import" in error
    assert "HINT:" in error and "bench/wheelhouse.py" in error and "not pure Python" in error
    assert "no stage was run" in proc.stdout and "-- bare_eager" not in proc.stdout


def test_the_stage_plan_runs_the_bug_finding_checks_first_and_the_compile_figures_last() -> None:
    """Issue 28: a budget that runs out (or a device call cut short) drops figures, never a check."""
    proc = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), "--list-stages"], cwd=REPO,
                          capture_output=True, text=True, timeout=PREFLIGHT_HANG_S)
    assert proc.returncode == 0, proc.stderr
    stages = re.findall(r"^stage: (\S+)$", proc.stdout, re.M)
    assert stages[:3] == ["fused_sgd_overflow", "fsdp_bf16_batchnorm", "imagefolder_sigterm"]
    assert stages[-2:] == ["bare_compile", "runtime_compile"] and len(stages) == len(set(stages)) == 10
    assert subprocess.run(["bash", "-n", str(REPO / "bench" / "gpu_check.sh")], timeout=60).returncode == 0


@pytest.mark.slow
@pytest.mark.timeout(GPU_CHECK_HANG_S + 120)
def test_cpu_dry_run_on_a_torch_only_python_with_a_wheelhouse(tmp_path: Path) -> None:
    python = torch_only_python(tmp_path / "image")
    # without the project's pure-Python dependency: named, nothing run
    alone = _gpu_check(python, "--cpu-dry-run", "--wheelhouse", str(tmp_path / "none"), timeout=PREFLIGHT_HANG_S)
    assert alone.returncode == 2, alone.stdout + alone.stderr
    states = _states(alone.stdout)
    assert states.pop("python-hostlist") == "MISSING" and set(states.values()) == {"ok"}, alone.stdout

    # the wheelhouse, made here from the project's environment: pure wheels only, compiled ones refused by name
    whl = tmp_path / "whl"
    made = subprocess.run([sys.executable, str(REPO / "bench" / "wheelhouse.py"), "--out", str(whl)],
                          capture_output=True, text=True, timeout=PREFLIGHT_HANG_S)
    assert made.returncode == 0, made.stdout + made.stderr
    assert {p.name.split("-")[0] for p in whl.glob("*.whl")} >= {"python_hostlist", "submitit", "cloudpickle"}
    assert all(p.name.endswith("-py3-none-any.whl") for p in whl.glob("*.whl"))
    refused = subprocess.run([sys.executable, str(REPO / "bench" / "wheelhouse.py"), "--out", str(whl), "numpy"],
                             capture_output=True, text=True, timeout=PREFLIGHT_HANG_S)
    assert refused.returncode == 2 and "numpy" in refused.stderr and "not pure Python" in refused.stderr

    out = tmp_path / "out"
    proc = _gpu_check(python, "--cpu-dry-run", "--wheelhouse", str(whl), out=out)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    assert _states(proc.stdout)["python-hostlist"] == "installed from the wheelhouse"
    assert re.search(r"wheel\(s\) from .* \(pip install --no-index --target\)", proc.stdout)
    assert re.search(r"eager:\s+runtime [\d.]+\s+bare [\d.]+\s+ratio runtime/bare \d+\.\d{3}", proc.stdout)
    assert re.search(r"process group \+ DDP \(bare loop\): [\d.]+\s+vs bare eager ratio \d+\.\d{3}", proc.stdout)
    assert "not possible on one GPU: pipeline_2_stages" in proc.stdout
    figures = json.loads((out / "gpu_check.json").read_text())
    rates = figures["images_per_s"]
    assert figures["cpu_mode"] is True and figures["stages"][:2] == ["fused_sgd_overflow", "fsdp_bf16_batchnorm"]
    assert all(rates[k] and rates[k] > 0 for k in ("bare_eager", "runtime_eager", "bare_ddp_nccl_eager",
                                                   "runtime_fp16"))
    assert figures["checks"] == {"fused_sgd_overflow": "PASS", "fsdp_bf16_batchnorm": "PASS", "imagefolder_sigterm": "PASS"}
    assert re.search(r"^-- fused_sgd_overflow \(timeout \d+s\); stages left after it: fsdp_bf16_batchnorm ", proc.stdout, re.M)
    assert "resnet18 (20 BatchNorm layers)" in proc.stdout and "relative difference to plain SGD" in proc.stdout
    assert any(n.startswith("pipeline_2_stages") for n in figures["not_possible_on_one_gpu"])
    assert (out / "metrics-runtime_eager.jsonl").is_file()
    # nothing was installed into the Python itself: the wheels went to the run's own folder, now gone
    assert subprocess.run([str(python), "-c", "import hostlist"], capture_output=True, timeout=60).returncode != 0
