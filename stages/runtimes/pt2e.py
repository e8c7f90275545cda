"""PT2E int8 through torchao: torch.export, an X86InductorQuantizer, calibration,
convert_pt2e, and the converted graph as a file. The graph is stored as data
(stages/runtimes/graph_file), never with torch.export.save, whose loader runs code from the
file. The variants made with it, and how they are compiled and served: runtimes/pytorch.py.
"""
from __future__ import annotations

import copy
import warnings

from stages.measure.machine import cpu_has_vnni
from stages.run.errors import NotMade, PipelineError
from stages.run.files import atomic_torch_save, converter_errors
from stages.run.loading import load_checkpoint
from stages.runtimes import graph_file, torchao_patterns


def _example(spec: dict, batch: int = 2):
    import torch

    return torch.zeros(batch, spec["in_channels"], spec["image_size"], spec["image_size"])


def _pt2e():
    """torchao's PT2E API, with the notices it prints on import silenced."""
    import logging

    # Two notices through logging: torchao's import registers an Enum the deprecated way, and
    # a CUDA build on a machine without CUDA says so at the first compile.
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchao.quantization.pt2e import quantize_pt2e
            from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer
    except ImportError:
        raise PipelineError("torch int8 needs torchao: pip install 'torchao>=0.18', or leave "
                            "torch-* out of --methods") from None
    torchao_patterns.install()
    return quantize_pt2e, x86_inductor_quantizer


def export_graph(model, spec: dict, train: bool = False):
    """torch.export with a dynamic batch axis. Strict mode: non-strict export of torchvision's
    ResNets (one ReLU module called twice) fails in X86InductorQuantizer with "Input partition
    has more than one output node"."""
    import torch

    model = model.train() if train else model.eval()
    try:
        return torch.export.export(model, (_example(spec, 4),), strict=True, dynamic_shapes=(
            {0: torch.export.Dim("batch", min=1)},)).module()
    except Exception as exc:
        raise NotMade(f"torch.export of {spec['model']} failed, so PT2E int8 cannot be "
                            f"made: {str(exc).strip().splitlines()[0][:300]}") from exc


def pt2e_options(dynamic: bool = False, observer: str = "histogram", qat: bool = False) -> dict:
    """X86InductorQuantizer's recipe (per-channel symmetric weights, per-tensor activations),
    with 7-bit weights (-63..63) on a CPU without VNNI, where full-range u8 x s8 products
    saturate in the kernels (two products summed in int16). torchao's own `reduce_range`
    narrows the activations instead; on mnasnet0_5 that lost 33 points on held-out images
    where 7-bit weights lose 6.7, and its compiled kernels strayed further from their own
    reference (largest logit error 1.5 output standard deviations against 0.4).

    Static int8 also keeps depthwise convolutions in float on a CPU without VNNI: there oneDNN
    runs them through its general grouped int8 kernel (`jit_uni_int8:avx2`), which took twice
    the time of its float depthwise kernel (`jit_dw:avx2`) on mobilenet_v2 (docs/design.md). QAT
    quantizes them: its graph also serves ONNX Runtime and OpenVINO, whose int8 depthwise
    kernels pay."""
    vnni = cpu_has_vnni()
    options = {"dynamic": dynamic, "per_channel": True, "weight_bits": 8 if vnni else 7}
    if dynamic:
        return options
    # QAT's activations are fake-quantized by torchao's moving-average observer, whatever
    # ``observer`` says: recorded as such, not as the histogram post-training would use.
    return options | {"observer": "moving average (fake quantization)" if qat else observer,
                      "float_depthwise": not vnni and not qat}


def depthwise_names(model) -> list[str]:
    """Module names of the depthwise convolutions (one filter per input channel)."""
    from torch import nn

    return [name for name, module in model.named_modules() if isinstance(module, nn.Conv2d)
            and module.groups > 1 and module.groups == module.in_channels]


