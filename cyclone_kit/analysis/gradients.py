"""Trainable parameters of the built-in models, without torch: what one step all-reduces.

Each model's count is its body (tabulated) plus the parts that depend on the job: the classifier
(``in_features x classes + classes``), the first layer (its input channels, and on ResNets the
small-image 3x3 stem at 64 px or less, as :mod:`cyclone_kit.runtime.engine.models` builds it) and ViT's
position embedding (one 768-wide row per 16 px patch, plus the class token).
``tests/unit/test_gradients.py`` checks every entry against the models torchvision builds.
"""

from __future__ import annotations

from dataclasses import dataclass

from cyclone_kit.core.errors import ValidationError

#: ResNet inputs at or below this size get the small-image stem (runtime/engine/models.py SMALL_IMAGE_PX).
SMALL_IMAGE_PX = 64


@dataclass(frozen=True)
class _Shape:
    body: int  # parameters outside the classifier and the stem
    head_in: int  # classifier input features
    stem_out: int  # first layer's output channels
    stem: str  # "resnet" (3x3 or 7x7), "conv3" (3x3; a bias, where there is one, is in the body), "vit" (16x16)


_SHAPES = {
    "tiny_cnn": _Shape(body=23376, head_in=256, stem_out=16, stem="conv3"),
    "resnet18": _Shape(body=11167104, head_in=512, stem_out=64, stem="resnet"),
    "resnet34": _Shape(body=21275264, head_in=512, stem_out=64, stem="resnet"),
    "resnet50": _Shape(body=23498624, head_in=2048, stem_out=64, stem="resnet"),
    "mobilenet_v3_small": _Shape(body=1517424, head_in=1024, stem_out=16, stem="conv3"),
    "mobilenet_v3_large": _Shape(body=4201600, head_in=1280, stem_out=16, stem="conv3"),
    "vit_b_16": _Shape(body=85057536, head_in=768, stem_out=768, stem="vit"),
}
#: The models whose gradient size is known here.
KNOWN_MODELS = tuple(_SHAPES)


def parameter_count(model: str, num_classes: int, image_size: int, in_channels: int = 3) -> int:
    """Trainable parameters of built-in ``model`` for the job's classes, image size and channels (pure).

    Raises:
        ValidationError: a model this table does not know.
    """
    shape = _SHAPES.get(model)
    if shape is None:
        raise ValidationError(f"unknown model {model!r}: its gradient size is not known",
                              hint=f"use one of: {', '.join(KNOWN_MODELS)}")
    if shape.stem == "resnet":
        k = 3 if image_size <= SMALL_IMAGE_PX else 7
        stem = shape.stem_out * in_channels * k * k
    elif shape.stem == "conv3":
        stem = shape.stem_out * in_channels * 9
    else:  # vit: a 16x16 patch projection, and the position embedding of (size/16)^2 patches + the class token
        stem = shape.stem_out * in_channels * 256 + ((image_size // 16) ** 2 + 1) * shape.stem_out
    return shape.body + stem + shape.head_in * num_classes + num_classes
