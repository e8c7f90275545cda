"""What ort-qat's QDQ graph needs before ONNX Runtime fuses it into int8 kernels, and why a
fused model may disagree with torch-qat."""
import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from stages.measure.evaluate import compare_logits
from stages.runtimes import qdq_onnx
from stages.runtimes.onnxruntime import onnx_op_counts, ort_predict, ort_session


def _depthwise_qdq_model(path, weight_scales: list[float], biases: list[float]) -> None:
    """A QDQ model of one 1x1 depthwise conv over two channels, as the ONNX export of a PT2E
    graph writes it: u8 activations, per-channel int8 weights of 63, a float bias."""
    def const(name, value):
        return numpy_helper.from_array(np.asarray(value), name)

    inits = [const("xs", np.float32(0.1)), const("xz", np.uint8(0)),
             const("w", np.full((2, 1, 1, 1), 63, np.int8)),
             const("ws", np.asarray(weight_scales, np.float32)), const("wz", np.zeros(2, np.int8)),
             const("b", np.asarray(biases, np.float32)),
             const("ys", np.float32(0.15)), const("yz", np.uint8(0))]
    nodes = [helper.make_node("QuantizeLinear", ["input", "xs", "xz"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wd"], axis=0),
             helper.make_node("Conv", ["xd", "wd", "b"], ["y"], group=2),
             helper.make_node("QuantizeLinear", ["y", "ys", "yz"], ["yq"]),
             helper.make_node("DequantizeLinear", ["yq", "ys", "yz"], ["yd"]),
             helper.make_node("Flatten", ["yd"], ["logits"])]
    graph = helper.make_graph(
        nodes, "depthwise",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [None, 2, 1, 1])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [None, 2])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def test_ort_qat_refusal_names_onnx_runtimes_bias_rounding_where_it_is_the_cause(tmp_path):
    """mnasnet0_5's case in miniature: channel 0's input is 0 and its weight scale 40, so its
    output is its bias (1.9, 13 output steps), which ONNX Runtime's fused kernel rounds to a
    step of 0.1 x 40 = 4, that is to 0; channel 1 (bias 1.0, scale 0.01) keeps its bias."""
    path = tmp_path / "qdq.onnx"
    _depthwise_qdq_model(path, weight_scales=[40.0, 0.01], biases=[1.9, 1.0])
    images = torch.zeros(4, 2, 1, 1)
    unfused = torch.tensor([[1.95, 1.05]]).repeat(4, 1)  # the biases, quantized to 0.15 steps
    fused = ort_predict(ort_session(path, threads=1), images)
    assert fused[:, 0].abs().max() == 0 and (fused.argmax(1) == 1).all()
    cause = qdq_onnx.bias_rounding_cause(path, unfused, images)
    assert "WeightBiasQuantization step off they agree on 100.0%" in cause
    # Where turning that step off does not restore agreement, it names no cause.
    assert qdq_onnx.bias_rounding_cause(path, unfused.flip(1), images) == ""


WEIGHT = np.array([[10, -20, 30, -40], [50, 60, -70, 80], [-90, 100, 110, -120]], np.int8)
WEIGHT_SCALES = np.array([0.01, 0.02, 0.004], np.float32)
INPUT_SCALE = 0.05


def _linear_qdq_model(path, bias, trans_b=1, alpha=1.0) -> None:
    """One Linear (4 -> 3) as torchao's export writes it: a u8 input and per-channel int8
    weights through DequantizeLinear, a float bias, no QuantizeLinear after (the logits)."""
    def const(name, value):
        return numpy_helper.from_array(np.asarray(value), name)

    weight = WEIGHT if trans_b else WEIGHT.T
    inits = [const("xs", np.float32(INPUT_SCALE)), const("xz", np.uint8(0)),
             const("w", weight), const("ws", WEIGHT_SCALES), const("wz", np.zeros(3, np.int8)),
             const("b", np.asarray(bias, np.float32))]
    nodes = [helper.make_node("QuantizeLinear", ["input", "xs", "xz"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wd"],
                              axis=0 if trans_b else 1),
             helper.make_node("Gemm", ["xd", "wd", "b"], ["logits"], transB=trans_b,
                              alpha=alpha, name="linear")]
    graph = helper.make_graph(
        nodes, "linear", [helper.make_tensor_value_info("input", TensorProto.FLOAT, [None, 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [None, 3])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


@pytest.mark.parametrize("trans_b", [1, 0])
def test_a_linear_with_a_float_bias_gets_an_int32_one_and_runs_in_int8(tmp_path, trans_b):
    """torchao's export keeps a Linear's bias float, and ONNX Runtime ran every ort-qat's
    classifier as a float Gemm; with the bias in int32 at input scale x weight scale, as ONNX
    Runtime's own quantizer writes it, the Gemm becomes a QGemm with the same outputs."""
    path = tmp_path / "linear.onnx"
    bias = [0.50031, -0.25, 0.01307]  # 1000.62, -250 and 65.35 steps
    _linear_qdq_model(path, bias, trans_b=trans_b)
    assert onnx_op_counts(path)["Linear"] == {"int8": 0, "float": 1, "ops": {"Gemm": 1}}
    images = torch.arange(24, dtype=torch.float32).reshape(6, 4) / 20  # on the input's grid
    before = ort_predict(ort_session(path, threads=1), images)

    assert qdq_onnx.complete_for_onnx_runtime(path, batches=[]) == {
        "conv_outputs_quantized_before_adds": 0, "linear_biases_quantized": 1,
        "sigmoid_outputs_quantized": 0}
    assert onnx_op_counts(path)["Linear"] == {"int8": 1, "float": 0, "ops": {"QGemm": 1}}
    model = onnx.load(str(path))
    steps = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer
             if i.data_type == TensorProto.INT32 and i.dims == [3]}
    step = (INPUT_SCALE * WEIGHT_SCALES).astype(np.float32)
    assert [list(v) for v in steps.values()] == [list(np.round(np.float32(bias) / step)),
                                                 [0, 0, 0]]
    after = ort_predict(ort_session(path, threads=1), images)
    # Only the bias moved, each by at most half its step.
    assert (after - before).abs().max() <= float(step.max()) / 2 + 1e-5
    assert (after - before).abs().max() > 0.00005  # 0.01307 is 0.35 of its step of 0.0002 off


@pytest.mark.parametrize("bias, alpha", [([0.5, -0.25, 0.013], 2.0),  # alpha scales the product
                                         ([1e9, 0.0, 0.0], 1.0)])  # 2e9 steps: over int32
def test_a_linear_whose_bias_cannot_be_int32_is_left_as_it_is(tmp_path, bias, alpha):
    path = tmp_path / "linear.onnx"
    _linear_qdq_model(path, bias, alpha=alpha)
    written = path.read_bytes()
    assert qdq_onnx.complete_for_onnx_runtime(path, batches=[]) == {
        "conv_outputs_quantized_before_adds": 0, "linear_biases_quantized": 0,
        "sigmoid_outputs_quantized": 0}
    assert path.read_bytes() == written


def _agree(reference, logits) -> bool:
    return compare_logits(reference, logits)["top1_agreement"] >= 0.95


class _MobileBlock(torch.nn.Module):
    """efficientnet_b0's and mobilenet_v3's activations in one small model: conv + BatchNorm
    + SiLU, a squeeze-excitation (conv, SiLU, conv, Sigmoid, multiply), conv + BatchNorm +
    Hardswish, and a classifier."""

    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.stem = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.SiLU())
        self.squeeze = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(8, 4, 1), nn.SiLU(),
                                     nn.Conv2d(4, 8, 1), nn.Sigmoid())
        self.tail = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8),
                                  nn.Hardswish())
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        x = self.stem(x)
        x = self.tail(x * self.squeeze(x))
        return self.head(x.mean((2, 3)))


