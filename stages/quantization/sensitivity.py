"""Which layers int8 hurts most, measured in one pass over calibration images.

Every Conv and Linear layer of the float model is fed its float input (hooks on the float
model, so one layer's error does not compound into the next), and its output is computed again
with the input and the weights quantized as a backend quantizes them: activations as unsigned
8 bits over the range calibration saw, weights per channel or per tensor, symmetric, in 8 or 7
bits. A layer's error is the mean squared difference of the two outputs over the float output's
mean square, per output channel and averaged over them (0: exact; 1: as large as the output).
Two forward passes (ranges, then errors) replace the model per layer the fallback used to build
to rank layers.

The ranking is the torch model's; `by_position` carries it to a backend whose layers have other
names (an ONNX graph's Conv nodes, OpenVINO's ops), matching them in order and by weight shape.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Scheme:
    """How a backend quantizes a layer: weights per channel or per tensor, in weight_bits
    (symmetric, zero point 0); activations unsigned, activation_bits, over their min-max."""

    per_channel: bool = True
    weight_bits: int = 8
    activation_bits: int = 8


def _fake_quantize_weight(weight, scheme: Scheme):
    import torch

    limit = 2 ** (scheme.weight_bits - 1) - 1
    if scheme.per_channel:
        peak = weight.abs().flatten(1).amax(dim=1).clamp_min(1e-12)
        peak = peak.view(-1, *([1] * (weight.dim() - 1)))
    else:
        peak = weight.abs().amax().clamp_min(1e-12)
    scale = peak / limit
    return torch.clamp(torch.round(weight / scale), -limit, limit) * scale


def _fake_quantize_input(x, low: float, high: float, bits: int):
    import torch

    low, high = min(low, 0.0), max(high, 0.0)  # zero must be exact, as quantizers make it
    levels = 2 ** bits - 1
    scale = max(high - low, 1e-12) / levels
    zero = round(-low / scale)
    return (torch.clamp(torch.round(x / scale) + zero, 0, levels) - zero) * scale


def _layers(model) -> dict:
    from torch import nn

    return {name: m for name, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))}


def layer_errors(model, batches, scheme: Scheme) -> dict[str, float]:
    """{layer name: relative output error}, in the order the layers run."""
    import torch

    layers = _layers(model)
    order, ranges = [], {}
    errors = {name: [0.0, 0.0] for name in layers}

    def observe(name):
        def hook(module, inputs, output):
            x = inputs[0].detach()
            low, high = ranges.get(name, (float("inf"), float("-inf")))
            ranges[name] = (min(low, float(x.min())), max(high, float(x.max())))
            if name not in order:
                order.append(name)
        return hook

    def measure(name):
        def hook(module, inputs, output):
            x = inputs[0].detach()
            x_q = _fake_quantize_input(x, *ranges[name], scheme.activation_bits)
            w_q = _fake_quantize_weight(module.weight.detach(), scheme)
            if isinstance(module, torch.nn.Conv2d):
                y_q = module._conv_forward(x_q, w_q, module.bias)
            else:
                y_q = torch.nn.functional.linear(x_q, w_q, module.bias)
            y = output.detach()
            channels = 1 if isinstance(module, torch.nn.Conv2d) else y.dim() - 1  # (B, T, C)
            dims = [d for d in range(y.dim()) if d != channels]
            errors[name][0] = errors[name][0] + ((y_q - y) ** 2).sum(dim=dims)
            errors[name][1] = errors[name][1] + (y ** 2).sum(dim=dims)
        return hook

    was_training = model.training
    model.eval()
    try:
        for make_hook in (observe, measure):
            handles = [m.register_forward_hook(make_hook(n)) for n, m in layers.items()]
            try:
                with torch.no_grad():
                    for batch in batches:
                        model(batch)
            finally:
                for handle in handles:
                    handle.remove()
    finally:
        model.train(was_training)
    # Per output channel, then averaged: a channel 200 times larger than the others must not
    # hide that the others were rounded away (the layers after it may read them as strongly).
    return {name: float((errors[name][0] / errors[name][1].clamp_min(1e-30)).mean())
            for name in order}


def ranked(errors: dict[str, float]) -> list[str]:
    """Layer names, the most sensitive first."""
    return sorted(errors, key=lambda name: -errors[name])


def by_position(model, errors: dict[str, float], backend_layers: list[str],
                backend_sizes: list[int]) -> dict[str, float] | None:
    """The torch layers' errors under a backend's layer names, matched in the order the layers
    run and by the number of weights each holds (a layout the backend may change: grouped
    convolutions, transposed matrices); None where the two do not line up, so that the
    fallback ranks the backend's layers its own way."""
    layers = _layers(model)
    names = list(errors)
    if len(names) != len(backend_layers) or any(
            layers[name].weight.numel() != size for name, size in zip(names, backend_sizes)):
        return None
    return {backend: errors[name] for name, backend in zip(names, backend_layers)}
