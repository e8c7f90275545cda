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


def _plain_average(conv, dataset, batches: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per channel, the average over the first ``batches`` batches of each batch's mean and
    unbiased variance of ``conv``'s output: what a cumulative average holds after them."""
    images = dataset.tensors[0][:batches * BATCH]
    with torch.no_grad():
        outputs = conv(images).split(BATCH)
    return (torch.stack([o.mean(dim=(0, 2, 3)) for o in outputs]).mean(0),
            torch.stack([o.var(dim=(0, 2, 3)) for o in outputs]).mean(0))


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
    mean, var = _plain_average(model[0], _images(), batches=8)
    torch.testing.assert_close(_running(model), (mean, var), rtol=1e-4, atol=1e-5)
    assert torch.equal(rng, torch.get_rng_state())  # dropout stayed off: no random numbers drawn
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in weights.items())
    assert model[1].momentum == 0.01  # its own momentum back for training
    assert [m.training for m in model.modules()] == [training] * len(list(model.modules()))


def test_at_most_batches_batches_are_averaged(monkeypatch):
    model = _model()
    monkeypatch.setattr(batchnorm, "BATCHES", 2)
    batchnorm.recompute_module(model, _images(), BATCH, CPU)
    first_two = _plain_average(model[0], _images(), batches=2)
    torch.testing.assert_close(_running(model), first_two, rtol=1e-4, atol=1e-5)
    every = _plain_average(model[0], _images(), batches=8)
    assert (every[0] - first_two[0]).abs().min() > 0.1  # the cap, not the data, made it so


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
    torch.testing.assert_close(_running(graph), _plain_average(model[0], _images(), batches=8),
                               rtol=1e-4, atol=1e-5)
    (node,) = batchnorm.graph_nodes(graph)
    assert node.args[5] is True and node.args[6] == 0.1
    assert "True, 0.1," in graph.code  # and in the code the graph runs
