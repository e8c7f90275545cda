"""A model with big weights and cheap steps, for tests that need large checkpoints written
often (`--model tests.reliability.big_weights:wide`): about 47 MB of weights, 94 MB a
checkpoint with SGD's momentum, and a training step of a few milliseconds on 8x8 images."""
from torch import nn


def wide(num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size ** 2, 3400), nn.ReLU(),
                         nn.Linear(3400, 3400), nn.ReLU(), nn.Linear(3400, num_classes))
