"""Cross-layer equalization (Nagel et al., "Data-Free Quantization", 2019): a transform of the
float model, before any backend sees it, that makes int8 weights fit.

Where one convolution feeds the next through nothing but a BatchNorm and a ReLU (or another
activation f with f(x / s) = f(x) / s for s > 0), scaling the first one's output channel i by
1 / s_i and the second one's input channel i by s_i leaves the model's outputs as they were.
Choosing s_i = sqrt(r1_i / r2_i), with r the channel's largest absolute weight, gives both
layers the same range per channel, so a per-tensor int8 scale no longer has to cover one
channel a hundred times wider than the rest. On mnasnet0_5 (notMNIST; docs/measurements.md's
git history) it took ort-static's per-tensor loss from -7.13 to -3.81 points.

ReLU6, Hardswish and SiLU are not scale-free: scaling through them would change the float
model, so those pairs are left alone and counted.
"""
from __future__ import annotations

import collections
import copy

# Activations with f(x / s) = f(x) / s for every s > 0.
SCALE_FREE_MODULES = ("ReLU", "LeakyReLU", "PReLU", "Identity", "Dropout")
SCALE_FREE_FUNCTIONS = ("relu", "leaky_relu")
OTHER_ACTIVATIONS = ("ReLU6", "Hardtanh", "Hardswish", "SiLU", "GELU", "Sigmoid", "Tanh",
                     "relu6", "hardtanh", "hardswish", "silu", "gelu")
SWEEPS = 20  # a chain of three or more needs several sweeps; each stops early once converged
# Folding and scaling change logits by rounding alone (under 1e-4 of the largest on resnet18);
# a change past this share of the largest logit means the graph was misread: not applied.
MAX_RELATIVE_LOGIT_CHANGE = 1e-3


def equalize(model, check_images=None) -> tuple[object, dict]:
    """A copy of ``model`` (eval mode) with BatchNorms folded into the convolutions before them
    and every scale-free conv pair equalized, and a record of what was done. Where the model
    cannot be traced, the copy is returned unchanged and the record says why. With
    ``check_images``, the largest logit difference from the original is measured and
    recorded."""
    import torch

    equalized = copy.deepcopy(model).eval()
    try:
        graph = torch.fx.symbolic_trace(equalized).graph
    except Exception as exc:  # noqa: BLE001 - any tracing failure: the model stays as it was
        return equalized, {"applied": False, "why": f"the model cannot be traced by torch.fx "
                                                    f"({type(exc).__name__})"}
    modules = dict(equalized.named_modules())
    # A module called in two places (one BatchNorm after two convolutions) cannot be folded or
    # scaled for one of them without changing the other.
    shared = {name for name, count in collections.Counter(
        node.target for node in graph.nodes if node.op == "call_module").items() if count > 1}
    folded = _fold_batchnorms(equalized, graph, modules, shared)
    modules = dict(equalized.named_modules())
    pairs, skipped = _pairs(graph, modules, shared)
    largest = 0.0
    with torch.no_grad():
        for _ in range(SWEEPS):
            largest = max((_equalize_pair(modules[a], modules[b]) for a, b in pairs),
                          default=0.0)
            if largest < 1e-3:
                break
    record = {"applied": bool(pairs), "batchnorms_folded": folded, "pairs": len(pairs),
              "pairs_left_alone": skipped,
              "why": (f"{len(pairs)} convolution pair(s) equalized" if pairs else
                      "no convolution feeds another through a scale-free activation")}
    if skipped:
        record["why"] += (f"; {skipped} pair(s) joined by an activation that is not scale-free "
                          "(ReLU6, Hardswish, SiLU...) left alone: equalizing them would "
                          "change the float model")
    if check_images is not None:
        with torch.no_grad():
            before, after = model.eval()(check_images), equalized(check_images)
        record["max_abs_logit_change"] = change = float((before - after).abs().max())
        if not change <= MAX_RELATIVE_LOGIT_CHANGE * float(before.abs().max()):
            return copy.deepcopy(model).eval(), {
                "applied": False, "max_abs_logit_change": change,
                "why": f"not applied: it changed the float model's logits by up to {change:.3g}"
                       f" (at most {MAX_RELATIVE_LOGIT_CHANGE:g} of the largest, "
                       f"{float(before.abs().max()):.3g}, is rounding)"}
    return equalized, record


