"""How much of a model really runs in int8: per op type, how many ops are int8 and how many
stayed float. A quantized file can be small and still run most of its work in float."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

QUANT_PLUMBING = {"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"}
COMPUTE_ONNX = {"Conv", "MatMul", "Gemm", "ConvTranspose"}


def _base_onnx_type(op_type: str) -> str:
    """QLinearConv, ConvInteger and Conv are all 'Conv'; QGemm is 'Gemm'."""
    if op_type.startswith("QLinear"):
        return op_type[len("QLinear"):]
    if op_type.endswith("Integer"):
        return op_type[: -len("Integer")]
    if op_type == "QGemm":
        return "Gemm"
    return op_type


def onnx_op_counts(path: Path) -> dict[str, dict[str, int]]:
    """Compute ops (Conv, MatMul, Gemm) by type: int8 when they are integer kernels, or, in a
    QDQ graph, when input and weight come from DequantizeLinear (ORT fuses those to int8)."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    producer = {out: node.op_type for node in graph.node for out in node.output}
    counts: dict[str, dict[str, int]] = defaultdict(lambda: {"int8": 0, "float": 0})
    for node in graph.node:
        if node.op_type in QUANT_PLUMBING:
            continue
        base = _base_onnx_type(node.op_type)
        if base not in COMPUTE_ONNX:
            continue
        # In QDQ form both the activation and the weight come out of DequantizeLinear; a node
        # left float may still read a dequantized activation, but its weight stays float.
        integer = node.op_type != base or (
            len(node.input) >= 2
            and all(producer.get(name) == "DequantizeLinear" for name in node.input[:2]))
        counts[base]["int8" if integer else "float"] += 1
    return dict(counts)


def torch_op_counts(model) -> dict[str, dict[str, int]]:
    """Conv and Linear modules by type: int8 where the module is a quantized (static or dynamic)
    kernel, float otherwise."""
    counts: dict[str, dict[str, int]] = defaultdict(lambda: {"int8": 0, "float": 0})
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("PackedParams"):  # the weights holder inside a quantized Linear
            continue
        kind = "Conv" if name.startswith("Conv") else "Linear" if name.startswith(
            "Linear") else None
        if kind is None or list(module.children()) and "quantized" not in type(module).__module__:
            continue  # containers such as a float ConvReLU2d hold the Conv2d counted below
        counts[kind]["int8" if "quantized" in type(module).__module__ else "float"] += 1
    return dict(counts)


def summarize(counts: dict[str, dict[str, int]]) -> str:
    return ", ".join(f"{kind} {c['int8']}/{c['int8'] + c['float']} int8"
                     for kind, c in sorted(counts.items())) or "no Conv/Linear ops"
