"""The torch-free gradient-size table (cyclone_kit.analysis.gradients) against the models torchvision builds."""

from __future__ import annotations

import pytest
import torch

from cyclone_kit.analysis.gradients import KNOWN_MODELS, parameter_count
from cyclone_kit.config.job import MODELS
from cyclone_kit.core.errors import ValidationError
from cyclone_kit.runtime.engine.models import build_model

#: (classes, image size, channels): ImageNet-sized (7x7 stem) and small one-channel (3x3 stem) inputs.
SHAPES = [(1000, 224, 3), (10, 28, 1)]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize(("classes", "size", "channels"), SHAPES)
def test_table_matches_the_built_model(model: str, classes: int, size: int, channels: int) -> None:
    if model == "vit_b_16" and size % 16:
        size = 32
    with torch.device("meta"):  # shapes only: no memory, no initialisation time
        built = build_model(model, classes, size, channels)
    expected = sum(p.numel() for p in built.parameters() if p.requires_grad)
    assert parameter_count(model, classes, size, channels) == expected


def test_every_built_in_model_is_tabulated() -> None:
    assert set(KNOWN_MODELS) == set(MODELS)


def test_an_unknown_model_is_one_line_with_the_known_ones() -> None:
    with pytest.raises(ValidationError, match="unknown model 'resnet152'") as err:
        parameter_count("resnet152", 10, 32)
    assert "resnet50" in err.value.hint
