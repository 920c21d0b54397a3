"""The report's "where the time goes" section: what it says, and what it refuses to say, on synthetic studies."""

from __future__ import annotations

from pathlib import Path

from cyclone_kit.analysis.render import Heading, render_html, render_markdown
from cyclone_kit.analysis.report import write_report
from cyclone_kit.analysis.synthetic import SyntheticRun, write_study
from cyclone_kit.rundir.network import NetworkFigures, level_from_points, save_network


def _study(tmp_path: Path) -> Path:
    runs = [("n1", SyntheticRun(1, 100.0, device="cpu", device_name=None, model="tiny_cnn", steps=30)),
            ("n2", SyntheticRun(2, 180.0, device="cpu", device_name=None, model="tiny_cnn", steps=30, num_nodes=2))]
    return write_study(tmp_path, "toy", "strong", runs)


def test_a_study_without_phases_is_not_broken_down_nor_predicted(tmp_path: Path) -> None:
    study = _study(tmp_path)
    network = tmp_path / "net"
    network.mkdir()
    points = [(s, 1e-4 + s / 1e9) for s in (4, 4096, 2**20, 2**26)]
    save_network(network / "network.json", NetworkFigures({"inter": level_from_points(points, 2, 2)}, cluster="local",
                                                          partition="cpu"))
    result = write_report([study], tmp_path / "out", network=network / "network.json", accounting=False)
    md = (tmp_path / "out" / "report.md").read_text()
    section = md[md.index("### Where the time goes"):md.index("## Cost of scaling")]
    assert "The step records carry no phases" in section and "not measured" in section
    assert "lost efficiency" not in section  # no cause named from phases that were not measured
    # the synthetic runs name no built-in model in a spec: no prediction, and the report says why
    assert "No prediction: the run's spec names no built-in model" in section
    assert "### Predicted and measured" not in md
    assert (tmp_path / "out" / "breakdown-toy.png").is_file() and (tmp_path / "out" / "breakdown-toy.svg").is_file()
    assert any(p.name == "breakdown-toy.png" for p in result.files)
    assert "data:image/png;base64," in (tmp_path / "out" / "report.html").read_text()


def test_rendering_is_separate_from_content() -> None:
    blocks = [Heading(1, "T <x>")]
    assert render_markdown(blocks) == "# T <x>\n"
    assert "<h1>T &lt;x&gt;</h1>" in render_html(blocks, {})
