"""Training runs channels_last on the CPU wherever the model's forward takes it, and a model
whose forward needs NCHW strides trains as it is."""
import torch
from torch import nn

from pipeline.config import TrainConfig
from stages import train
from stages.run import artifacts, loading
from tests.conftest import TINY_TRAIN


class FlattensByView(nn.Module):
    """A user's model as older code writes it: ``view`` over a 4x4 feature map, which raises
    on channels_last strides."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, 8, 3, stride=2, padding=1)
        self.fc = nn.Linear(8 * 4 * 4, num_classes)

    def forward(self, x):
        x = torch.relu(self.conv(x))
        return self.fc(x.view(x.size(0), -1))


def flattens_by_view(num_classes: int, in_channels: int) -> nn.Module:
    return FlattensByView(num_classes, in_channels)


def _trained(tmp_path, **config):
    run = artifacts.create_run(tmp_path, "layout")
    results = train.run(TrainConfig(**TINY_TRAIN | {"epochs": 1, "baseline": False} | config),
                        run)
    state = loading.load_checkpoint(run.verified_path("amp"))["state_dict"]
    return results[0], run, state


def test_convolutions_train_channels_last_and_the_file_holds_plain_tensors(tmp_path):
    result, run, state = _trained(tmp_path)
    assert result.memory_format == "channels_last"
    assert run.entry("amp")["training"]["memory_format"] == "channels_last"
    convs = [t for t in state.values() if t.dim() == 4]
    assert convs and all(t.is_contiguous() for t in state.values())
    checkpoint = loading.load_checkpoint(run.verified_path("amp/checkpoint-last"))["model"]
    assert all(t.is_contiguous() for t in checkpoint.values())  # design.md: either way


def test_a_model_whose_forward_needs_nchw_trains_as_it_is(tmp_path):
    result, _, state = _trained(
        tmp_path, model="tests.stages.training.test_layout:flattens_by_view")
    assert result.memory_format == "NCHW" and result.test_accuracy > 0.3
    assert state["conv.weight"].is_contiguous()
