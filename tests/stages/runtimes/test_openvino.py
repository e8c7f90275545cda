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


def test_hard_gate_quantizers_of_a_quantized_model_are_bypassed_and_nothing_else(tmp_path):
    """openvino-qat's step: a model whose HardSigmoid gates were quantized (here by NNCF with
    nothing ignored, as a QAT graph quantizes them) loses those FakeQuantize ops, keeps the
    Sigmoid gate's, and computes nearly what it did."""
    import nncf
    import openvino as ov

    from stages.runtimes import openvino as ov_runtime
    from stages.runtimes.onnx_export import export_onnx

    torch.manual_seed(0)
    path = tmp_path / "se.onnx"
    export_onnx(_Excitation().eval(), torch.randn(2, 1, 8, 8), path)
    images = torch.randn(16, 1, 8, 8)
    quantized = nncf.quantize(ov.convert_model(str(path)),
                              nncf.Dataset([images[i:i + 4].numpy() for i in range(0, 16, 4)]))

    def fed():
        return [op.input_value(0).get_node().get_type_name()
                for op in quantized.get_ordered_ops() if op.get_type_name() == "FakeQuantize"]

    before = fed()
    assert "HardSigmoid" in before  # what the step is for
    logits = ov_runtime.runner(ov_runtime.compile_model(quantized, 1))[0](images)
    assert ov_runtime.unquantize_hard_gates(quantized) == before.count("HardSigmoid")
    after = fed()
    assert "HardSigmoid" not in after and "Sigmoid" in after
    assert len(after) == len(before) - before.count("HardSigmoid")
    unquantized = ov_runtime.runner(ov_runtime.compile_model(quantized, 1))[0](images)
    assert (unquantized - logits).abs().max() < 0.05 * logits.abs().max()
