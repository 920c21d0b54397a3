"""The report: CSV values, PNG/SVG files, self-contained HTML, baselines, the CLI command, plots."""

from __future__ import annotations

import base64
import json
import re
import xml.etree.ElementTree as ET
from functools import partial
from pathlib import Path

import pandas as pd
import pytest

from cyclone_kit.analysis import plots
from cyclone_kit.analysis.report import (
    PLOT_STEMS,
    load_baseline,
    parse_baseline_spec,
    write_report,
)
from cyclone_kit.analysis.scaling import fit_scaling_laws, scaling_table
from cyclone_kit.analysis.synthetic import SyntheticRun, write_run, write_study
from cyclone_kit.core.errors import ValidationError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
Run = partial(SyntheticRun, model="resnet18")


def make_study(root: Path) -> Path:
    """A strong study: N = 1, 2, 4 (two repeats), one failed N = 8 run, one corrupt line."""
    study = write_study(root, "cifar-strong", "strong", [
        ("n1", Run(1, 100.0, per_device_batch_size=128)),
        ("n2", Run(2, 180.0, per_device_batch_size=64)),
        ("n4-r0", Run(4, 300.0, per_device_batch_size=32)),
        ("n4-r1", Run(4, 340.0, per_device_batch_size=32, statuses=("preempted", "completed"),
                               segment_samples_per_s=(10.0, 340.0))),
        ("n8", Run(8, 500.0, per_device_batch_size=16, num_nodes=2, statuses=("failed",))),
    ], repeats=[0, 0, 0, 1, 0])
    with (study / "n2" / "metrics.jsonl").open("a") as f:
        f.write('{"kind": "step", "sch')
    ranks = study / "n2" / "ranks"
    ranks.mkdir()
    for rank, (host, speed) in enumerate([("gpu01", 90.0), ("gpu02", 60.0)]):
        (ranks / f"rank-{rank:05d}.json").write_text(json.dumps(
            {"rank": rank, "host": host, "device": "cuda:0", "samples_per_s": speed, "peak_memory_bytes": 3 * 2**30}))
    return study


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory):
    """One report (with a CSV and a run-directory baseline), shared by the tests below."""
    root = tmp_path_factory.mktemp("report")
    study = make_study(root)
    colab = write_run(root / "colab" / "run", Run(1, 40.0, device_name="Tesla T4")).parent
    csv = root / "published.csv"
    csv.write_text("name,device,samples_per_s,devices,model\nref-v100,V100,200,1,resnet50\n")
    # The study trains resnet18 (the published row is resnet50): the report must say so.
    with pytest.warns(UserWarning, match="corrupt"):
        result = write_report([study], root / "out", [f"colab={colab}", ("published", csv)])
    return result


def test_scaling_csv_holds_the_hand_computed_values(report) -> None:
    table = pd.read_csv(report.out_dir / "scaling.csv")
    assert list(table["world_size"]) == [1, 2, 4]  # the failed N = 8 run is left out
    assert list(table["runs"]) == [1, 1, 2]
    assert list(table["samples_per_s"]) == [100.0, 180.0, 320.0]  # median of 300 and 340
    assert list(table["speedup"]) == pytest.approx([1.0, 1.8, 3.2])
    assert list(table["efficiency"]) == pytest.approx([1.0, 0.9, 0.8])
    # (1/1.8 - 1/2) / (1/2) = 0.111111; (1/3.2 - 1/4) / (3/4) = 0.083333
    assert table["karp_flatt"].tolist()[1:] == pytest.approx([0.1111111, 0.0833333], rel=1e-6)
    assert pd.isna(table["karp_flatt"].iloc[0])
    assert set(table["mode"]) == {"strong"}
    assert {"study", "mode", "num_nodes", "per_device_batch_size", "global_batch_size", "samples_per_s_min",
            "samples_per_s_max", "samples_per_s_per_device"} <= set(table.columns)


def test_plots_exist_as_valid_png_and_svg(report) -> None:
    for stem in PLOT_STEMS:
        png = report.out_dir / f"{stem}.png"
        assert png.read_bytes()[:8] == PNG_MAGIC
        root = ET.parse(report.out_dir / f"{stem}.svg").getroot()
        assert root.tag.endswith("svg")


def test_html_is_self_contained(report) -> None:
    page = (report.out_dir / "report.html").read_text()
    sources = re.findall(r'(?:src|href)="([^"]*)"', page)
    assert sources and all(s.startswith("data:image/png;base64,") for s in sources)
    assert "<link" not in page and "<script" not in page
    for source in sources:
        assert base64.b64decode(source.split(",", 1)[1])[:8] == PNG_MAGIC
    assert page.count("<img") == len(PLOT_STEMS) + 1  # + the study's "where the time goes" breakdown