def make_quantizer(options: dict, float_layers=(), qat: bool = False):
    import dataclasses

    import torch

    _, x86 = _pt2e()
    config = x86.get_default_x86_inductor_quantization_config(
        is_dynamic=options.get("dynamic", False), is_qat=qat)
    if options.get("weight_bits", 8) != 8:
        limit = 2 ** (options["weight_bits"] - 1) - 1  # symmetric: oneDNN needs zero point 0
        config = dataclasses.replace(config, weight=dataclasses.replace(
            config.weight, quant_min=-limit, quant_max=limit))
    if options.get("observer") == "minmax" and not qat:
        # The activations' range from their extremes rather than X86InductorQuantizer's
        # histogram (which trims outliers to lower the rounding error of the rest).
        from torchao.quantization.pt2e.observer import MinMaxObserver

        spec = config.input_activation
        config = dataclasses.replace(config, input_activation=dataclasses.replace(
            spec, observer_or_fake_quant_ctr=MinMaxObserver.with_args(eps=2 ** -12)))
    if qat:
        config = _qat_weights_as_deployed(config)
    quantizer = x86.X86InductorQuantizer()
    if options.get("dynamic"):
        # Dynamic int8 for the Linear layers alone, as ort-dynamic: set globally, it also
        # stored resnet18's convolution weights in int8 and dequantized them at every call
        # (47.9 ms at batch 32 against 18.8 for fp32-compiled, AMD EPYC).
        quantizer.set_module_type_qconfig(torch.nn.Linear, config)
    else:
        quantizer.set_global(config)
    for name in float_layers:
        quantizer.set_module_name_qconfig(name, None)
    if qat:
        from torchao.quantization.pt2e.quantizer import ComposableQuantizer

        return ComposableQuantizer([quantizer, _outputs_before_activations(config)])
    return quantizer


# Activations ONNX Runtime runs apart from the convolution before them (it folds only Relu and
# Clip into its int8 Conv), so that convolution is int8 only where its output is quantized.
UNFUSED_ACTIVATIONS = ("silu", "silu_", "hardswish", "hardswish_", "sigmoid", "sigmoid_",
                       "hardsigmoid", "hardsigmoid_")


def _aten_name(node) -> str | None:
    return getattr(getattr(node.target, "overloadpacket", None), "__name__", None)


def annotate_outputs_before_activations(graph, config) -> int:
    """Quantize the output of each quantized convolution (after its BatchNorm, where it has
    one) whose every consumer is an activation in UNFUSED_ACTIVATIONS; returns how many.

    X86InductorQuantizer quantizes conv + BatchNorm + SiLU after the activation, as Inductor
    fuses it, and leaves a convolution before a Sigmoid (squeeze-excitation) unquantized.
    ONNX Runtime fuses a convolution into its int8 kernel only where a QuantizeLinear follows
    it: efficientnet_b0's `ort-qat` ran 16 of its 81 convolutions in int8. Adding those
    quantizers after fine-tuning cost 8 points, since training had not seen them; here the
    fine-tuning trains with them, and all 81 run in int8 (docs/measurements.md's git history)."""
    from torchao.quantization.pt2e.quantizer import QuantizationAnnotation, get_output_act_qspec

    key = "quantization_annotation"
    quantized = 0
    for conv in list(graph.graph.nodes):
        annotation = conv.meta.get(key)
        if (conv.op != "call_function" or _aten_name(conv) != "conv2d" or annotation is None
                or not annotation.input_qspec_map):
            continue
        end = conv
        if len(conv.users) == 1 and _aten_name(next(iter(conv.users))) == "batch_norm":
            end = next(iter(conv.users))
        if not end.users or not all(_aten_name(user) in UNFUSED_ACTIVATIONS
                                    for user in end.users):
            continue
        if key in end.meta:
            end.meta[key].output_qspec = get_output_act_qspec(config)
        else:
            end.meta[key] = QuantizationAnnotation(output_qspec=get_output_act_qspec(config),
                                                   _annotated=True)
        quantized += 1
    return quantized


def _outputs_before_activations(config):
    """annotate_outputs_before_activations as the Quantizer prepare_qat_pt2e composes after
    X86InductorQuantizer (torchao's interface for a further annotation pass)."""
    from torchao.quantization.pt2e.quantizer import Quantizer

    class OutputsBeforeActivations(Quantizer):
        def annotate(self, model):
            annotate_outputs_before_activations(model, config)
            return model

        def validate(self, model) -> None:
            pass

    return OutputsBeforeActivations()


