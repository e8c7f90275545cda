"""The exported ONNX file as other tools rewrite it."""
import onnx
import torch
from onnx import helper, numpy_helper

from stages.runtimes.onnx_export import export_onnx


def test_a_weight_rewritten_in_place_passes_shape_inference(tmp_path):
    """onnxruntime 1.30's quantize_dynamic turns Gemm(transB=1) into MatMul by transposing the
    weight in place; a value_info entry the exporter wrote for that weight then contradicts it
    and ONNX's shape inference refuses the model (seen on the GPU machine's onnxruntime)."""
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 3)).eval()
    path = tmp_path / "model.onnx"
    export_onnx(model, torch.zeros(2, 3, 2, 2), path)
    proto = onnx.load(str(path))
    gemm = next(node for node in proto.graph.node if node.op_type == "Gemm")
    weight = next(i for i in proto.graph.initializer if i.name == gemm.input[1])
    weight.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weight).T.copy(), weight.name))
    gemm.CopyFrom(helper.make_node("Gemm", list(gemm.input), list(gemm.output), name=gemm.name))
    # Without the fix, strict inference raises on the weight's stale entry: (3, 12) vs (12, 3).
    inferred = onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True)
    weight_shapes = {info.name: [d.dim_value for d in info.type.tensor_type.shape.dim]
                     for info in inferred.graph.value_info if info.name == weight.name}
    assert weight_shapes in ({}, {weight.name: [12, 3]})
    logits = inferred.graph.output[0].type.tensor_type.shape.dim
    assert logits[-1].dim_value == 3
