"""Models by name: torchvision architectures (random init, never downloaded) and a tiny CNN.

Every name in :data:`cyclone_kit.config.job.MODELS` builds here. ResNets get the small-image stem
(3x3 stride-1 first convolution, no max-pool) for inputs of 64 px or less, as is usual for
CIFAR-sized images; a first layer is rebuilt when the data has other than 3 channels.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from cyclone_kit.config.job import MODELS
from cyclone_kit.core.errors import ValidationError

#: Inputs at or below this size get the small-image stem on ResNets.
SMALL_IMAGE_PX = 64


class TinyCNN(nn.Module):
    """A three-layer CNN for tests (~26k parameters); GroupNorm keeps it batch-size independent.

    With no BatchNorm, N ranks with batch B compute exactly the gradient of one rank with
    batch N*B, which the DDP correctness test relies on.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 16, 3, padding=1),
            nn.GroupNorm(4, 16),
            nn.ReLU(inplace=True),
            nn.Conv2d(16, 32, 3, stride=2, padding=1),
            nn.GroupNorm(4, 32),
            nn.ReLU(inplace=True),
            nn.Conv2d(32, 64, 3, stride=2, padding=1),
            nn.GroupNorm(4, 64),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(2),
        )
        self.classifier = nn.Linear(64 * 4, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of shape (batch, num_classes)."""
        return self.classifier(torch.flatten(self.features(x), 1))


def build_model(name: str, num_classes: int, image_size: int, in_channels: int = 3) -> nn.Module:
    """Build model ``name`` with random weights for ``image_size`` px inputs.

    Raises:
        ValidationError: unknown name, or a size the architecture cannot take (ViT-B/16 needs
            a multiple of 16).
    """
    if name not in _BUILDERS:
        raise ValidationError(f"unknown model {name!r}", hint=f"use one of: {', '.join(MODELS)}")
    return _BUILDERS[name](num_classes, image_size, in_channels)


def _tiny(num_classes: int, image_size: int, in_channels: int) -> nn.Module:
    return TinyCNN(num_classes, in_channels)


def _resnet(arch: str) -> Callable[[int, int, int], nn.Module]:
    def build(num_classes: int, image_size: int, in_channels: int) -> nn.Module:
        import torchvision

        model = getattr(torchvision.models, arch)(weights=None, num_classes=num_classes)
        if image_size <= SMALL_IMAGE_PX:
            model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
            model.maxpool = nn.Identity()
        elif in_channels != 3:
            model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
        return model

    return build


def _mobilenet(arch: str) -> Callable[[int, int, int], nn.Module]:
    def build(num_classes: int, image_size: int, in_channels: int) -> nn.Module:
        import torchvision

        model = getattr(torchvision.models, arch)(weights=None, num_classes=num_classes)
        if in_channels != 3:
            first = model.features[0][0]
            model.features[0][0] = nn.Conv2d(in_channels, first.out_channels, 3, stride=2, padding=1, bias=False)
        return model

    return build


def _vit(num_classes: int, image_size: int, in_channels: int) -> nn.Module:
    import torchvision

    if image_size % 16:
        raise ValidationError(
            f"vit_b_16 needs an image size divisible by 16, got {image_size} px",
            hint="use train.image_size=32, 224, ... (synthetic or imagefolder data) or another model",
        )
    model = torchvision.models.vit_b_16(weights=None, num_classes=num_classes, image_size=image_size)
    if in_channels != 3:
        model.conv_proj = nn.Conv2d(in_channels, model.hidden_dim, kernel_size=16, stride=16)
    return model


_BUILDERS: dict[str, Callable[[int, int, int], nn.Module]] = {
    "tiny_cnn": _tiny,
    "resnet18": _resnet("resnet18"),
    "resnet34": _resnet("resnet34"),
    "resnet50": _resnet("resnet50"),
    "mobilenet_v3_small": _mobilenet("mobilenet_v3_small"),
    "mobilenet_v3_large": _mobilenet("mobilenet_v3_large"),
    "vit_b_16": _vit,
}
assert set(_BUILDERS) == set(MODELS), "every name in config.MODELS must have a builder"