def _name(node) -> str:
    return node.target if node.op == "call_module" else ""


def _module_kind(node, modules) -> str:
    if node.op == "call_module":
        return type(modules[node.target]).__name__
    if node.op in ("call_function", "call_method"):
        return getattr(node.target, "__name__", str(node.target))
    return node.op


def _fold_batchnorms(model, graph, modules, shared: set[str]) -> int:
    """Fold each BatchNorm2d that alone reads a Conv2d's output into that convolution, and
    put an Identity in its place; not one without running statistics (it normalizes by each
    batch's), nor one or a convolution called in more than one place (``shared``)."""
    import torch
    from torch.nn.utils.fusion import fuse_conv_bn_eval

    folded = 0
    for node in graph.nodes:
        if _module_kind(node, modules) != "BatchNorm2d" or not node.args:
            continue
        source = node.args[0]
        if (getattr(source, "op", "") != "call_module" or len(source.users) != 1
                or not isinstance(modules[source.target], torch.nn.Conv2d)
                or modules[node.target].running_mean is None
                or {source.target, node.target} & shared):
            continue
        fused = fuse_conv_bn_eval(modules[source.target], modules[node.target])
        model.set_submodule(source.target, fused)
        model.set_submodule(node.target, torch.nn.Identity())
        modules[source.target], modules[node.target] = fused, torch.nn.Identity()
        folded += 1
    return folded


def _pairs(graph, modules, shared: set[str]) -> tuple[list[tuple[str, str]], int]:
    """(first, second) convolution names where the first feeds only the second, through
    nothing but scale-free steps; and how many such pairs a non-scale-free activation joins.
    Not where either convolution is called in more than one place (``shared``)."""
    import torch

    pairs, skipped = [], 0
    for node in graph.nodes:
        second = modules.get(_name(node))
        if not isinstance(second, torch.nn.Conv2d) or not _scalable_input(second):
            continue
        step, blocked = node.args[0], False
        while getattr(step, "op", "") in ("call_module", "call_function", "call_method"):
            kind = _module_kind(step, modules)
            if isinstance(modules.get(_name(step)), torch.nn.Conv2d):
                break
            if len(step.users) != 1 or not step.args:
                step = None
                break
            if kind in OTHER_ACTIVATIONS:
                blocked = True
            elif kind not in SCALE_FREE_MODULES + SCALE_FREE_FUNCTIONS:
                step = None  # an add, a pool, a reshape: channels no longer map one to one
                break
            step = step.args[0]
        first = modules.get(_name(step)) if step is not None else None
        if (not isinstance(first, torch.nn.Conv2d) or len(step.users) != 1
                or first.out_channels != second.in_channels
                or {step.target, node.target} & shared):
            continue
        if blocked:
            skipped += 1
        else:
            pairs.append((step.target, node.target))
    return pairs, skipped


def _scalable_input(conv) -> bool:
    """Its input channel i maps to known weights: a full convolution or a depthwise one."""
    return conv.groups == 1 or conv.groups == conv.in_channels == conv.out_channels


def _equalize_pair(first, second) -> float:
    """Scale one pair in place; returns the largest |log s| applied (0 once converged)."""
    import torch

    w1, w2 = first.weight, second.weight
    range1 = w1.abs().flatten(1).amax(1)
    range2 = (w2.abs().amax(dim=(0, 2, 3)) if second.groups == 1
              else w2.abs().flatten(1).amax(1))
    scale = torch.where((range1 > 0) & (range2 > 0), torch.sqrt(range1 / range2.clamp_min(1e-12)),
                        torch.ones_like(range1))
    w1.div_(scale.view(-1, 1, 1, 1))
    if first.bias is not None:
        first.bias.div_(scale)
    if second.groups == 1:
        w2.mul_(scale.view(1, -1, 1, 1))
    else:
        w2.mul_(scale.view(-1, 1, 1, 1))
    return float(scale.log().abs().max()) if scale.numel() else 0.0