def _qat_weights_as_deployed(config):
    """The QAT config with weights fake-quantized by the qparams convert_pt2e will use.

    torchao 0.18 fake-quantizes QAT weights with the fused kernel
    (torch.fused_moving_avg_obs_fake_quant), which makes a per-channel "symmetric" range
    affine where a channel's weights are all of one sign: half the step and a zero point of
    +-127/128. convert_pt2e asks the observer instead, which is symmetric with zero point 0,
    as oneDNN's int8 kernels need. So training saw finer weights than the model deployed:
    on mnasnet0_5 (depthwise channels of 9 weights, often of one sign) the converted graph
    agreed with its fake-quantized self on 87.5% of images. Plain FakeQuantize takes its
    qparams from the same observer as convert. Fixed upstream after 0.18 (pytorch/ao#4824)."""
    import dataclasses

    from torchao.quantization.pt2e.fake_quantize import FakeQuantize
    from torchao.quantization.pt2e.observer import MovingAveragePerChannelMinMaxObserver

    spec = config.weight
    weight = dataclasses.replace(spec, observer_or_fake_quant_ctr=FakeQuantize.with_args(
        observer=MovingAveragePerChannelMinMaxObserver, quant_min=spec.quant_min,
        quant_max=spec.quant_max, dtype=spec.dtype, qscheme=spec.qscheme, ch_axis=spec.ch_axis,
        eps=2 ** -12))
    return dataclasses.replace(config, weight=weight)


def quantize_pt2e(model, spec: dict, options: dict, calibration, float_layers=(),
                  exported=None):
    """The float ``model`` (untouched) as a converted PT2E int8 graph; ``exported``, if given,
    is its export_graph, copied rather than exported again."""
    import torch

    quantize_pt2e_module, _ = _pt2e()
    graph = (copy.deepcopy(exported) if exported is not None
             else export_graph(copy.deepcopy(model), spec))
    if options.get("float_depthwise"):
        float_layers = (*float_layers, *depthwise_names(model))
    quantizer = make_quantizer(options, float_layers)
    with converter_errors("torchao's PT2E quantization"):
        prepared = quantize_pt2e_module.prepare_pt2e(graph, quantizer)
        with torch.inference_mode():
            for batch in calibration:
                prepared(batch)
        return convert(prepared)


def prepare_qat(graph, options: dict):
    """``graph`` (exported for training) with the fake quantizers of ``options``' QAT recipe:
    what quantization-aware training fine-tunes (runtimes/qat.py)."""
    quantize_pt2e_module, _ = _pt2e()
    quantizer = make_quantizer(options, qat=True)  # ours: outside converter_errors
    with converter_errors("torchao's PT2E QAT preparation"):  # its refusal costs QAT alone
        return quantize_pt2e_module.prepare_qat_pt2e(graph, quantizer)


def convert(prepared):
    """A prepared graph, calibrated or fine-tuned, as its int8 graph of plain operators."""
    quantize_pt2e_module, _ = _pt2e()
    with converter_errors("torchao's PT2E conversion"):
        converted = quantize_pt2e_module.convert_pt2e(prepared)
    return plain_graph(converted)


def plain_graph(graph):
    """The converted graph as a plain GraphModule of operators (what a file holds), so that
    the model measured is the model saved; convert_pt2e's result also keeps the unused float
    weights and export's guard module."""
    return graph_file.from_data(graph_file.to_data(graph))


def layer_names(model) -> list[str]:
    """Module names of the Conv and Linear layers: what set_module_name_qconfig keeps float."""
    from torch import nn

    return [name for name, module in model.named_modules()
            if isinstance(module, (nn.Conv2d, nn.Linear))]


def save_pt2e(graph, path, spec: dict, recipe: dict) -> None:
    """The converted graph as data (stages/graph_file), with the recipe that made it."""
    atomic_torch_save({"model_spec": spec, "recipe": recipe,
                       "graph": graph_file.to_data(graph)}, path)


def load_pt2e(run, name: str):
    """A PT2E int8 graph from its verified file, ready to compile."""
    return load_graph_file(run.verified_path(name), name)


def load_graph_file(path, name: str):
    data = load_checkpoint(path)
    if not isinstance(data, dict) or "graph" not in data:
        raise PipelineError(f"{name}: {path} is not a pipeline PT2E model file")
    _pt2e()  # registers the quantized_decomposed operators and Inductor's int8 passes
    try:
        return graph_file.from_data(data["graph"])
    except PipelineError as exc:
        raise PipelineError(f"{name}: {path}: {exc}") from None
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise PipelineError(f"{name}: {path} is not a well-formed graph file "
                            f"({type(exc).__name__}: {exc})") from None
