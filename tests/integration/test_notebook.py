"""Execute analysis/scaling_report.ipynb in a real kernel: on a synthetic study (its numbers must equal
`report`'s) and, with its default parameters, right after the demo (scripts/demo.sh, what `make demo` runs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

from cyclone_kit.analysis.report import write_report  # noqa: E402
from cyclone_kit.analysis.synthetic import SyntheticRun, write_run, write_study  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "analysis" / "scaling_report.ipynb"
MARKER = "TABLE_JSON="
#: The demo's study made small for the test (`scripts/demo.sh RUNS_DIR SWEEP OPTIONS...`): the notebook reads
#: any study; what it shows does not depend on the data set or the epoch's length.
SMALL = ("--set", "train.dataset=synthetic", "--set", "train.synthetic_samples=2048", "--set", "train.val_samples=256")


@pytest.fixture(scope="module")
def kernel_name() -> str:
    """A python3 kernel for this interpreter, installed into sys.prefix when none is found."""
    from jupyter_client.kernelspec import KernelSpecManager

    if "python3" not in KernelSpecManager().find_kernel_specs():
        subprocess.run([sys.executable, "-m", "ipykernel", "install", "--sys-prefix"], check=True,
                       capture_output=True)
    return "python3"


def test_notebook_reproduces_the_report(tmp_path: Path, kernel_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    study = write_study(tmp_path, "nb-strong", "strong", [
        ("n1", SyntheticRun(1, 100.0, per_device_batch_size=64)),
        ("n2", SyntheticRun(2, 185.0, per_device_batch_size=32)),
        ("n4-r0", SyntheticRun(4, 330.0, per_device_batch_size=16)),
        ("n4-r1", SyntheticRun(4, 350.0, per_device_batch_size=16)),
        ("n8", SyntheticRun(8, 1.0, per_device_batch_size=8, statuses=("completed", None))),
    ])
    colab = write_run(tmp_path / "colab", SyntheticRun(1, 25.0, device_name="Tesla T4")).parent
    result = write_report([study], tmp_path / "out", [f"colab={colab}"])
    expected = pd.read_csv(tmp_path / "out" / "scaling.csv")

    nb = nbformat.read(NOTEBOOK, as_version=4)
    params = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(params) == 1, "the notebook needs exactly one cell tagged 'parameters'"
    params[0].source = f"STUDY = {str(study)!r}\nBASELINES = {{'colab': {str(colab)!r}}}"
    dump = f"print({MARKER!r} + table.to_json(orient='records', double_precision=15))"
    nb.cells.append(nbformat.v4.new_code_cell(dump))

    # The kernel inherits this environment: make the checkout importable even when not installed.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name=kernel_name,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()

    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    table = pd.DataFrame(json.loads(text.split(MARKER, 1)[1].splitlines()[0]))

    assert list(table.columns) == list(expected.columns)
    assert table["study"].tolist() == expected["study"].tolist() == ["nb-strong"] * 3
    numeric = [c for c in expected.columns if c not in ("study", "strategy", "mode")]
    np.testing.assert_allclose(table[numeric].to_numpy(dtype=float), expected[numeric].to_numpy(dtype=float),
                               rtol=1e-12, equal_nan=True)
    assert expected["samples_per_s"].tolist() == [100.0, 185.0, 340.0]
    assert result.table["speedup"].tolist() == pytest.approx([1.0, 1.85, 3.4])

    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == 4  # speed-up, efficiency, throughput per device, cost, shown inline
    assert any("text/html" in o.get("data", {}) for o in outputs)  # the table, rendered
    assert "nb-strong [ddp]: amdahl s = " in text  # the fitted law is printed
    assert "no end record" in json.dumps([o.get("data", {}) for o in outputs])  # incomplete run listed


def _run_notebook(nb, cwd: Path, kernel_name: str, monkeypatch: pytest.MonkeyPatch) -> tuple[list, str]:
    """Execute ``nb`` with the kernel in ``cwd``; returns (outputs, all stream text)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    client = nbclient.NotebookClient(nb, timeout=180, kernel_name=kernel_name,
                                     resources={"metadata": {"path": str(cwd)}})
    client.execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"], [
        o.get("evalue") for o in outputs if o.get("output_type") == "error"]
    return outputs, "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")


@pytest.mark.timeout(1800 + 120)  # the demo's own hang guard (1800 s) fires first, with its output
def test_default_notebook_shows_the_newest_demo_study_and_its_warnings(
    tmp_path: Path, kernel_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 17.4: `make demo`, then open the notebook (kernel in analysis/) and run all cells unchanged."""
    checkout = tmp_path / "checkout"  # stands for the repository: runs/ next to analysis/
    (checkout / "analysis").mkdir(parents=True)
    env = {**os.environ, "PYTHON": sys.executable,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    # The demo as `make demo` runs it, on a smaller study: 2,048 synthetic images instead of a whole epoch of
    # Fashion-MNIST where it is installed (~45 CPU-s less; its loading is test_ddp's fashion_mnist test).
    demo = subprocess.run(["bash", str(REPO / "scripts" / "demo.sh"), str(checkout / "runs"), *SMALL], env=env,
                          capture_output=True, text=True, timeout=1800)
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-2000:]
    studies = sorted((checkout / "runs").glob("demo-strong-*"))
    assert len(studies) == 1
    # An older, empty demo study (a sweep that failed before any run started) must not be picked.
    (checkout / "runs" / "demo-strong-20000101-000000").mkdir()

    nb = nbformat.read(NOTEBOOK, as_version=4)
    params = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert "STUDY = None" in params[0].source  # the shipped default, not edited here
    outputs, text = _run_notebook(nb, checkout / "analysis", kernel_name, monkeypatch)

    assert f"study: {studies[0].resolve()}" in text
    assert "2 run(s): 2 complete" in text
    html = json.dumps([o.get("data", {}) for o in outputs])
    assert "demo-strong" in html and "device_hours_per_1m_samples" in html  # the scaling table, rendered
    # The same rules the report applies, printed in the notebook: every warning of the demo's study.
    from cyclone_kit.analysis import fit_scaling_laws, load_runs, scaling_table
    from cyclone_kit.analysis.honesty import review

    data = load_runs(studies[0], warn=False)
    table = scaling_table(data.runs)
    expected = review(data.runs, data.steps, table, fit_scaling_laws(table)).warnings
    for line in expected:
        assert f"warning: {line}" in text
    if not expected:
        assert "no warnings:" in text
    # One doubling (1 -> 2 CPU processes): the fit is exact through one point, and says so.
    assert "demo-strong [ddp]:" in text
    assert "one point beyond N0" in text or "no meaningful fit" in text
    assert len([o for o in outputs if "image/png" in o.get("data", {})]) == 4