def test_markdown_has_setup_table_baselines_incomplete_runs_and_warnings(report) -> None:
    md = (report.out_dir / "report.md").read_text()
    for expected in (
        "## Study cifar-strong", "### Setup", "Tesla V100-SXM2-32GB", "| 4 | 1 | 32 | 128 | 2 | 320.0 |",
        "![", "speedup.png", "Amdahl fit", "## Incomplete runs", "ended with status 'failed'",
        "1 corrupt line(s) (last line truncated)",
        # Per-rank table: slowest 60 vs median 75 -> 0.80, flagged; peak memory 3 GiB.
        "| rank 1 on gpu02 | 0.80 (straggler) | 3.00 |",
        "## Step timing",
        # 4 GPUs: 320 / 40 = 8.00 times colab; the published row (resnet50) gets no headline ratio,
        # but its raw ratios stay in the table (320 / 200 = 1.60).
        "4 GPUs here = 8.00 times colab",
        "| 2 GPUs here | 4.50x (2.25x per device) | 0.90x (0.45x per device) |",
        "| 4 GPUs here | 8.00x (2.00x per device) | 1.60x (0.40x per device) |",
    ):
        assert expected in md, expected
    # Same model, dataset, precision and per-device batch: a headline, stating the device that differs.
    assert "colab (Tesla T4, 1 device(s)); differs: device Tesla T4 vs Tesla V100-SXM2-32GB." in md
    # Issue 17: a different model refuses the headline ratio, and says why.
    assert ("cifar-strong (ddp) vs ref-v100 (V100, 1 device(s)): no headline ratio, not like for like "
            "(model differs; the baseline does not state its precision; differs: model resnet50 vs resnet18)") in md
    assert "times ref-v100" not in md


def test_baselines_csv_and_result(report) -> None:
    comparisons = pd.read_csv(report.out_dir / "baselines.csv")
    row = comparisons[(comparisons["baseline"] == "colab") & (comparisons["world_size"] == 4)].iloc[0]
    assert row["times"] == pytest.approx(8.0)
    assert row["baseline_device"] == "Tesla T4"
    assert list(report.baselines["name"]) == ["colab", "ref-v100"]
    assert {p.name for p in report.files} >= {"scaling.csv", "report.md", "report.html", "speedup.svg"}
    assert report.warnings


def test_baseline_arguments_are_validated(tmp_path: Path) -> None:
    assert parse_baseline_spec("colab=runs/x") == ("colab", Path("runs/x"))
    with pytest.raises(ValidationError, match="NAME=PATH"):
        parse_baseline_spec("colab")
    with pytest.raises(ValidationError, match="does not exist"):
        load_baseline("x", tmp_path / "nope.csv")
    hashed = tmp_path / "hashed.csv"
    hashed.write_text('# a comment line\nname,device,samples_per_s,source\nx,T4,5,"issue #12, table 3"\n')
    assert load_baseline("x", hashed)["source"].tolist() == ["issue #12, table 3"]
    bad = tmp_path / "bad.csv"
    bad.write_text("name,samples_per_s\nx,1\n")
    with pytest.raises(ValidationError, match="lacks column"):
        load_baseline("x", bad)
    write_run(tmp_path / "failed", SyntheticRun(1, 1.0, statuses=("failed",)))
    with pytest.raises(ValidationError, match="no completed run"):
        load_baseline("x", tmp_path / "failed")


def test_the_shipped_reference_baselines_load() -> None:
    path = Path(__file__).resolve().parents[2] / "analysis" / "reference_baselines.csv"
    rows = load_baseline("published", path).set_index("name")
    cyclone = rows.loc["cyclone-reference-16xV100"]
    assert cyclone["samples_per_s"] / cyclone["devices"] == pytest.approx(309.61)
    assert rows.loc["nvidia-dle-1xV100-fp32", "samples_per_s"] == 367
    assert rows["source"].str.len().min() > 20  # every row says where it comes from








def test_plot_functions_return_figures_and_save_only_when_asked(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    study = write_study(tmp_path, "s", "strong", [("a", SyntheticRun(1, 10.0)), ("b", SyntheticRun(4, 30.0))])
    from cyclone_kit.analysis.ingest import load_runs

    table = scaling_table(load_runs(study).runs)
    fits = fit_scaling_laws(table)
    before = sorted(p.name for p in tmp_path.iterdir())
    fig = plots.speedup_figure(table, fits)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.get_xlabel() and ax.get_ylabel()
    assert ax.get_xlim()[1] >= 16  # the prediction runs to 4 x the largest N
    dashed = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
    assert len(dashed) == 1 and "Amdahl prediction" in dashed[0].get_label()
    assert max(dashed[0].get_xdata()) == pytest.approx(16)
    assert any("ideal" in line.get_label() for line in ax.get_lines())
    saved = plots.save_figure(plots.efficiency_figure(table, fits), tmp_path / "e.svg")
    assert saved == [tmp_path / "e.svg"] and (tmp_path / "e.svg").stat().st_size > 0
    assert plots.throughput_figure(table).axes[0].get_ylabel().startswith("throughput per device")
