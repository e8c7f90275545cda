import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[3]

# Two OpenVINO variants loaded, then freed in the order they were loaded, then a signal: each
# OpenVINO Core had given the main thread an alternate signal stack of its own and put back
# the one it found when freed, so this order left it pointing at freed memory and the signal
# (Ctrl-C, torchrun's SIGTERM) ended the process with SIGSEGV instead of its handler.
SCRIPT = """
import gc, signal, sys
from stages import runtimes
from stages.run import artifacts

run = artifacts.open_run(sys.argv[1], sys.argv[2])
first = runtimes.load(run, "openvino-fp32", threads=1)
second = runtimes.load(run, "openvino-int8", threads=1)
del first
gc.collect()
del second
gc.collect()
signal.signal(signal.SIGTERM, lambda *args: sys.exit(7))
signal.raise_signal(signal.SIGTERM)
"""


def test_a_signal_after_openvino_models_are_freed_reaches_its_handler(tiny_run):
    run = tiny_run["run"]
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(run.artifacts_dir), run.name],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 7, (done.returncode, done.stderr[-2000:])


class _Excitation(torch.nn.Module):
    """x * hardsigmoid(x) written out (a Hardswish by hand: the exporter writes
    F.hardswish as one HardSwish op), a HardSigmoid squeeze-excitation gate and a Sigmoid one
    (efficientnet's), each multiplying the features."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 8, 3, padding=1)
        self.hard_fc = torch.nn.Conv2d(8, 8, 1)
        self.soft_fc = torch.nn.Conv2d(8, 8, 1)
        self.out = torch.nn.Conv2d(8, 4, 1)

    def forward(self, x):
        x = self.conv(x)
        x = x * torch.nn.functional.hardsigmoid(x)
        x = x * torch.nn.functional.hardsigmoid(self.hard_fc(x.mean((2, 3), keepdim=True)))
        x = x * torch.sigmoid(self.soft_fc(x.mean((2, 3), keepdim=True)))
        return self.out(x).mean((2, 3))


def test_hard_excitation_gates_stay_float_and_nothing_else_does(tmp_path):
    import openvino as ov

    from stages.runtimes import openvino as ov_runtime
    from stages.runtimes.onnx_export import export_onnx

    path = tmp_path / "se.onnx"
    export_onnx(_Excitation().eval(), torch.randn(2, 1, 8, 8), path)
    model = ov.convert_model(str(path))
    gates = ov_runtime.hard_excitation_multiplies(model)
    assert len(gates) == 1  # not x * hardsigmoid(x), not the Sigmoid gate's
    gate = next(op for op in model.get_ordered_ops() if op.get_friendly_name() == gates[0])
    assert "HardSigmoid" in {gate.input_value(i).get_node().get_type_name() for i in range(2)}
    # What quantize builds: the product's NNCF call, with no layers asked to stay float.
    backend = ov_runtime._int8_backend(SimpleNamespace(threads=1), model,
                                       [torch.randn(4, 1, 8, 8) for _ in range(4)])
    quantized = backend.build({"preset": "PERFORMANCE"}, [])
    fed = {op.input_value(0).get_node().get_type_name() for op in quantized.get_ordered_ops()
           if op.get_type_name() == "FakeQuantize"}
    assert "HardSigmoid" not in fed and "Sigmoid" in fed


def test_openvino_runs_global_means_as_avg_pools_and_leaves_other_means(tmp_path):
    """ONNX's GlobalAveragePool (kept 4-D or squeezed) reaches OpenVINO as ReduceMean, which
    means_as_avg_pools rewrites as AvgPool; a mean over channels stays ReduceMean."""
    from stages.runtimes import openvino as ov_runtime
    from stages.runtimes.onnx_export import export_onnx
    from tests.stages.runtimes.test_onnx_export import _Means

    path = tmp_path / "means.onnx"
    export_onnx(_Means().eval(), torch.zeros(2, 3, 9, 7), path)
    model = ov_runtime._openvino().convert_model(str(path))
    images = torch.randn(5, 3, 9, 7)
    before = ov_runtime.runner(ov_runtime.compile_model(model, 1))[0](images)
    assert len(ov_runtime.means_as_avg_pools(model)) == 2
    kinds = [op.get_type_name() for op in model.get_ordered_ops()]
    assert kinds.count("AvgPool") == 2 and kinds.count("ReduceMean") == 1
    after = ov_runtime.runner(ov_runtime.compile_model(model, 1))[0](images)
    assert after.shape == (5, 4)
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)

    # A mean that drops the axes (as another converter may write it) gets its Squeeze.
    opset = ov_runtime._openvino().opset15
    features = opset.parameter([-1, 3, 9, 7], name="x")
    flat = opset.reduce_mean(features, opset.constant([-2, -1], dtype=int), keep_dims=False)
    model = ov_runtime._openvino().Model([flat], [features])
    before = ov_runtime.runner(ov_runtime.compile_model(model, 1))[0](images)
    assert len(ov_runtime.means_as_avg_pools(model)) == 1
    assert [op.get_type_name() for op in model.get_ordered_ops()].count("AvgPool") == 1
    after = ov_runtime.runner(ov_runtime.compile_model(model, 1))[0](images)
    assert after.shape == (5, 3)
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)


def _qdq_gates_model(path):
    """A QDQ model as ort-qat's reads into OpenVINO: features x, a HardSigmoid
    squeeze-excitation gate, a Sigmoid one and x * hardsigmoid(x), each gate's output quantized
    (QuantizeLinear/DequantizeLinear, uint8 in steps of 1/255) before its multiply."""
    import onnx
    from onnx import TensorProto, helper

    nodes, inits = [], [helper.make_tensor("scale", TensorProto.FLOAT, [], [1 / 255]),
                        helper.make_tensor("zero", TensorProto.UINT8, [], [0])]

    def gate(op, source, features, out):
        nodes.extend([helper.make_node(op, [source], [f"{out}_g"]),
                      helper.make_node("QuantizeLinear", [f"{out}_g", "scale", "zero"],
                                       [f"{out}_q"]),
                      helper.make_node("DequantizeLinear", [f"{out}_q", "scale", "zero"],
                                       [f"{out}_d"]),
                      helper.make_node("Mul", [features, f"{out}_d"], [out], name=f"{out}_mul")])

    nodes.append(helper.make_node("ReduceMean", ["x"], ["pooled"], axes=[2, 3], keepdims=1))
    gate("HardSigmoid", "pooled", "x", "hard")
    gate("Sigmoid", "pooled", "hard", "soft")
    gate("HardSigmoid", "soft", "soft", "y")  # x * hardsigmoid(x): a Hardswish, not a gate
    graph = helper.make_graph(
        nodes, "gates", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 3, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 3, 3])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


def test_openvino_qat_bypasses_the_quantizers_of_hard_excitation_gates_alone(tmp_path):
    """openvino-qat's step on a QDQ model read by OpenVINO: the HardSigmoid gate's quantizer
    goes, the Sigmoid gate's and the Hardswish's stay, and the output moves by about a
    quantization step of the gates (half a step of the hard gate, then a step where the
    Hardswish's rounding flips) times the features."""
    import openvino as ov

    from stages.runtimes import openvino as ov_runtime

    _qdq_gates_model(tmp_path / "gates.onnx")
    model = ov.convert_model(str(tmp_path / "gates.onnx"))

    def quantized():
        return sorted(op.input_value(0).get_node().get_type_name()
                      for op in model.get_ordered_ops() if op.get_type_name() == "FakeQuantize")

    assert quantized() == ["HardSigmoid", "HardSigmoid", "Sigmoid"]  # as ONNX Runtime runs it
    x = torch.randn(2, 4, 3, 3) * 4
    before = ov_runtime.runner(ov_runtime.compile_model(model, 1))[0](x)
    assert ov_runtime.unquantize_hard_gates(model) == ["hard_mul"]
    assert quantized() == ["HardSigmoid", "Sigmoid"]
    after = ov_runtime.runner(ov_runtime.compile_model(model, 1))[0](x)
    assert 0 < (after - before).abs().max() <= 2 / 255 * x.abs().max()


def test_a_matmul_of_two_activations_has_no_weight_size():
    """Attention's Q x K^T has no fixed second input: to_shape() raised there and ended the
    stage in openvino-int8's accuracy fallback (a ViT or Swin)."""
    import openvino as ov
    from openvino import opset15 as opset

    from stages.runtimes import openvino

    queries = opset.parameter([-1, 4, 8], ov.Type.f32)
    keys = opset.parameter([-1, 8, 4], ov.Type.f32)
    weights = opset.constant(torch.ones(4, 3).numpy())
    scores = opset.matmul(opset.matmul(queries, keys, False, False), weights, False, False)
    model = ov.Model([scores], [queries, keys])
    assert openvino.weight_sizes(model) == [0, 12]


def test_an_error_openvino_raises_while_predicting_costs_the_variant():
    """ONNX Runtime's own errors while a variant ran were NotMade (the variant lost); OpenVINO's
    request.infer was not wrapped, and its RuntimeError failed the quantize stage."""
    import pytest

    from stages.run.errors import NotMade
    from stages.runtimes import openvino

    def infer(*args, **kwargs):
        raise RuntimeError("Exception from src/plugins/intel_cpu: unsupported layout\nmore")

    compiled = SimpleNamespace(create_infer_request=lambda: SimpleNamespace(infer=infer))
    predict, _ = openvino.runner(compiled)
    with pytest.raises(NotMade, match="^OpenVINO failed: Exception from src/plugins/intel_cpu: "
                                      "unsupported layout$"):
        predict(torch.zeros(2, 1, 8, 8))
