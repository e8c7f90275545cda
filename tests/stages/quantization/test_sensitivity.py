"""Each layer's own quantization error, in one pass: an outlier in one layer's weights is what
ranks it first, and per-channel scales are what bring it down."""
import pytest
import torch
from torch import nn

from stages.quantization import sensitivity
from stages.quantization.sensitivity import Scheme


def _net():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                        nn.ReLU(), nn.Conv2d(8, 8, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                        nn.Flatten(), nn.Linear(8, 10))
    with torch.no_grad():
        net[2].weight[3] *= 200.0  # one output channel of the middle conv 200x the others
        net[4].weight[:, 3] /= 200.0  # and the next conv reads it 200x weaker: same function
    return net


def test_the_layer_with_an_outlier_channel_is_the_most_sensitive_per_tensor():
    net = _net()
    batches = [torch.rand(16, 1, 8, 8) for _ in range(4)]
    errors = sensitivity.layer_errors(net, batches, Scheme(per_channel=False))
    assert list(errors) == ["0", "2", "4", "8"]  # in the order the layers run
    # The outlier's layer (its weights share one scale) and its reader (its input does).
    assert set(sensitivity.ranked(errors)[:2]) == {"2", "4"}
    assert min(errors["2"], errors["4"]) > 10 * errors["0"]
    per_channel = sensitivity.layer_errors(net, batches, Scheme(per_channel=True))
    assert per_channel["2"] < errors["2"] / 10  # its own scale for the outlier channel
    assert net.training and all(not m._forward_hooks for m in net.modules())  # as it was


def test_exact_values_have_no_error_and_7_bits_more_than_8():
    linear = nn.Linear(4, 2, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.tensor([[127.0, -64.0, 1.0, 0.0], [3.0, 5.0, -127.0, 2.0]]))
    inputs = [torch.tensor([[0.0, 1.0, 2.0, 255.0]])]  # on the uint8 grid of its range
    assert sensitivity.layer_errors(linear, inputs, Scheme(per_channel=True))[""] == 0.0
    net = _net()
    batches = [torch.rand(16, 1, 8, 8)]
    eight = sensitivity.layer_errors(net, batches, Scheme(weight_bits=8))
    seven = sensitivity.layer_errors(net, batches, Scheme(weight_bits=7))
    assert sum(seven.values()) > 1.5 * sum(eight.values())  # about 4x the rounding error


def test_errors_carry_to_a_backends_names_only_where_the_layers_line_up():
    net = _net()
    errors = sensitivity.layer_errors(net, [torch.rand(4, 1, 8, 8)], Scheme())
    names = ["node_Conv_1", "node_Conv_2", "node_Conv_3", "node_Gemm_4"]
    sizes = [m.weight.numel() for m in net if isinstance(m, (nn.Conv2d, nn.Linear))]
    carried = sensitivity.by_position(net, errors, names, sizes)
    assert carried == pytest.approx(dict(zip(names, errors.values())))
    assert sensitivity.by_position(net, errors, names[:3], sizes[:3]) is None  # one missing
    assert sensitivity.by_position(net, errors, names, sizes[::-1]) is None  # out of order


def test_a_linear_layer_on_tokens_is_measured_per_output_channel_not_per_token():
    """A Linear on (batch, tokens, features), as in a mixer or a transformer, was averaged
    over tokens: one large output channel then hid the others' rounding. Its error must be
    the same as on the same rows flattened to (batch x tokens, features)."""
    torch.manual_seed(0)
    linear = nn.Linear(4, 3)
    with torch.no_grad():
        linear.weight[0] *= 200
    tokens = torch.randn(8, 5, 4)
    on_tokens = sensitivity.layer_errors(linear, [tokens], Scheme(per_channel=False))[""]
    on_rows = sensitivity.layer_errors(linear, [tokens.reshape(-1, 4)],
                                       Scheme(per_channel=False))[""]
    assert on_tokens == pytest.approx(on_rows, rel=1e-5)
