"""Profiles and job specs: loading, typing, unknown keys and the --set parser."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cyclone_kit.config.job import MODELS, JobSpec, apply_overrides, load_spec, spec_from_dict, spec_to_dict
from cyclone_kit.config.profile import load_profile, profile_names
from cyclone_kit.config.toolbox import parse_assignment
from cyclone_kit.core.errors import ValidationError
from tests.helpers.cli import REPO


def test_builtin_profiles():
    assert {"cyclone", "local", "generic"} <= set(profile_names())
    cy = load_profile("cyclone")
    gpu = cy.partition("gpu")
    assert (gpu.nodes, gpu.gpus_per_node, gpu.cpus_per_node, gpu.memory_gb, gpu.gpu_type) == (16, 4, 40, 192, "V100")
    assert cy.partition("cpu").nodes == 17 and cy.default_partition.name == "cpu"
    assert gpu.max_time_s == 24 * 3600 and cy.cpus_per_gpu == 10 and cy.account_required
    local = load_profile("local")
    assert [p.name for p in local.partitions] == ["cpu", "gpu", "wide"]  # wide: every node (spare-node tests)
    assert local.partition("gpu").nodelist == "g[1-2]" and local.partition("gpu").gpus_per_node == 4


def test_user_profile_dir(tmp_path, monkeypatch):
    d = tmp_path / "cyclone_kit" / "profiles"
    d.mkdir(parents=True)
    (d / "mine.toml").write_text('[partitions.a]\nnodes = 3\ncpus_per_node = 8\ndefault = true\n')
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert "mine" in profile_names()
    assert load_profile("mine").partition("a").nodes == 3
    assert load_profile(str(d / "mine.toml")).name == "mine"


def test_shipped_specs_load():
    for path in sorted((REPO / "jobs").glob("*.toml")):
        text = path.read_text()
        if "[sweep]" in text:
            continue
        spec = load_spec(path)
        assert spec.train.model in MODELS


def test_spec_round_trip():
    spec = spec_from_dict({"name": "x", "train": {"lr": 0.5, "steps": 3}, "resources": {"nodes": 2}})
    again = spec_from_dict(json.loads(json.dumps(spec_to_dict(spec))))
    assert again == spec and isinstance(again, JobSpec)


def test_int_accepted_for_float_but_not_bool_for_int():
    assert spec_from_dict({"train": {"lr": 1}}).train.lr == 1.0
    with pytest.raises(ValidationError, match=r"resources\.nodes must be int"):
        spec_from_dict({"resources": {"nodes": True}})


def test_unknown_keys_list_valid_ones():
    with pytest.raises(ValidationError) as e:
        spec_from_dict({"train": {"lrr": 0.1}})
    assert "lrr" in str(e.value) and "valid keys:" in str(e.value) and "lr," in str(e.value)


@pytest.mark.parametrize(
    ("item", "key", "value"),
    [
        ("train.lr=0.2", "train.lr", 0.2),
        ("nodes=4", "nodes", 4),
        ("compile=true", "compile", True),
        ("name=abc", "name", "abc"),
        ('name="a b"', "name", "a b"),
        ("resources.extra_sbatch=['--qos=x']", "resources.extra_sbatch", ["--qos=x"]),
        ("time=01:00:00", "time", "01:00:00"),
        ("x==y", "x", "=y"),
    ],
)
def test_parse_assignment(item, key, value):
    assert parse_assignment(item) == (key, value)


@pytest.mark.parametrize("item", ["novalue", "=3", ""])
def test_parse_assignment_refuses(item):
    with pytest.raises(ValidationError, match="HINT"):
        parse_assignment(item)


def test_overrides_bare_and_dotted():
    data = apply_overrides({"train": {"lr": 0.1}}, ["lr=0.3", "resources.nodes=2", "signal=USR1"])
    spec = spec_from_dict(data)
    assert (spec.train.lr, spec.resources.nodes, spec.checkpoint.signal) == (0.3, 2, "USR1")
    with pytest.raises(ValidationError, match="unknown spec key"):
        apply_overrides({}, ["train.nope=1"])


@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40))
def test_set_value_never_crashes_and_strings_survive(value):
    """Any text after '=' parses: either as a TOML literal or kept verbatim as a string (empty: refused)."""
    if value.strip() in ("", '""', "''"):
        with pytest.raises(ValidationError, match="empty value"):
            parse_assignment(f"train.data_dir={value}")
        return
    key, parsed = parse_assignment(f"train.data_dir={value}")
    assert key == "train.data_dir"
    if isinstance(parsed, str) and not value.strip().startswith(('"', "'")):
        assert parsed == value


@given(st.integers(min_value=1, max_value=10**6))
def test_set_int_round_trip(n):
    assert spec_from_dict(apply_overrides({}, [f"resources.nodes={n}"])).resources.nodes == n


def test_profile_binding_values_are_checked_and_rendered_as_srun_options() -> None:
    """Issue 16 item 13: binding lives in the profile; a value srun would not take is refused."""
    import dataclasses

    from cyclone_kit.config.profile import load_profile

    cyclone = load_profile("cyclone")
    assert cyclone.srun_binding == ("--cpu-bind=cores", "--distribution=block:block", "--gpu-bind=none")
    assert load_profile("local").srun_binding == ()
    with pytest.raises(ValidationError, match="gpu_bind 'none; rm -rf ~' is not a Slurm binding value"):
        dataclasses.replace(cyclone, gpu_bind="none; rm -rf ~")
