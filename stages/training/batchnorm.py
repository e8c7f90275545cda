"""BatchNorm statistics recomputed from training images, for a module (training) and for an
exported graph (QAT), and frozen in a graph.

Running averages with a small momentum need many steps to forget their initial values:
torchvision's MobileNetV3 uses 0.01, and after 210 steps (10 epochs of the digits) 12% of the
initial variance of 1 was left against true variances of 1e-4 to 0.04, so evaluation collapsed
to one class (9.72% validation accuracy) while training reached 99%. torchao's QAT graph gives
every BatchNorm a momentum of 0.1 (MNASNet's own is 0.0003), so there the running values are an
average of the last few batches: on mnasnet0_5 torch-qat ended 4.9 validation points below the
float model without the recompute, 1.4 with it. Both forms set them to the plain average over
(up to IMAGES of) unaugmented training images.
"""
from __future__ import annotations

from typing import Callable

from stages.data.loaders import make_loader, without_a_lone_image

# At most this many training images recompute the statistics, in a forward pass every score
# pays for: with 6,400 (100 batches) mobilenet_v2's epochs on photos10 took about 18.5 s, with
# 1,600 16 s, and efficientnet_b0's 26 and 23 s (Zen 4, --time 10m: 28 and 30 epochs, 19 and
# 20). The trained models' validation accuracy with 6,400, 3,200, 1,600 and 640 images was the
# same within noise.
IMAGES = 1_600
GRAPH_OPS = ("aten.batch_norm.default", "aten._native_batch_norm_legit.default",
             "aten.cudnn_batch_norm.default")


def _over_batches(forward: Callable, dataset, batch_size: int, device,
                  before: Callable[[int], None] = lambda i: None) -> None:
    """Up to IMAGES images, a seeded sample in shuffled order, the same every call. Not the
    first images: an image folder lists its classes in order, and batches of one class each
    gave BatchNorm the variance within a class, not across them; photos10's first 6,400 of 9,000
    training images were 7 of its classes whole, 100 images of an eighth and none of the rest."""
    import torch

    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0))
    whole_batches = max(1, IMAGES // batch_size) * batch_size  # each batch weighs the same
    count = without_a_lone_image(min(len(dataset), whole_batches), batch_size)
    sample = torch.utils.data.Subset(dataset, order[:count].tolist())
    with torch.no_grad():
        for i, (images, _) in enumerate(make_loader(sample, batch_size)):
            before(i)
            forward(images.to(device))


def recompute_module(model, dataset, batch_size: int, device) -> None:
    """A module's BatchNorm layers, in their cumulative-average mode (momentum None). Only they
    change mode: dropout stays off and draws no random numbers, so a resumed run stays
    bit-identical."""
    from torch import nn

    layers = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
              and m.track_running_stats]
    if not layers:
        return
    was_training = model.training
    model.eval()
    momenta = [layer.momentum for layer in layers]
    for layer in layers:
        layer.reset_running_stats()
        layer.momentum = None
        layer.train()
    _over_batches(model, dataset, batch_size, device)
    for layer, momentum in zip(layers, momenta):
        layer.momentum = momentum
    model.train(was_training)


def graph_nodes(graph) -> list:
    return [n for n in graph.graph.nodes if n.op == "call_function" and str(n.target) in GRAPH_OPS]


def set_graph_args(nodes, graph, recompile: bool = True, **values) -> None:
    # aten batch_norm and _native_batch_norm_legit: (input, weight, bias, running_mean,
    # running_var, training, momentum, eps, ...)
    where = {"training": 5, "momentum": 6}
    for node in nodes:
        args = list(node.args)
        for name, value in values.items():
            args[where[name]] = value
        node.args = tuple(args)
    if recompile:
        graph.recompile()


def freeze_graph(graph) -> None:
    """Let an exported graph's BatchNorm use its running statistics from now on, and stop
    updating them, while the rest of the graph goes on training."""
    set_graph_args(graph_nodes(graph), graph, training=False)


def recompute_graph(graph, dataset, batch_size: int, device) -> None:
    """An exported graph's BatchNorm nodes, as the model now is (fake quantization included):
    a momentum of 1/k at batch k makes the running value the plain average. The nodes' own
    arguments are restored afterwards."""
    nodes = graph_nodes(graph)
    if not nodes:
        return
    saved = [(n.args[5], n.args[6]) for n in nodes]
    _over_batches(graph, dataset, batch_size, device, before=lambda i: set_graph_args(
        nodes, graph, training=True, momentum=1.0 / (i + 1)))
    for node, (training, momentum) in zip(nodes, saved):
        set_graph_args([node], graph, recompile=False, training=training, momentum=momentum)
    graph.recompile()
