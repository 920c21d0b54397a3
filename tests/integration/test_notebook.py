"""Execute analysis/scaling_report.ipynb on a synthetic study; its numbers must equal `report`'s."""

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
    assert len(images) == 3  # speed-up, efficiency, throughput per device, shown inline
    assert any("text/html" in o.get("data", {}) for o in outputs)  # the table, rendered
    assert "nb-strong [ddp]: amdahl s = " in text  # the fitted law is printed
    assert "no end record" in json.dumps([o.get("data", {}) for o in outputs])  # incomplete run listed
