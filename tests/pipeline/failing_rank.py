"""A model whose rank 1 raises in its third training forward pass under torchrun: every rank
must then exit non-zero, promptly (`--model tests.pipeline.failing_rank:net`, from the
project's root; benchmarks/gpu_checks.py uses it on GPUs too)."""
import os

import torch.nn as nn


class Net(nn.Module):
    def __init__(self, num_classes, in_channels):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(in_channels, 8, 3), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.training and os.environ.get("RANK") == "1" and self.calls == 3:
            raise RuntimeError("rank 1 fails on purpose")
        return self.body(x)


def net(num_classes, in_channels):
    return Net(num_classes, in_channels)
