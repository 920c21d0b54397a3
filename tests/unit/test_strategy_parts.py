"""Pure parts of the pipeline and Horovod strategies: the stage split, the missing-Horovod error, horovodrun."""

from __future__ import annotations

import sys

import pytest
import torch

from cyclone_kit.errors import ValidationError
from cyclone_kit.runtime.hvd import horovodrun_command, import_horovod
from cyclone_kit.runtime.models import build_model
from cyclone_kit.runtime.pipeline import split_model, split_points


def test_split_points_balance_the_sums_and_keep_every_stage_non_empty() -> None:
    assert split_points([1, 1, 1, 1], 2) == [0, 2]
    assert split_points([10, 1, 1, 1], 2) == [0, 1]
    assert split_points([1, 1, 1, 10], 2) == [0, 3]
    assert split_points([1, 1, 1, 100], 4) == [0, 1, 2, 3]
    assert split_points([5], 1) == [0]
    with pytest.raises(ValidationError, match="cannot split 2 layers into 3"):
        split_points([1, 1], 3)


@pytest.mark.parametrize("name", ["tiny_cnn", "resnet18", "mobilenet_v3_small"])
def test_stages_chained_equal_the_model_and_cover_its_state_dict(name: str) -> None:
    torch.manual_seed(0)
    model = build_model(name, 10, 32, 3).eval()
    x = torch.randn(2, 3, 32, 32)
    for n in (2, 3):
        stages = split_model(model, n)
        assert len(stages) == n and all(s.layers for s in stages)
        out = x
        with torch.no_grad():
            for s in stages:
                out = s.module(out)
            expected = model(x)
        torch.testing.assert_close(out, expected)
        merged = {k: v for s in stages for k, v in s.state_dict().items()}
        assert set(merged) == set(model.state_dict())


def test_vit_cannot_be_split() -> None:
    with pytest.raises(ValidationError, match="cannot split a VisionTransformer"):
        split_model(build_model("vit_b_16", 10, 32, 3), 2)


def test_missing_horovod_is_a_one_line_error_naming_the_module_and_the_build_script(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "horovod.torch", None)  # import fails
    with pytest.raises(ValidationError) as info:
        import_horovod()
    err = info.value
    text = f"{err} {getattr(err, 'hint', '')}"
    assert "\n" not in str(err) and "horovod" in str(err).lower()
    assert "module load Horovod" in text and "scripts/build-horovod.sh" in text


def test_horovodrun_command_spreads_ranks_over_hosts() -> None:
    cmd = horovodrun_command("/runs/r1", 4, hosts=("n1", "n2"), python="py", interface=None)
    assert cmd == ["horovodrun", "--gloo", "-np", "4", "-H", "n1:2,n2:2",
                   "py", "-m", "cyclone_kit.runtime", "--run-dir", "/runs/r1"]
    assert horovodrun_command("d", 2, python="py")[5:8] == ["localhost:2", "--network-interfaces", "lo"]
    with pytest.raises(ValidationError):
        horovodrun_command("d", 3, hosts=("a", "b"))
