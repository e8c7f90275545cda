"""A QDQ graph exported from torchao (`ort-qat`) as ONNX Runtime runs it: the pieces it needs
added before it fuses every Conv and Gemm into its int8 kernels, and why a fused model may
disagree with torch-qat.

ONNX Runtime fuses a node into its int8 kernel only where every input arrives through a
DequantizeLinear (the bias as int32) and, for Conv, the output leaves through a QuantizeLinear.
torchao's export does not always give it that; ort-static, written by ONNX Runtime's own
quantizer, always does.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from stages.measure.evaluate import PARITY_MIN_AGREEMENT, compare_logits
from stages.run.files import atomic_path
from stages.runtimes import onnx_export
from stages.runtimes.onnx_export import INPUT_NAME
from stages.runtimes.onnxruntime import ort_predict, ort_session

# Training images that observe the range of each conv output given a QDQ pair of its own.
RESIDUAL_CALIBRATION_IMAGES = 256
# The initializers of the pairs quantize_sigmoid_outputs adds, by which openvino-qat finds them.
SIGMOID_SCALE = "qdq_onnx.sigmoid_output_scale"
SIGMOID_ZERO_POINT = "qdq_onnx.sigmoid_output_zero_point"
INT32_MAX = 2**31 - 1


def complete_for_onnx_runtime(path: Path, batches) -> dict:
    """Rewrite the QDQ model at ``path`` in place so that ONNX Runtime fuses all its convs and
    linears; ``batches`` (training images) observe the ranges it adds. Returns what it did."""
    import onnx

    model = onnx.load(str(path))
    done = {"conv_outputs_quantized_before_adds":
            quantize_conv_outputs_into_adds(model, path.parent, batches),
            "linear_biases_quantized": quantize_linear_biases(model),
            "sigmoid_outputs_quantized": quantize_sigmoid_outputs(model)}
    if any(done.values()):
        with atomic_path(path) as tmp:
            onnx.save_model(model, str(tmp))
        onnx_export.check_onnx(path)
    return done


def conv_outputs_into_adds(model) -> list[str]:
    """Outputs of the Conv nodes whose every consumer is an Add: no QuantizeLinear between."""
    consumers: dict[str, set] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, set()).add(node.op_type)
    return [node.output[0] for node in model.graph.node
            if node.op_type == "Conv" and consumers.get(node.output[0]) == {"Add"}]


def quantize_conv_outputs_into_adds(model, scratch_dir: Path, batches) -> int:
    """Give each conv output that meets a residual Add unquantized a uint8 QDQ pair of its own,
    its range observed on ``batches`` (training images); returns how many. torchao's
    X86InductorQuantizer annotates conv + add (+ relu) as one pattern, as Inductor fuses it, so
    the exported QAT graph has no QuantizeLinear between such a Conv and its Add, and ONNX
    Runtime left those convs in float (resnet18: 8 of 20, `ort-qat` 14.85 ms at batch 32; with
    the pairs 20 of 20 and 8 QLinearAdd, 3.63 ms, the same predictions on all 360 test images;
    docs/measurements.md's git history)."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    outputs = conv_outputs_into_adds(model)
    if not outputs:
        return 0
    observing = onnx.ModelProto()
    observing.CopyFrom(model)
    for name in outputs:
        observing.graph.output.append(
            helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    low, high = dict.fromkeys(outputs, 0.0), dict.fromkeys(outputs, 0.0)  # the range holds 0
    with tempfile.TemporaryDirectory(dir=scratch_dir, prefix=".observe-") as scratch:
        observing_path = Path(scratch) / "observing.onnx"
        onnx.save_model(observing, str(observing_path))
        session = ort_session(observing_path, threads=1)
        for batch in batches:
            values = session.run(outputs, {INPUT_NAME: batch.numpy().astype(np.float32)})
            for name, value in zip(outputs, values, strict=True):
                low[name] = min(low[name], float(value.min()))
                high[name] = max(high[name], float(value.max()))
    for name in outputs:
        scale = max(high[name] - low[name], 1e-8) / 255.0
        zero_point = int(np.clip(round(-low[name] / scale), 0, 255))
        model.graph.initializer.extend([
            numpy_helper.from_array(np.array(scale, dtype=np.float32), f"{name}_scale"),
            numpy_helper.from_array(np.array(zero_point, dtype=np.uint8), f"{name}_zero_point")])
    _insert_pairs(model, {name: (f"{name}_scale", f"{name}_zero_point") for name in outputs})
    return len(outputs)


def _insert_pairs(model, quantized: dict[str, tuple[str, str]]) -> None:
    """A QuantizeLinear/DequantizeLinear pair right after each tensor of ``quantized`` (with
    the names of its scale and zero point), its consumers reading the pair's output; each pair
    follows its producer, so the nodes stay in order."""
    from onnx import helper

    pairs = {name: [
        helper.make_node("QuantizeLinear", [name, scale, zero_point], [f"{name}_quantized"],
                         name=f"{name}_quantize"),
        helper.make_node("DequantizeLinear", [f"{name}_quantized", scale, zero_point],
                         [f"{name}_dequantized"], name=f"{name}_dequantize")]
        for name, (scale, zero_point) in quantized.items()}
    nodes = []
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            if name in pairs:
                node.input[i] = f"{name}_dequantized"
        nodes += [node] + pairs.get(node.output[0] if node.output else "", [])
    model.graph.ClearField("node")
    model.graph.node.extend(nodes)


def quantize_sigmoid_outputs(model) -> int:
    """Give each Sigmoid that reads a DequantizeLinear and feeds only multiplies ready for int8
    (their other input dequantized, their output quantized) a uint8 QDQ pair of its fixed range
    [0, 1], in steps of 1/255; returns how many. ONNX Runtime then runs the Sigmoid as
    QLinearSigmoid and the multiply as QLinearMul: SiLU's x * sigmoid(x) and the
    squeeze-excitation gates. torchao's QAT graph leaves a Sigmoid's output float (Inductor
    fuses it into the multiply), and ONNX Runtime ran each of those pairs in float between a
    DequantizeLinear and a QuantizeLinear: in efficientnet_b0's ort-qat 4.7 of 9.5 ms a call
    at batch 32 (docs/measurements.md's git history). The gate moves by at most half a step,
    which ort-qat's parity check with torch-qat bounds."""
    import numpy as np
    from onnx import TensorProto, numpy_helper

    producers = {out: node for node in model.graph.node for out in node.output}
    consumers: dict[str, list] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    zero_point_types = {init.name: init.data_type for init in model.graph.initializer}
    graph_outputs = {output.name for output in model.graph.output}

    def op_of(name):
        return producers[name].op_type if name in producers else None

    def uint8(node) -> bool:  # the pair is uint8: QLinearSigmoid and QLinearMul take one type
        return len(node.input) < 3 or zero_point_types.get(node.input[2]) == TensorProto.UINT8

    def ready_multiply(node, gate: str) -> bool:
        others = [name for name in node.input if name != gate]
        after = consumers.get(node.output[0], [])
        return (node.op_type == "Mul" and len(others) == 1
                and op_of(others[0]) == "DequantizeLinear" and uint8(producers[others[0]])
                and node.output[0] not in graph_outputs
                and {c.op_type for c in after} == {"QuantizeLinear"} and all(map(uint8, after)))

    gates = [node.output[0] for node in model.graph.node
             if node.op_type == "Sigmoid" and op_of(node.input[0]) == "DequantizeLinear"
             and uint8(producers[node.input[0]]) and consumers.get(node.output[0])
             and all(ready_multiply(c, node.output[0]) for c in consumers[node.output[0]])]
    if not gates:
        return 0
    model.graph.initializer.extend([
        numpy_helper.from_array(np.array(1 / 255, dtype=np.float32), SIGMOID_SCALE),
        numpy_helper.from_array(np.array(0, dtype=np.uint8), SIGMOID_ZERO_POINT)])
    _insert_pairs(model, dict.fromkeys(gates, (SIGMOID_SCALE, SIGMOID_ZERO_POINT)))
    return len(gates)


def without_sigmoid_pairs(model) -> int:
    """Take out, in place, the pairs `quantize_sigmoid_outputs` added (known by their scale),
    for OpenVINO: with them it no longer fused x * sigmoid(x) into the convolution before it.
    efficientnet_b0's openvino-qat ran the products apart (PowerStatic, 3.08 of 7.43 ms by the
    perf counters), 1.15x and 1.20x the fastest float against 1.28x and 1.38x without them, in
    reports that hour (docs/measurements.md's git history). Returns how many pairs."""
    sigmoid_of = {node.output[0]: node.input[0] for node in model.graph.node
                  if node.op_type == "QuantizeLinear" and node.input[1] == SIGMOID_SCALE}
    restored = {node.output[0]: sigmoid_of[node.input[0]] for node in model.graph.node
                if node.op_type == "DequantizeLinear" and node.input[1] == SIGMOID_SCALE}
    if not restored:
        return 0
    nodes = [node for node in model.graph.node if node.input[1:2] != [SIGMOID_SCALE]]
    for node in nodes:
        for i, name in enumerate(node.input):
            node.input[i] = restored.get(name, name)
    model.graph.ClearField("node")
    model.graph.node.extend(nodes)
    kept = [init for init in model.graph.initializer
            if init.name not in (SIGMOID_SCALE, SIGMOID_ZERO_POINT)]
    model.graph.ClearField("initializer")
    model.graph.initializer.extend(kept)
    return len(restored)


def quantize_linear_biases(model) -> int:
    """Give each Gemm whose input and weight arrive through DequantizeLinear but whose bias is
    float an int32 bias and its DequantizeLinear (scale = input scale x weight scale, zero point
    0, as ONNX Runtime's own quantizer writes it); returns how many. torchao's export keeps a
    Linear's bias float, and ONNX Runtime then ran the Gemm in float: every ort-qat's classifier,
    and any Linear inside a model. A Gemm whose scales are not constants, whose alpha or beta
    is not 1, or whose bias would overflow int32 is left as it is."""
    import numpy as np
    from onnx import helper, numpy_helper

    constants = {init.name: init for init in model.graph.initializer}
    producers = {out: node for node in model.graph.node for out in node.output}
    additions = []
    for index, node in enumerate(model.graph.node):
        if node.op_type != "Gemm" or len(node.input) < 3 or node.input[2] not in constants:
            continue
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if attributes.get("alpha", 1.0) != 1.0 or attributes.get("beta", 1.0) != 1.0:
            continue
        dequantized = [producers.get(name) for name in node.input[:2]]
        if any(dq is None or dq.op_type != "DequantizeLinear" or dq.input[1] not in constants
               for dq in dequantized):
            continue
        input_scale = numpy_helper.to_array(constants[dequantized[0].input[1]])
        weight_scale = numpy_helper.to_array(constants[dequantized[1].input[1]])
        bias = numpy_helper.to_array(constants[node.input[2]]).astype(np.float64)
        # Per channel, the weight's scales must run along the Gemm's outputs, as the bias does.
        output_axis = 0 if attributes.get("transB", 0) else 1
        weight_axis = {a.name: a.i for a in dequantized[1].attribute}.get("axis", 1)
        if input_scale.size != 1 or bias.ndim != 1 or weight_scale.size not in (1, bias.size) \
                or (weight_scale.size > 1 and weight_axis != output_axis):
            continue
        scale = (float(input_scale.reshape(())) * weight_scale.astype(np.float64)
                 * np.ones_like(bias)).astype(np.float32)
        if not (scale > 0).all():
            continue
        steps = np.round(bias / scale.astype(np.float64))
        if np.abs(steps).max(initial=0) > INT32_MAX:
            continue
        name = f"{node.input[2]}_int32_{index}"
        model.graph.initializer.extend([
            numpy_helper.from_array(steps.astype(np.int32), name),
            numpy_helper.from_array(scale, f"{name}_scale"),
            numpy_helper.from_array(np.zeros(bias.size, np.int32), f"{name}_zero_point")])
        additions.append(helper.make_node(
            "DequantizeLinear", [name, f"{name}_scale", f"{name}_zero_point"],
            [f"{name}_dequantized"], name=f"{name}_dequantize", axis=0))
        node.input[2] = f"{name}_dequantized"
    if additions:  # they read only initializers, so they go first and the order holds
        nodes = additions + list(model.graph.node)
        model.graph.ClearField("node")
        model.graph.node.extend(nodes)
    return len(additions)


def bias_rounding_cause(path: Path, reference, images) -> str:
    """Why the fused model disagrees, where the cause is ONNX Runtime's int32 bias: fusing a
    Conv into QLinearConv, its WeightBiasQuantization step rounds the float bias to a step of
    input scale x weight scale. A channel whose weight scale is huge (BatchNorm folded over a
    variance near 0, its input always 0) loses its bias, which is all its output: on
    mnasnet0_5 five depthwise convs had such channels (weight scales 42-190, one output 13
    steps off). Without that step ONNX Runtime fuses no conv, so it is a diagnosis, not a fix.
    '' where turning the step off does not restore agreement."""
    unfused = ort_session(path, threads=1, disabled_optimizers=("WeightBiasQuantization",))
    measured = compare_logits(reference, ort_predict(unfused, images))
    if measured["top1_agreement"] < PARITY_MIN_AGREEMENT:
        return ""
    return (f" (with its WeightBiasQuantization step off they agree on "
            f"{measured['top1_agreement']:.1%}: it rounds each conv bias to a step of input "
            "scale x weight scale, and a channel with a huge weight scale, BatchNorm folded over "
            "a variance near 0, loses its bias; with the step off no conv runs in int8)")
