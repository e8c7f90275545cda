"""A Linear-heavy model for the dynamic int8 tests (`--model tests.stages.quantization.linear_heavy:
mixer`): the built-in mixer cut to one block, six Linear layers in all, so that it trains,
exports and compiles in a few seconds."""
from stages.models.builtin import _mixer_classes


def mixer(num_classes: int, in_channels: int, image_size: int):
    return _mixer_classes()(num_classes, in_channels, dim=128, depth=1)
