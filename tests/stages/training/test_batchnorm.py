"""BatchNorm statistics recomputed from training images, for a module and for an exported graph,
and frozen in a graph (stages/training/batchnorm.py). A one-convolution model on 8x8 images
whose outputs are far from BatchNorm's initial mean 0 and variance 1."""
import copy

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from stages.training import batchnorm

CPU = torch.device("cpu")
BATCH = 32


def _images(count: int = 8 * BATCH) -> TensorDataset:
    """Images whose mean climbs batch by batch, so that which batches were averaged shows."""
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(count, 1, 8, 8, generator=generator) * 3
    images += torch.arange(count).div(BATCH, rounding_mode="floor").view(-1, 1, 1, 1)
    return TensorDataset(images, torch.zeros(count, dtype=torch.long))


def _model(momentum: float = 0.01, dropout: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4, momentum=momentum), nn.ReLU(),
                         nn.Dropout(0.5) if dropout else nn.Identity(), nn.Flatten(),
                         nn.Linear(4 * 6 * 6, 10))


def _whole(conv, dataset, count: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per channel, the mean and variance of ``conv``'s output over the first ``count`` images
    (all of them by default)."""
    with torch.no_grad():
        outputs = conv(dataset.tensors[0][:count])
    return outputs.mean(dim=(0, 2, 3)), outputs.var(dim=(0, 2, 3))


def _assert_over_every_image(running, conv, dataset) -> None:
    """A plain average over batches that mix the images: the mean of the batches' means is the
    whole set's mean (equal batches), and their variances, each across the set's range, make
    its variance. Batches taken in order would hold one step of the climbing mean each, and
    their variances would leave the steps out (a class-sorted image folder's classes)."""
    mean, var = _whole(conv, dataset)
    torch.testing.assert_close(running[0], mean, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(running[1], var, rtol=0.1, atol=0)


def _running(module_or_graph) -> tuple[torch.Tensor, torch.Tensor]:
    state = module_or_graph.state_dict()
    (mean,) = [v for k, v in state.items() if k.endswith("running_mean")]
    (var,) = [v for k, v in state.items() if k.endswith("running_var")]
    return mean.clone(), var.clone()


def _exported(model) -> torch.fx.GraphModule:
    """The model exported in training mode, with a batch axis of any size (as QAT's is)."""
    example = (torch.zeros(4, 1, 8, 8),)
    return torch.export.export(model.train(), example, strict=True, dynamic_shapes=(
        {0: torch.export.Dim("batch", min=1)},)).module()


@pytest.mark.parametrize("training", [True, False])
def test_a_module_s_statistics_become_the_plain_average_and_nothing_else_changes(training):
    model = _model().train(training)
    weights = copy.deepcopy({k: v for k, v in model.state_dict().items() if "running" not in k
                             and "num_batches" not in k})
    rng = torch.get_rng_state()
    batchnorm.recompute_module(model, _images(), BATCH, CPU)
    _assert_over_every_image(_running(model), model[0], _images())
    assert torch.equal(rng, torch.get_rng_state())  # dropout stayed off: no random numbers drawn
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in weights.items())
    assert model[1].momentum == 0.01  # its own momentum back for training
    assert [m.training for m in model.modules()] == [training] * len(list(model.modules()))


def test_at_most_images_whole_batches_are_averaged_drawn_from_the_whole_set(monkeypatch):
    model = _model()
    seen = []
    model.register_forward_hook(lambda module, inputs, output: seen.append(inputs[0]))
    monkeypatch.setattr(batchnorm, "IMAGES", 2 * BATCH + BATCH // 2)
    batchnorm.recompute_module(model, _images(), BATCH, CPU)
    assert [len(images) for images in seen] == [BATCH, BATCH]
    every_mean, first_two_mean = _whole(model[0], _images())[0], _whole(model[0], _images(), 64)[0]
    assert (every_mean - first_two_mean).abs().min() > 0.1  # the first two batches lie apart
    # The two batches are a sample of every step of the climbing mean, not its first two.
    steps = {int(offset) for images in seen for offset in images.mean(dim=(1, 2, 3)).round()}
    assert len(steps) >= 6
    assert ((_running(model)[0] - every_mean).abs() < (_running(model)[0] - first_two_mean).abs()
            ).all()
    again = _model()
    batchnorm.recompute_module(again, _images(), BATCH, CPU)  # the same sample every call
    torch.testing.assert_close(_running(again), _running(model), rtol=0, atol=0)


def test_a_model_without_running_statistics_is_not_run():
    calls = []
    untracked = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4, track_running_stats=False))
    for model in (nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU()), untracked):
        model.register_forward_hook(lambda *args: calls.append(args))
        batchnorm.recompute_module(model, _images(), BATCH, CPU)
    assert calls == []
    assert untracked[1].running_mean is None


def test_a_frozen_graph_normalizes_with_its_running_statistics_and_keeps_them():
    model = _model(momentum=0.1, dropout=False)
    batchnorm.recompute_module(model, _images(), BATCH, CPU)
    graph = _exported(copy.deepcopy(model))
    (node,) = batchnorm.graph_nodes(graph)
    assert str(node.target) in batchnorm.GRAPH_OPS and node.args[5] is True
    before = _running(graph)
    batchnorm.freeze_graph(graph)
    assert node.args[5] is False and "True, 0.1," not in graph.code
    images = _images().tensors[0][:BATCH] + 5  # another mean: an update would move the stats
    with torch.no_grad():
        torch.testing.assert_close(graph(images), model.eval()(images), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(_running(graph), before, rtol=0, atol=0)


def test_a_graph_s_statistics_become_the_plain_average_and_its_arguments_are_restored():
    model = _model(momentum=0.1, dropout=False)
    graph = _exported(copy.deepcopy(model))
    batchnorm.recompute_graph(graph, _images(), BATCH, CPU)
    _assert_over_every_image(_running(graph), model[0], _images())
    (node,) = batchnorm.graph_nodes(graph)
    assert node.args[5] is True and node.args[6] == 0.1
    assert "True, 0.1," in graph.code  # and in the code the graph runs
