"""Network figures: the all-reduce fit (alpha, busbw as nccl-tests reports it), network.json, doctor's sweep rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cyclone_kit.config.job import JobSpec, Resources
from cyclone_kit.config.profile import load_profile
from cyclone_kit.config.validate import resolve
from cyclone_kit.core.errors import ValidationError
from cyclone_kit.doctor import checks as doctor
from cyclone_kit.doctor.checks import SmokeResult
from cyclone_kit.doctor.probe import level_members, sweep_iters, sweep_sizes
from cyclone_kit.rundir.network import (
    bus_factor,
    fit_alpha_beta,
    level_from_points,
    load_network,
    save_network,
)

REPORTS = Path(__file__).parent / "doctor_reports"


def _points(alpha: float, busbw_gbps: float, ranks: int) -> list[tuple[int, float]]:
    return [(s, alpha + bus_factor(ranks) * s / (busbw_gbps * 1e9)) for s in sweep_sizes(64 * 2**20)]


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_the_fit_recovers_latency_and_bus_bandwidth(ranks: int) -> None:
    alpha, busbw = fit_alpha_beta(_points(50e-6, 12.5, ranks), ranks)
    assert alpha == pytest.approx(50e-6, rel=1e-6) and busbw == pytest.approx(12.5, rel=1e-6)


def test_the_fit_weighs_small_messages_as_much_as_large_ones() -> None:
    points = _points(20e-6, 1.0, 2)
    noisy = [(s, t * (1.3 if s > 32 * 2**20 else 1.0)) for s, t in points]  # one slow large message
    alpha, busbw = fit_alpha_beta(noisy, 2)
    assert alpha == pytest.approx(20e-6, rel=0.2) and 0.8 < busbw < 1.05


def test_a_flat_sweep_takes_the_largest_message_bandwidth() -> None:
    alpha, busbw = fit_alpha_beta([(4, 1e-3), (64 * 2**20, 1e-3)], 2)
    assert busbw == pytest.approx(64 * 2**20 / 1e-3 / 1e9)  # no slope: the largest message's bandwidth
    assert 0 <= alpha <= 1e-3
    with pytest.raises(ValueError):
        fit_alpha_beta([(4, 1e-3)], 2)


def test_sweep_sizes_and_levels() -> None:
    sizes = sweep_sizes(64 * 2**20)
    assert sizes[0] == 4 and sizes[-1] == 64 * 2**20 and len(sizes) == 25
    assert sweep_sizes(256 * 2**20)[-1] == 256 * 2**20
    assert sweep_iters(4) >= sweep_iters(2**20) >= sweep_iters(64 * 2**20) >= 3
    assert level_members(["c1", "c2"]) == {"inter": [0, 1]}
    assert level_members(["g1", "g1", "g2", "g2"]) == {"intra": [0, 1], "inter": [0, 2]}
    assert level_members(["g1", "g1"]) == {"intra": [0, 1]}


def test_network_json_round_trips(tmp_path: Path) -> None:
    level = level_from_points(_points(30e-6, 2.0, 2), 2, 2, source="measured by doctor: 2 ranks on c1, c2")
    from cyclone_kit.rundir.network import NetworkFigures

    figures = NetworkFigures(levels={"inter": level}, cluster="local", partition="cpu", origin="doctor run x",
                             skipped={"intra": "one rank per node"})
    save_network(tmp_path / "network.json", figures)
    assert load_network(tmp_path) == figures  # a run directory works too
    doc = json.loads((tmp_path / "network.json").read_text())
    assert doc["kind"] == "network" and doc["levels"]["inter"]["busbw_gbps"] == pytest.approx(2.0)


@pytest.mark.parametrize(("doc", "message"), [
    ({"kind": "step"}, "is not a network.json"),
    ({"kind": "network", "schema": 9, "levels": {}}, "schema 9"),
    ({"kind": "network", "schema": 1, "levels": {}}, "holds no network level"),
    ({"kind": "network", "schema": 1, "levels": {"rack": {"alpha_s": 1, "busbw_gbps": 1}}}, "unknown level"),
    ({"kind": "network", "schema": 1, "levels": {"inter": {"alpha_s": 1, "busbw_gbps": -1}}}, "busbw_gbps"),
])
def test_bad_network_files_are_one_line(tmp_path: Path, doc: dict, message: str) -> None:
    path = tmp_path / "network.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValidationError, match=message):
        load_network(path)
    with pytest.raises(ValidationError, match="does not exist"):
        load_network(tmp_path / "missing.json")


def test_doctor_fits_the_real_sweep_into_figures_and_json() -> None:
    reports = tuple(json.loads(p.read_text()) for p in sorted(REPORTS.glob("rank-*.json")))
    prof = load_profile("local")
    job = resolve(JobSpec(name="ck-doctor", resources=Resources(profile="local", partition="cpu", nodes=2)), prof)
    result = SmokeResult("7", "COMPLETED", True, reports=reports, run_dir="/runs/x")
    figures = doctor.network_figures(job, result)
    inter = figures.level("inter")
    assert figures.level("intra") is None and "one rank per node" in figures.skipped["intra"]
    assert inter.ranks == 2 and inter.nodes == 2 and len(inter.points) == 25 and inter.busbw_gbps > 0
    assert (figures.cluster, figures.partition, figures.device, figures.backend) == ("local", "cpu", "cpu", "gloo")
    check = doctor.check_network_figures(job, result, figures)
    assert check.ok and "inter-node (2 ranks): latency" in check.detail and "intra-node: not measured" in check.detail
    row = json.loads(doctor.to_json([check]))[0]
    assert row["data"]["levels"]["inter"]["busbw_gbps"] == pytest.approx(inter.busbw_gbps)
    assert "data" not in doctor.Check("x", True, "y").to_dict()


def test_published_figures_come_from_the_profile() -> None:
    gpu = load_profile("cyclone").partition("gpu")
    assert gpu.network.published and gpu.network.backend == "nccl" and gpu.network.device_type == "V100"
    assert gpu.network.level("inter").busbw_gbps == 11.0 and "HDR100" in gpu.network.level("inter").source
    assert load_profile("cyclone").partition("cpu").network is None
