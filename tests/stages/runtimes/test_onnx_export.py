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


class _Means(torch.nn.Module):
    """Global average pooling kept 4-D (a squeeze-excitation gate's) and flattened (mnasnet's
    x.mean([2, 3])), each on a 7x5 map and on a map of one pixel, and a mean over channels,
    which is not pooling."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.squash = torch.nn.Conv2d(8, 8, (7, 5))  # 7x5 -> 1x1
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x):
        x = self.conv(x)
        x = x * torch.sigmoid(x.mean((2, 3), keepdim=True)) + x.mean(1, keepdim=True)
        pixel = self.squash(x)
        return (self.fc(x.mean([2, 3]) + pixel.mean([2, 3]))
                + self.fc(pixel.mean((2, 3), keepdim=True).flatten(1)))


def test_global_means_are_written_as_global_average_pools(tmp_path):
    import onnxruntime as ort

    model = _Means().eval()
    path = tmp_path / "model.onnx"
    rewritten = export_onnx(model, torch.zeros(2, 3, 9, 7), path)
    proto = onnx.load(str(path))
    ops = [node.op_type for node in proto.graph.node]
    assert len(rewritten) == 4
    assert ops.count("GlobalAveragePool") == 2 and ops.count("ReduceMean") == 1  # over channels
    assert ops.count("Identity") == 1 and ops.count("Squeeze") == 2  # the one-pixel means
    used = {name for node in proto.graph.node for name in node.input}
    assert all(init.name in used for init in proto.graph.initializer)  # the axes went with them
    images = torch.randn(5, 3, 9, 7)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    logits = session.run(None, {session.get_inputs()[0].name: images.numpy()})[0]
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(logits), model(images), atol=1e-5, rtol=1e-5)


def _graph_of_means(opset: int, axes_by: str):
    """x (float, 2x3x4x5) and its spatial means, axes given as ``axes_by``: "attribute" (before
    opset 18), or a Constant node that a Reshape also reads; an int32 mean left alone."""
    import numpy as np

    spatial = np.array([2, 3], np.int64)
    nodes, initializers = [], []
    if axes_by == "attribute":
        nodes.append(helper.make_node("ReduceMean", ["x"], ["kept"], axes=[2, 3], keepdims=1))
        nodes.append(helper.make_node("ReduceMean", ["x"], ["flat"], axes=[-1, -2], keepdims=0))
    else:
        nodes.append(helper.make_node("Constant", [], ["axes"],
                                      value=numpy_helper.from_array(spatial)))
        nodes.append(helper.make_node("ReduceMean", ["x", "axes"], ["kept"], keepdims=1))
        nodes.append(helper.make_node("ReduceMean", ["x", "axes"], ["flat"], keepdims=0))
        nodes.append(helper.make_node("Reshape", ["flat", "axes"], ["shared"]))  # reads it too
    nodes.append(helper.make_node("Cast", ["x"], ["ints"], to=onnx.TensorProto.INT32))
    nodes.append(helper.make_node("ReduceMean", ["ints"], ["int_mean"], axes=[2, 3])
                 if axes_by == "attribute" else
                 helper.make_node("ReduceMean", ["ints", "axes"], ["int_mean"]))
    float_, int32 = onnx.TensorProto.FLOAT, onnx.TensorProto.INT32
    outputs = [("kept", float_, [2, 3, 1, 1]), ("flat", float_, [2, 3]),
               ("int_mean", int32, [2, 3, 1, 1])] + (
        [("shared", float_, [2, 3])] if axes_by != "attribute" else [])
    graph = helper.make_graph(
        nodes, "means", [helper.make_tensor_value_info("x", float_, [2, 3, 4, 5])],
        [helper.make_tensor_value_info(*output) for output in outputs], initializers)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    return onnx.shape_inference.infer_shapes(proto)


def test_means_given_by_attribute_or_by_a_shared_constant_are_rewritten_alike():
    import numpy as np
    import onnxruntime as ort

    from stages.runtimes.onnx_export import means_as_global_pools

    x = np.random.default_rng(0).standard_normal((2, 3, 4, 5)).astype(np.float32)
    for opset, axes_by in ((11, "attribute"), (13, "attribute"), (18, "constant")):
        proto = _graph_of_means(opset, axes_by)
        session = ort.InferenceSession(proto.SerializeToString(),
                                       providers=["CPUExecutionProvider"])
        before = session.run(None, {"x": x})
        rewritten = means_as_global_pools(proto)
        onnx.checker.check_model(proto, full_check=True)
        ops = [node.op_type for node in proto.graph.node]
        # Before opset 13, Squeeze takes its axes as an attribute: the flattening mean stays.
        assert len(rewritten) == (1 if opset < 13 else 2), (opset, rewritten)
        assert ops.count("GlobalAveragePool") == len(rewritten)
        assert ops.count("ReduceMean") == 3 - len(rewritten)  # the int32 mean among them
        assert ops.count("Constant") == (axes_by == "constant")  # the Reshape still reads it
        session = ort.InferenceSession(proto.SerializeToString(),
                                       providers=["CPUExecutionProvider"])
        for was, now in zip(before, session.run(None, {"x": x})):
            np.testing.assert_allclose(now, was, rtol=1e-6, atol=1e-6)


def test_a_converters_output_onnx_checker_refuses_costs_its_variant(tmp_path):
    """It had been a PipelineError, the stage's: quantize stopped there, and the variants after
    it (and torch-static's deferred check) never ran. After our own rewrites it still is."""
    import pytest

    from stages.run.errors import NotMade
    from stages.runtimes.onnx_export import check_onnx

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, [1])])
    path = tmp_path / "ort-static.onnx"
    onnx.save_model(helper.make_model(graph), str(path))  # its output "z" is never made
    with pytest.raises(NotMade, match=r"^ONNX Runtime's quantizer \(onnx.checker on "
                                      r"ort-static.onnx\) failed: "):
        check_onnx(path, made_by="ONNX Runtime's quantizer")
    from stages.run.errors import PipelineError

    with pytest.raises(PipelineError, match="please report this"):  # after our own rewrites
        check_onnx(path)
