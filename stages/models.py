"""Models by name: small built-ins and every torchvision classification model, adapted to the data."""
from __future__ import annotations

from typing import Callable

from stages.registry import register

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


def torchvision_models() -> list[str]:
    import torchvision

    return sorted(torchvision.models.list_models(module=torchvision.models))


def known_models() -> list[str]:
    return sorted(BUILTIN_MODELS) + torchvision_models()


def _adapt_input_channels(model, in_channels: int) -> None:
    """Swap the first convolution for one with ``in_channels`` inputs (grey digits: 1)."""
    from torch import nn

    for name, module in model.named_modules():
        if isinstance(module, nn.Conv2d):
            if module.in_channels == in_channels:
                return
            replacement = nn.Conv2d(in_channels, module.out_channels, module.kernel_size,
                                    module.stride, module.padding, module.dilation,
                                    1,
                                    module.bias is not None, module.padding_mode)
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, attr, replacement)
            return
    raise ValueError(f"{type(model).__name__} has no Conv2d whose input channels can be adapted")


def build_model(name: str, num_classes: int, in_channels: int):
    """A freshly initialised model; the same arguments always build the same architecture."""
    if name in BUILTIN_MODELS:
        return BUILTIN_MODELS[name](num_classes=num_classes, in_channels=in_channels)
    import torchvision

    known = torchvision_models()
    if name not in known:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(known_models())}")
    model = torchvision.models.get_model(name, weights=None, num_classes=num_classes)
    _adapt_input_channels(model, in_channels)
    return model


def model_spec(name: str, num_classes: int, in_channels: int, image_size: int) -> dict:
    """What rebuilds a model from its state_dict; stored with every checkpoint and artifact."""
    return {"model": name, "num_classes": num_classes, "in_channels": in_channels,
            "image_size": image_size}


def build_from_spec(spec: dict):
    return build_model(spec["model"], spec["num_classes"], spec["in_channels"])