@pytest.mark.slow
@pytest.mark.parametrize("before_activations", [True, False])
def test_the_qat_graph_runs_every_conv_in_int8_in_onnx_runtime_and_openvino(
        tmp_path, monkeypatch, before_activations):
    """QAT fake-quantizes each conv output that feeds SiLU, Hardswish or Sigmoid, where ONNX
    Runtime and OpenVINO need it quantized to run the conv in int8: all four convs of the
    block run in int8 in both. Without that pass (X86InductorQuantizer alone quantizes after
    the activation) ONNX Runtime ran none of them in int8."""
    from stages.runtimes import onnx_export, openvino, pt2e

    if not before_activations:
        monkeypatch.setattr(pt2e, "annotate_outputs_before_activations", lambda *a: 0)
    torch.manual_seed(0)
    spec = {"model": "block", "in_channels": 1, "image_size": 8}
    graph = pt2e.prepare_qat(pt2e.export_graph(_MobileBlock(), spec, train=True),
                             pt2e.pt2e_options(qat=True))
    images = torch.randn(64, 1, 8, 8)
    with torch.no_grad():
        graph(images)  # the observers see one training batch
    converted = pt2e.convert(graph)
    path = tmp_path / "qat.onnx"
    onnx_export.export_onnx(converted, images[:2], path)
    qdq_onnx.complete_for_onnx_runtime(path, [images])
    reference = converted(images).detach()
    assert _agree(reference, ort_predict(ort_session(path, threads=1), images))
    ort_convs = onnx_op_counts(path)["Conv"]
    compiled = openvino.compile_model(openvino.core().read_model(str(path)), threads=1)
    openvino_convs = openvino.runtime_op_counts(compiled)["Conv"]
    if before_activations:
        assert ort_convs == {"int8": 4, "float": 0, "ops": {"QLinearConv": 4}}
        assert openvino_convs == {"int8": 4, "float": 0}
        assert _agree(reference, openvino.runner(compiled)[0](images))
    else:
        assert ort_convs["int8"] == 0


