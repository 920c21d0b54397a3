"""Issue 17.2: figures for a paper (resolution, editable text, titles, units, node marks, error bars)."""

from __future__ import annotations

import struct
import xml.etree.ElementTree as ET
from functools import partial
from pathlib import Path

import pytest
from matplotlib.container import ErrorbarContainer

from cyclone_kit.analysis import plots
from cyclone_kit.analysis.ingest import load_runs
from cyclone_kit.analysis.scaling import fit_scaling_laws, scaling_table
from cyclone_kit.analysis.synthetic import SyntheticRun, write_study

Cpu = partial(SyntheticRun, device="cpu", device_name=None, model="tiny_cnn", steps=20)


def _study(tmp_path: Path, repeats: bool = False):
    """A strong study on CPU: global batch 128, N = 1, 2 on one node and 4 on two nodes."""
    runs = [("n1", Cpu(1, 100.0, per_device_batch_size=128)), ("n2", Cpu(2, 190.0, per_device_batch_size=64)),
            ("n4", Cpu(4, 350.0, per_device_batch_size=32, num_nodes=2))]
    if repeats:
        runs.append(("n4-r1", Cpu(4, 330.0, per_device_batch_size=32, num_nodes=2)))
    study = write_study(tmp_path, "internal-name-42", "strong", runs)
    data = load_runs(study)
    table = scaling_table(data.runs)
    return data, table, fit_scaling_laws(table), plots.plot_setup(data.runs, table)


def _png_dpi(path: Path) -> float:
    """Pixels per inch from a PNG's pHYs chunk."""
    data = path.read_bytes()
    at = data.index(b"pHYs")
    per_metre, _, unit = struct.unpack(">IIB", data[at + 4:at + 13])
    assert unit == 1
    return per_metre * 0.0254


def test_files_are_300_dpi_png_and_svg_with_editable_text(tmp_path: Path) -> None:
    _data, table, fits, setup = _study(tmp_path)
    fig = plots.speedup_figure(table, fits, setup=setup)
    png, svg, pdf = plots.save_figure(fig, [tmp_path / "s.png", tmp_path / "s.svg", tmp_path / "s.pdf"])
    assert round(_png_dpi(png)) == 300
    texts = ["".join(t.itertext()) for t in ET.parse(svg).getroot().iter("{http://www.w3.org/2000/svg}text")]
    assert any("tiny_cnn, CPU, fp32, global batch 128" in t for t in texts), texts  # real text, not outlines
    assert any("number of CPU processes" in t for t in texts)
    assert pdf.read_bytes()[:5] == b"%PDF-" and b"/FontFile2" in pdf.read_bytes()  # TrueType: editable


def test_titles_units_legend_and_node_boundary(tmp_path: Path) -> None:
    _data, table, fits, setup = _study(tmp_path)
    assert setup.details == "tiny_cnn, CPU, fp32, global batch 128" and setup.unit == "CPU processes"
    for fig in (plots.speedup_figure(table, fits, setup=setup), plots.efficiency_figure(table, fits, setup=setup),
                plots.throughput_figure(table, setup=setup), plots.cost_figure(table, fits, setup=setup)):
        ax = fig.axes[0]
        assert ax.get_title().endswith("tiny_cnn, CPU, fp32, global batch 128")
        assert "CPU process" in ax.get_xlabel() + ax.get_ylabel()
        legend = ax.get_legend() or fig.legends[0]  # a long legend sits below the axes
        labels = [t.get_text() for t in legend.get_texts()]
        assert "measured" in labels and not [label for label in labels if "internal-name-42" in label], labels
    ax = plots.speedup_figure(table, fits, setup=setup).axes[0]
    boundary = [line for line in ax.get_lines() if line.get_label() == "node boundary"]
    assert len(boundary) == 1 and 2 < boundary[0].get_xdata()[0] < 4  # between N = 2 (1 node) and 4 (2 nodes)
    assert any("2 nodes" in t.get_text() for t in ax.texts)
    assert plots.throughput_figure(table, setup=setup).axes[0].get_ylabel() == "throughput per CPU process (samples/s)"


def test_extrapolation_is_shaded_dashed_and_bounded(tmp_path: Path) -> None:
    _data, table, fits, setup = _study(tmp_path)
    ax = plots.speedup_figure(table, fits, setup=setup).axes[0]
    dashed = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
    assert len(dashed) == 1 and "extrapolated to N = 16" in dashed[0].get_label()
    assert min(dashed[0].get_xdata()) == pytest.approx(4) and max(dashed[0].get_xdata()) == pytest.approx(16)
    assert any(p.get_label() == "extrapolated (no data)" for p in ax.patches)


def test_error_bars_only_with_repeats(tmp_path: Path) -> None:
    _data, table, _fits, setup = _study(tmp_path / "one")
    ax = plots.throughput_figure(table, setup=setup).axes[0]
    assert not [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    assert "repeats" not in ax.get_title()
    _data, table, _fits, setup = _study(tmp_path / "two", repeats=True)
    ax = plots.throughput_figure(table, setup=setup).axes[0]
    assert [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    assert "bars: min-max over up to 2 repeats" in ax.get_title()


def test_points_measured_too_briefly_are_ringed(tmp_path: Path) -> None:
    from cyclone_kit.analysis.honesty import review

    study = write_study(tmp_path, "s", "strong", [("n1", Cpu(1, 100.0, steps=3)), ("n2", Cpu(2, 190.0))])
    data = load_runs(study)
    table = scaling_table(data.runs)
    fits = fit_scaling_laws(table)
    checks = review(data.runs, data.steps, table, fits)
    ax = plots.speedup_figure(table, fits, checks=checks).axes[0]
    ringed = [line for line in ax.get_lines() if line.get_label() == "measured too briefly"]
    assert len(ringed) == 1 and list(ringed[0].get_xdata()) == [1.0]  # only N = 1 (2 step records)
    assert not [line for line in plots.speedup_figure(table, fits).axes[0].get_lines()
                if line.get_label() == "measured too briefly"]
