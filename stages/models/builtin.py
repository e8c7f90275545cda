"""The built-in models: small, quick to train, and each chosen to show one thing."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from stages.run.registry import register

if TYPE_CHECKING:  # annotations only: torch is imported where it is used
    import torch

BUILTIN_MODELS: dict[str, Callable[..., "torch.nn.Module"]] = {}


def register_model(name: str):
    return register(BUILTIN_MODELS, name)


@register_model("smallcnn")
def smallcnn(num_classes: int, in_channels: int):
    """A three-conv net that trains on the digits in seconds: the model the tests use."""
    from torch import nn

    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

    return nn.Sequential(
        *block(in_channels, 16), *block(16, 32), nn.MaxPool2d(2), *block(32, 64),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes),
    )


def _mixer_classes():
    from torch import nn

    class MixerBlock(nn.Module):
        """Token mixing across the 64 patches, then channel mixing: all Linear layers."""

        def __init__(self, tokens: int, dim: int, token_hidden: int, channel_hidden: int):
            super().__init__()
            self.norm1 = nn.LayerNorm(dim)
            self.token_mlp = nn.Sequential(nn.Linear(tokens, token_hidden), nn.GELU(),
                                           nn.Linear(token_hidden, tokens))
            self.norm2 = nn.LayerNorm(dim)
            self.channel_mlp = nn.Sequential(nn.Linear(dim, channel_hidden), nn.GELU(),
                                             nn.Linear(channel_hidden, dim))

        def forward(self, x):  # (batch, tokens, dim)
            x = x + self.token_mlp(self.norm1(x).transpose(1, 2)).transpose(1, 2)
            return x + self.channel_mlp(self.norm2(x))

    class Mixer(nn.Module):
        """A small MLP-Mixer: any input is pooled to 32x32 and cut into 64 patches of 4x4."""

        def __init__(self, num_classes: int, in_channels: int, dim: int = 128, depth: int = 4):
            super().__init__()
            self.pool = nn.AdaptiveAvgPool2d(32)
            self.patches = nn.Unfold(kernel_size=4, stride=4)
            self.embed = nn.Linear(in_channels * 16, dim)
            self.blocks = nn.Sequential(*[MixerBlock(64, dim, 2 * dim, 4 * dim)
                                          for _ in range(depth)])
            self.norm = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, num_classes)

        def forward(self, x):
            x = self.embed(self.patches(self.pool(x)).transpose(1, 2))
            return self.head(self.norm(self.blocks(x)).mean(dim=1))

    return Mixer


@register_model("mixer")
def mixer(num_classes: int, in_channels: int):
    """A Linear-heavy model (MLP-Mixer) on which dynamic int8 pays, unlike on a conv net."""
    return _mixer_classes()(num_classes, in_channels)
