import pytest
import torch
import torchvision
from torch import nn

from stages.quantization.equalization import equalize


def _chain() -> nn.Module:
    """conv-BN-ReLU-depthwise-BN-ReLU-conv-BN-ReLU6-conv: two scale-free pairs, one ReLU6 pair,
    and a first layer whose channels are 1 to 200 times as wide as each other."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 4, 1), nn.BatchNorm2d(4), nn.ReLU6(),
        nn.Conv2d(4, 4, 1), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
    with torch.no_grad():
        model[0].weight.mul_(torch.logspace(0, 2.3, 8).view(-1, 1, 1, 1))
        for bn in (model[1], model[4], model[7]):
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
            bn.weight.uniform_(0.5, 1.5)
    return model.eval()


def _worst_channel_int8_error(weight) -> float:
    """Relative error of the channel per-tensor int8 serves worst (the narrowest)."""
    weight = weight.detach()
    scale = weight.abs().max() / 127
    error = ((weight / scale).round().clamp(-127, 127) * scale - weight).pow(2).flatten(1)
    return float((error.mean(1) / weight.pow(2).flatten(1).mean(1)).max())


def test_equalization_keeps_the_float_outputs_and_evens_the_channels():
    model, images = _chain(), torch.randn(16, 3, 6, 6)
    equalized, record = equalize(model, check_images=images)
    with torch.no_grad():
        expected = model(images)
        assert torch.allclose(equalized(images), expected, atol=1e-4 * expected.abs().max())
    assert record["max_abs_logit_change"] < 1e-4 * float(expected.abs().max())
    assert (record["applied"], record["batchnorms_folded"], record["pairs"],
            record["pairs_left_alone"]) == (True, 3, 2, 1)
    assert "ReLU6" in record["why"]
    ranges = [m[0].weight.detach().abs().flatten(1).amax(1) for m in (model, equalized)]
    assert float(ranges[0].max() / ranges[0].min()) > 100
    assert float(ranges[1].max() / ranges[1].min()) < 10  # the point: one scale fits them all
    assert (_worst_channel_int8_error(equalized[0].weight)
            < _worst_channel_int8_error(model[0].weight) / 10)
    assert model[1].__class__ is nn.BatchNorm2d  # the original is left as it was


def test_resnet18_equalizes_the_pair_inside_each_basic_block():
    model = torchvision.models.resnet18(num_classes=10).eval()
    images = torch.randn(2, 3, 32, 32)
    equalized, record = equalize(model, check_images=images)
    assert (record["pairs"], record["batchnorms_folded"]) == (8, 20)
    with torch.no_grad():
        expected = model(images)
    assert record["max_abs_logit_change"] < 1e-4 * float(expected.abs().max())


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: torch.fx cannot trace it
            return self.conv(x)
        return -self.conv(x)


@pytest.mark.parametrize("model, why", [
    (_Branchy(), "the model cannot be traced by torch.fx"),
    (nn.Sequential(nn.Conv2d(3, 4, 1), nn.MaxPool2d(2), nn.Conv2d(4, 4, 1)),
     "no convolution feeds another through a scale-free activation"),
])
def test_what_cannot_be_equalized_is_left_as_it_was_and_says_why(model, why):
    images = torch.randn(2, 3, 4, 4)
    equalized, record = equalize(model)
    assert not record["applied"] and record["why"].startswith(why)
    with torch.no_grad():
        assert torch.equal(equalized(images), model(images))


class _SharedNorm(nn.Module):
    """One BatchNorm read after two convolutions: folding it into one would change the other."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 4, 1), nn.Conv2d(4, 4, 1)
        self.norm = nn.BatchNorm2d(4)

    def forward(self, x):
        return self.norm(self.conv2(torch.relu(self.norm(self.conv1(x)))))


def _with_statistics(model: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    for bn in (m for m in model.modules() if isinstance(m, nn.BatchNorm2d)):
        if bn.running_mean is not None:
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
    return model.eval()


@pytest.mark.parametrize("model", [
    _SharedNorm(),
    nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4, track_running_stats=False), nn.ReLU(),
                  nn.Conv2d(4, 4, 1)),
], ids=["a BatchNorm called twice", "a BatchNorm without running statistics"])
def test_a_batchnorm_that_cannot_be_folded_is_left_and_the_float_model_kept(model):
    """A shared BatchNorm was folded into one convolution and made an Identity for both;
    one without running statistics failed the stage in torch's fusion (an AssertionError)."""
    model, images = _with_statistics(model), torch.randn(4, 3, 5, 5)
    equalized, record = equalize(model, check_images=images)
    assert record["batchnorms_folded"] == 0
    with torch.no_grad():
        expected = model(images)
        assert torch.allclose(equalized(images), expected, atol=1e-4 * expected.abs().max())


def test_a_transform_that_changed_the_logits_is_not_applied(monkeypatch):
    """What the graph analysis misreads shows in the logits: past rounding, the model is
    left as it was and the record says by how much it would have changed."""
    from stages.quantization import equalization

    def misfolds(first, second):
        first.weight.mul_(3)
        return 0.0

    monkeypatch.setattr(equalization, "_equalize_pair", misfolds)
    model, images = _chain(), torch.randn(8, 3, 6, 6)
    equalized, record = equalize(model, check_images=images)
    assert not record["applied"] and record["why"].startswith(
        "not applied: it changed the float model's logits by up to ")
    with torch.no_grad():
        assert torch.equal(equalized(images), model(images))