def _silu_qdq_model(path, zero_point=np.uint8(128)) -> None:
    """x * sigmoid(x) twice over a dequantized input, as torchao's QAT export writes SiLU: the
    Sigmoid's output float. The first product is quantized (what a following conv reads), the
    second leaves the graph as it is."""
    inits = [numpy_helper.from_array(np.float32(0.05), "s"),
             numpy_helper.from_array(zero_point, "z")]
    nodes = [helper.make_node("QuantizeLinear", ["input", "s", "z"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["x"]),
             helper.make_node("Sigmoid", ["x"], ["gate"]),
             helper.make_node("Mul", ["x", "gate"], ["silu"]),
             helper.make_node("QuantizeLinear", ["silu", "s", "z"], ["silu_q"]),
             helper.make_node("DequantizeLinear", ["silu_q", "s", "z"], ["quantized"]),
             helper.make_node("Sigmoid", ["x"], ["gate_2"]),
             helper.make_node("Mul", ["x", "gate_2"], ["plain"])]
    value = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "silu", [value("input", TensorProto.FLOAT, [None, 8])],
                              [value("quantized", TensorProto.FLOAT, [None, 8]),
                               value("plain", TensorProto.FLOAT, [None, 8])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def _ops_ort_runs(path) -> list[str]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.optimized_model_filepath = str(path.with_suffix(".optimized.onnx"))
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return [node.op_type for node in onnx.load(options.optimized_model_filepath).graph.node]


def test_a_sigmoid_between_quantized_tensors_gets_its_fixed_range_pair_and_runs_in_int8(tmp_path):
    """efficientnet_b0's ort-qat in miniature: ONNX Runtime ran SiLU in float between a
    DequantizeLinear and a QuantizeLinear; with a [0, 1] pair after the Sigmoid it runs
    QLinearSigmoid and QLinearMul. A Sigmoid whose product stays float is left as it is."""
    path = tmp_path / "silu.onnx"
    _silu_qdq_model(path)
    assert "QLinearSigmoid" not in _ops_ort_runs(path)
    images = torch.linspace(-6, 6, 64).reshape(8, 8)
    session = ort_session(path, threads=1)
    before = session.run(None, {"input": images.numpy()})
    assert qdq_onnx.complete_for_onnx_runtime(path, []) == {
        "conv_outputs_quantized_before_adds": 0, "linear_biases_quantized": 0,
        "sigmoid_outputs_quantized": 1}
    ops = _ops_ort_runs(path)
    assert ops.count("QLinearSigmoid") == 1 and ops.count("QLinearMul") == 1
    assert ops.count("Sigmoid") == 1 and ops.count("Mul") == 1  # the float product's
    after = ort_session(path, threads=1).run(None, {"input": images.numpy()})
    assert np.abs(after[0] - before[0]).max() <= 0.05 + 1e-6  # at most one output step
    assert np.array_equal(after[1], before[1])
    # What openvino-qat reads: the same model without the pair (OpenVINO fuses x * sigmoid(x)).
    model = onnx.load(str(path))
    assert qdq_onnx.without_sigmoid_pairs(model) == 1
    _silu_qdq_model(tmp_path / "original.onnx")
    original = onnx.load(str(tmp_path / "original.onnx"))
    assert model.graph == original.graph


def test_openvino_qat_converts_ort_qat_without_its_sigmoid_pairs(tmp_path):
    """The file make_openvino_qat hands OpenVINO: a copy without the pairs in the stage's
    scratch folder, ort-qat itself untouched; ort-qat itself where it has none."""
    from types import SimpleNamespace

    from stages.runtimes.qat import _ort_qat_for_openvino

    path = tmp_path / "ort-qat.onnx"
    _silu_qdq_model(path)
    qdq_onnx.complete_for_onnx_runtime(path, [])
    written = path.read_bytes()
    ctx = SimpleNamespace(run=SimpleNamespace(verified_path=lambda name: path),
                          scratch=tmp_path / "scratch")
    ctx.scratch.mkdir()
    read, left_out = _ort_qat_for_openvino(ctx)
    assert left_out == 1 and read.parent == ctx.scratch and path.read_bytes() == written
    assert "QLinearSigmoid" not in _ops_ort_runs(read)
    _silu_qdq_model(path)
    assert _ort_qat_for_openvino(ctx) == (path, 0)


def test_a_sigmoid_between_int8_tensors_is_left_as_it_is(tmp_path):
    """The pair is uint8, and ONNX Runtime fuses a multiply only in one type: where the
    activations are int8 (signed zero points) no pair is added."""
    path = tmp_path / "silu.onnx"
    _silu_qdq_model(path, zero_point=np.int8(0))
    assert qdq_onnx.complete_for_onnx_runtime(path, [])["sigmoid_outputs_quantized"] == 0
