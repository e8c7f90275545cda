"""torch-static keeps depthwise convolutions in float where the CPU has no VNNI (oneDNN's int8
depthwise kernel is slower there than its float one); QAT quantizes them."""
import pytest
import torch
from torch import nn

from stages.runtimes import pt2e


def _inverted_residual():
    """A MobileNetV2 block: pointwise expansion, depthwise 3x3, pointwise projection."""
    return nn.Sequential(
        nn.Conv2d(4, 16, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU6(),
        nn.Conv2d(16, 16, 3, padding=1, groups=16, bias=False), nn.BatchNorm2d(16), nn.ReLU6(),
        nn.Conv2d(16, 8, 1, bias=False), nn.BatchNorm2d(8)).eval()


def _int8_convolutions(graph) -> list[bool]:
    """For each convolution of a converted graph, in order: is its weight dequantized from
    int8 (an int8 convolution once compiled) rather than a float constant?"""
    return ["dequantize" in str(node.args[1].target) for node in graph.graph.nodes
            if node.op == "call_function" and "conv2d" in str(node.target)]


@pytest.mark.parametrize("vnni", [True, False])
def test_the_options_keep_depthwise_in_float_only_without_vnni_and_never_for_qat(monkeypatch,
                                                                                 vnni):
    """Both CPU kinds' options on every CPU (each machine would check only its own)."""
    monkeypatch.setattr(pt2e, "cpu_has_vnni", lambda: vnni)
    static = pt2e.pt2e_options()
    assert (static["float_depthwise"], static["weight_bits"]) == (not vnni, 8 if vnni else 7)
    assert pt2e.pt2e_options(qat=True)["float_depthwise"] is False
    assert "float_depthwise" not in pt2e.pt2e_options(dynamic=True)
    assert pt2e.depthwise_names(_inverted_residual()) == ["3"]


@pytest.mark.parametrize("float_depthwise", [True, False])
def test_static_int8_leaves_the_depthwise_convolution_float_when_asked(float_depthwise):
    torch.manual_seed(0)
    model = _inverted_residual()
    spec = {"model": "block", "in_channels": 4, "image_size": 8}
    options = pt2e.pt2e_options() | {"float_depthwise": float_depthwise}
    images = torch.randn(32, 4, 8, 8)
    graph = pt2e.quantize_pt2e(model, spec, options, [images])
    assert _int8_convolutions(graph) == [True, not float_depthwise, True]
    with torch.no_grad():
        reference = model(images)
    error = (graph(images) - reference).abs().max() / reference.std()
    assert error < 0.2  # still the same block, whichever way its depthwise layer runs


def test_auto_times_depthwise_convolutions_in_both_precisions_on_a_model_that_has_them():
    from stages.runtimes.pytorch import static_candidates

    default = pt2e.pt2e_options()["float_depthwise"]
    assert [c["float_depthwise"] for c in static_candidates(False, False, False, True)] == [
        default]
    auto = static_candidates(False, True, also_equalized=True, depthwise=True)
    assert [(c["observer"], c["equalize"], c["float_depthwise"]) for c in auto] == [
        ("histogram", False, default), ("minmax", False, default),
        ("histogram", True, default), ("histogram", False, not default)]
    # A model with no depthwise convolution (or nothing else to quantize) keeps none float,
    # and its configurations do not say otherwise.
    plain = static_candidates(False, True, also_equalized=False, depthwise=False)
    assert [c["float_depthwise"] for c in plain] == [False, False]


def test_the_fallback_is_offered_only_the_layers_a_configuration_quantizes():
    from stages.runtimes.pytorch import _quantized_layers

    block = _inverted_residual()
    assert _quantized_layers(block, {"float_depthwise": True}) == ["0", "6"]
    assert _quantized_layers(block, {"float_depthwise": False}) == ["0", "3", "6"]
