"""Sweep specs: parsing, expansion tables (strong/weak, points/world_sizes, repeats) and their errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tomllib

from cyclone_kit.config.job import spec_to_dict
from cyclone_kit.config.profile import load_profile
from cyclone_kit.config.sweep import SweepPoint, expand, load_sweep, merge_spec_dicts, sweep_from_dict, sweep_record
from cyclone_kit.core.errors import ValidationError
from cyclone_kit.submit.render import render_report_script as report_script
from tests.helpers.cli import REPO

LOCAL = load_profile("local")
CYCLONE = load_profile("cyclone")
BASE = {"name": "base", "train": {"model": "tiny_cnn", "batch_size": 8, "steps": 5},
        "resources": {"profile": "local", "partition": "cpu", "cpus_per_task": 1}}
P = [{"nodes": 1, "ntasks_per_node": 1}, {"nodes": 1, "ntasks_per_node": 2}, {"nodes": 2, "ntasks_per_node": 2}]


def sweep(**table: object) -> dict:
    """A sweep document with the inline BASE and [sweep] fields ``table``."""
    return {"sweep": {"name": "st", **table}, "base": BASE}


def table(runs) -> list[tuple]:
    return [(r.name, r.world_size, r.job.nodes, r.job.ntasks_per_node, r.per_device_batch_size, r.repeat) for r in runs]


# --------------------------------------------------------------------------- expansion tables
def test_strong_points_divide_the_global_batch() -> None:
    s = sweep_from_dict(sweep(mode="strong", global_batch_size=64, points=P))
    assert table(expand(s, LOCAL)) == [
        ("p0-ws1-n1x1", 1, 1, 1, 64, 1),
        ("p1-ws2-n1x2", 2, 1, 2, 32, 1),
        ("p2-ws4-n2x2", 4, 2, 2, 16, 1),
    ]


def test_weak_keeps_the_per_device_batch() -> None:
    s = sweep_from_dict(sweep(mode="weak", points=P))
    runs = expand(s, LOCAL)
    assert [r.per_device_batch_size for r in runs] == [8, 8, 8]
    assert [r.record()["global_batch_size"] for r in runs] == [8, 16, 32]


def test_repeats_multiply_runs_and_name_them() -> None:
    s = sweep_from_dict(sweep(mode="weak", points=P[:2], repeats=2))
    assert [(r.name, r.repeat) for r in expand(s, LOCAL)] == [
        ("p0-ws1-n1x1-r1", 1), ("p0-ws1-n1x1-r2", 2), ("p1-ws2-n1x2-r1", 1), ("p1-ws2-n1x2-r2", 2),
    ]


def test_points_are_sorted_baseline_first() -> None:
    s = sweep_from_dict(sweep(mode="weak", points=[P[2], P[0], P[1]]))
    assert [r.world_size for r in expand(s, LOCAL)] == [1, 2, 4]


def test_world_sizes_pack_gpu_nodes() -> None:
    base = {"name": "g", "train": {"batch_size": 32}, "resources": {"profile": "cyclone", "partition": "gpu"}}
    s = sweep_from_dict({"sweep": {"name": "g", "mode": "strong", "global_batch_size": 256,
                                   "world_sizes": [1, 2, 4, 8, 16, 32]}, "base": base})
    runs = expand(s, CYCLONE)
    assert [(r.job.nodes, r.job.ntasks_per_node, r.job.gpus_per_node, r.per_device_batch_size) for r in runs] == [
        (1, 1, 1, 256), (1, 2, 2, 128), (1, 4, 4, 64), (2, 4, 4, 32), (4, 4, 4, 16), (8, 4, 4, 8),
    ]
    assert all(r.job.cpus_per_task == 10 for r in runs)  # the profile's cores per GPU


def test_world_sizes_on_cpu_use_the_base_tasks_per_node() -> None:
    base = {**BASE, "resources": {**BASE["resources"], "ntasks_per_node": 2}}
    s = sweep_from_dict({"sweep": {"name": "c", "mode": "weak", "world_sizes": [1, 2, 4]}, "base": base})
    assert [(r.job.nodes, r.job.ntasks_per_node) for r in expand(s, LOCAL)] == [(1, 1), (1, 2), (2, 2)]


def test_world_size_that_does_not_fill_nodes_is_refused() -> None:
    base = {"name": "g", "resources": {"profile": "cyclone", "partition": "gpu"}}
    s = sweep_from_dict({"sweep": {"name": "g", "mode": "weak", "world_sizes": [6]}, "base": base})
    with pytest.raises(ValidationError, match="does not fill whole nodes of 4"):
        expand(s, CYCLONE)


def test_torchrun_points_ask_gpus_not_tasks() -> None:
    base = {"name": "t", "resources": {"profile": "cyclone", "partition": "gpu", "launcher": "torchrun"}}
    s = sweep_from_dict({"sweep": {"name": "t", "mode": "weak", "points": [{"nodes": 2, "ntasks_per_node": 4}]},
                         "base": base})
    (run,) = expand(s, CYCLONE)
    assert (run.job.ntasks_per_node, run.job.gpus_per_node, run.world_size) == (1, 4, 8)


def test_point_beyond_the_partition_names_the_point() -> None:
    s = sweep_from_dict(sweep(mode="weak", points=[{"nodes": 3, "ntasks_per_node": 1}]))
    with pytest.raises(ValidationError, match=r"sweep point ws3-n3x1: --nodes=3 but partition 'cpu'"):
        expand(s, LOCAL)


def test_grad_accum_counts_in_the_strong_division() -> None:
    base = {**BASE, "train": {**BASE["train"], "grad_accum": 2}}
    s = sweep_from_dict({"sweep": {"name": "a", "mode": "strong", "global_batch_size": 64, "points": P[:2]},
                         "base": base})
    assert [r.per_device_batch_size for r in expand(s, LOCAL)] == [32, 16]


# --------------------------------------------------------------------------- errors
@pytest.mark.parametrize(("doc", "message"), [
    (sweep(mode="strong", global_batch_size=62, points=P), r"global_batch_size=62 does not divide over world size 4"),
    (sweep(mode="strong", points=P), r"needs global_batch_size.*HINT: add global_batch_size = 8"),
    (sweep(mode="weak", global_batch_size=64, points=P), r"only for strong scaling"),
    (sweep(mode="fast", points=P), r"unknown sweep mode 'fast'"),
    (sweep(points=P), r"has no mode"),
    (sweep(mode="weak"), r"exactly one of points or world_sizes"),
    (sweep(mode="weak", points=P, world_sizes=[1]), r"exactly one of points or world_sizes"),
    (sweep(mode="weak", points=P, repeats=0), r"repeats must be a positive integer"),
    (sweep(mode="weak", points=P, report="yes"), r"report must be true or false"),
    (sweep(mode="weak", points=[{"nodes": 0, "ntasks_per_node": 1}]), r"nodes=0 must be a positive integer"),
    (sweep(mode="weak", points=[{"nodes": 1, "gpus": 2}]), r"unknown key\(s\) in sweep point 0: gpus"),
    (sweep(mode="weak", points=[P[0], P[0]]), r"repeat a layout"),
    (sweep(mode="weak", world_sizes=[1, 1]), r"repeat a value"),
    (sweep(mode="weak", world_sizes=[0]), r"world size 0 must be a positive integer"),
    (sweep(mode="weak", points=P, nmae="x", speed=1), r"unknown key\(s\) in \[sweep\]: nmae, speed"),
    ({"sweep": {"name": "x", "mode": "weak", "points": P}}, r"names no base job"),
    ({"sweep": {"name": "x", "mode": "weak", "points": P}, "base": BASE, "extra": {}},
     r"unknown sweep spec key\(s\): extra"),
    ({"sweep": {"name": "x", "mode": "weak", "points": P}, "base": {**BASE, "trian": {}}},
     r"unknown job spec key\(s\): trian"),
    (sweep(name="bad name", mode="weak", points=P), r"job name 'bad name' is not allowed"),
    (sweep(mode="weak", points="1,2"), r"points must be a list of tables"),
])
def test_bad_sweeps_are_refused_with_a_hint(doc: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message) as info:
        sweep_from_dict(doc)
    assert "HINT:" in str(info.value) and "\n" not in str(info.value)


def test_point_world_size_and_label() -> None:
    assert SweepPoint(2, 4).world_size == 8
    assert SweepPoint(2, 4).label == "ws8-n2x4"


# --------------------------------------------------------------------------- files
def test_base_file_relative_to_the_sweep_file_with_inline_overrides_and_set(tmp_path: Path) -> None:
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "b.toml").write_text(
        'name = "b"\n[train]\nmodel = "tiny_cnn"\nbatch_size = 4\nsteps = 7\n'
        '[resources]\nprofile = "local"\npartition = "cpu"\n'
    )
    path = tmp_path / "jobs" / "s.toml"
    path.write_text('[sweep]\nname = "s"\nmode = "weak"\nbase = "b.toml"\npoints = [{nodes = 1, ntasks_per_node = 2}]\n'
                    '[base.train]\nsteps = 9\n')
    s = load_sweep(path, ["train.lr=0.5"], [("resources.time", "00:05:00")])
    assert (s.base.name, s.base.train.batch_size, s.base.train.steps, s.base.train.lr) == ("b", 4, 9, 0.5)
    assert s.base.resources.time == "00:05:00"


def test_missing_base_file_is_a_validation_error(tmp_path: Path) -> None:
    path = tmp_path / "s.toml"
    path.write_text('[sweep]\nname = "s"\nmode = "weak"\nbase = "nope.toml"\nworld_sizes = [1]\n')
    with pytest.raises(ValidationError, match="does not exist"):
        load_sweep(path)


@pytest.mark.parametrize("name", ["strong_scaling.toml", "weak_scaling.toml", "cyclone_strong_resnet50.toml"])
def test_shipped_sweeps_expand(name: str) -> None:
    s = load_sweep(REPO / "jobs" / name, flags=[("resources.account", "p163")])
    runs = expand(s, load_profile(s.base.resources.profile))
    assert runs[0].world_size == 1
    if s.mode == "strong":
        assert {r.record()["global_batch_size"] for r in runs} == {s.global_batch_size}


def test_local_studies_fit_the_local_cluster() -> None:
    for name in ("strong_scaling.toml", "weak_scaling.toml"):
        runs = expand(load_sweep(REPO / "jobs" / name), LOCAL)
        assert [(r.job.nodes, r.job.ntasks_per_node, r.job.partition.name) for r in runs] == [
            (1, 1, "cpu"), (1, 2, "cpu"), (2, 2, "cpu")]


def test_merge_spec_dicts_merges_sections() -> None:
    assert merge_spec_dicts({"train": {"a": 1, "b": 2}, "name": "x"}, {"train": {"b": 3}, "name": "y"}) == {
        "train": {"a": 1, "b": 3}, "name": "y"}


# --------------------------------------------------------------------------- records and scripts
def test_sweep_record_is_the_analysis_contract() -> None:
    s = sweep_from_dict(sweep(mode="strong", global_batch_size=64, points=P[:2], repeats=2))
    runs = expand(s, LOCAL)
    doc = json.loads(json.dumps(sweep_record(s, runs, LOCAL, "local")))
    assert (doc["schema"], doc["kind"], doc["study"], doc["mode"]) == (1, "sweep", "st", "strong")
    assert doc["base_spec"] == spec_to_dict(s.base)
    assert doc["points"][2] == {"name": "p1-ws2-n1x2-r1", "world_size": 2, "nodes": 1, "ntasks_per_node": 2,
                                "per_device_batch_size": 32, "global_batch_size": 64, "repeat": 1,
                                "run_dir": "p1-ws2-n1x2-r1"}


def test_report_script_depends_on_every_point_and_quotes_paths() -> None:
    s = sweep_from_dict(sweep(mode="weak", points=P[:1]))
    job = expand(s, LOCAL)[0].job
    text = report_script("/tmp/my study", job, ["11", "12"], python="/opt/py thon")
    assert "#SBATCH --dependency=afterany:11:12\n" in text
    assert "#SBATCH --partition=cpu\n" in text
    assert "'/opt/py thon' -m cyclone_kit report '/tmp/my study' -o '/tmp/my study/report'\n" in text
    assert '#SBATCH --output="/tmp/my study/logs/report-%j.out"' in text


def test_report_script_refuses_non_ids() -> None:
    job = expand(sweep_from_dict(sweep(mode="weak", points=P[:1])), LOCAL)[0].job
    with pytest.raises(ValidationError, match="not a Slurm job id"):
        report_script("/tmp/s", job, ["12; rm -rf /"])


def test_shipped_sweep_files_are_valid_toml() -> None:
    for name in ("strong_scaling.toml", "weak_scaling.toml", "cyclone_strong_resnet50.toml"):
        assert "sweep" in tomllib.loads((REPO / "jobs" / name).read_text())


def test_dependencies_are_sbatch_arguments_not_script_text() -> None:
    """Issue 13: a dependency is ``sbatch --dependency=afterany:ID:ID``, never spliced into a rendered script."""
    from cyclone_kit.slurm import argv as slurm_argv

    assert slurm_argv.dependency(["41", "42_3"]) == "afterany:41:42_3"
    assert slurm_argv.sbatch("/r/job.sbatch", [f"--dependency={slurm_argv.dependency(['41'])}"]) == [
        "sbatch", "--parsable", "--dependency=afterany:41", "/r/job.sbatch"]
    with pytest.raises(ValidationError):
        slurm_argv.dependency(["1 && rm -rf /"])


def test_serial_flag_is_parsed_and_recorded() -> None:
    s = sweep_from_dict(sweep(mode="weak", points=P[:1], serial=True))
    assert s.serial and sweep_record(s, expand(s, LOCAL), LOCAL, "slurm")["serial"] is True
    with pytest.raises(ValidationError, match="serial must be true or false"):
        sweep_from_dict(sweep(mode="weak", points=P[:1], serial="no"))
