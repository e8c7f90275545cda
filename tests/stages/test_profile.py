"""Where the time goes: each runtime's profiler on real variants, and the report's grouping."""
import pytest
import torch

from stages import runtimes
from stages.report import profile
from tests.conftest import FROM_QUANTIZE


@pytest.mark.parametrize("operator, kind", [
    ("QLinearConv", "convolution"), ("Convolution (I8)", "convolution"),
    ("onednn::qconv2d_pointwise", "convolution"), ("aten::mkldnn_convolution", "convolution"),
    ("QGemm", "matrix product"), ("onednn::qlinear_pointwise", "matrix product"),
    ("FullyConnectedQuantizedLegacy (I8)", "matrix product"), ("aten::addmm", "matrix product"),
    ("QuantizeLinear", "quantize/dequantize"), ("DequantizeLinear", "quantize/dequantize"),
    ("quantized_decomposed::quantize_per_tensor", "quantize/dequantize"),
    ("FakeQuantize", "quantize/dequantize"), ("quantized::max_pool2d", "pooling"),
    ("QLinearAdd", "element-wise (activations, add, norm)"), ("NhwcMaxPool", "pooling"),
    ("Reorder (FP32)", "layout (reorder, copy, reshape)"), ("aten::copy_", "layout (reorder, "
                                                                          "copy, reshape)"),
    ("## Call CompiledFxGraph None ##", "compiled graph's own code"),
    ("Subgraph", "compiled graph's own code"), ("ShapeOf", "other"),
    ("Convert (U8)", "quantize/dequantize"), ("DynamicQuantizeMatMul", "matrix product"),
    ("MatMulInteger", "matrix product"),
])
def test_operators_of_every_runtime_group_into_the_same_kinds(operator, kind):
    assert profile.kind_of(operator) == kind


# Inductor's compiled variants share one profiling path (torch.profiler over the compiled
# code): torch-static stands for them, as the one that also names its int8 kernels, so that
# fp32-compiled, amp-compiled and torch-dynamic are not compiled again here.
COMPILED_BESIDE_TORCH_STATIC = ("fp32-compiled", "amp-compiled", "torch-dynamic")


@pytest.mark.parametrize("name", [n for n in FROM_QUANTIZE
                                  if n not in COMPILED_BESIDE_TORCH_STATIC])
def test_every_runtime_profiles_its_variant_with_its_own_profiler(tiny_run, name):
    run = tiny_run["run"]
    loaded = runtimes.load(run, name, 1)
    operators = loaded.profile(torch.randn(4, 1, 8, 8), 3)
    assert operators and all(ms > 0 for ms in operators.values())
    kinds = {profile.kind_of(op) for op in operators}
    # Every variant of the tiny CNN convolves; int8 ones run some int8 kernel by name.
    assert "convolution" in kinds, operators
    runtime = runtimes.VARIANTS[name].runtime
    if runtime == "openvino":
        assert any(op.startswith("Convolution (") for op in operators), operators
        if name == "openvino-int8":
            assert "Convolution (I8)" in operators or "Convolution (U8)" in operators
    if name in ("ort-static",):
        assert "QLinearConv" in operators, operators
    if name == "torch-static":
        assert any("qconv" in op for op in operators), operators


def _row(name, int8, p50, ratio, best_float):
    return {"name": name, "int8": int8, "latency_ms": {"32": {"p50": p50}},
            "speedup_vs_best_float": {"32": {"ratio": ratio, "low": ratio * 0.9,
                                             "high": ratio * 1.1, "best_float": best_float}}}


def test_the_recommendation_and_each_slow_int8_variant_are_profiled_against_float():
    rows = [_row("onnx-fp32", False, 10.0, 1.0, "onnx-fp32"),
            _row("ort-static", True, 5.0, 2.0, "onnx-fp32"),
            _row("torch-static", True, 20.0, 0.5, "onnx-fp32"),
            _row("openvino-int8", True, 9.5, 1.05, "onnx-fp32")]  # within noise: not slow
    verdict = {"recommended": "ort-static", "batch_size": 32,
               "per_batch_size": {"32": {"best_float": "onnx-fp32"}}}
    assert profile.chosen_pairs(rows, verdict) == [("ort-static", "onnx-fp32"),
                                                   ("torch-static", "onnx-fp32")]
    asked = []

    class Fake:
        def __init__(self, operators):
            self.profile = lambda batch, calls: asked.append(calls) or operators

    loaded = {"onnx-fp32": Fake({"Conv": 8.0, "Gemm": 2.0}),
              "ort-static": Fake({"QLinearConv": 3.0, "QuantizeLinear": 1.0, "QGemm": 1.0}),
              "torch-static": Fake({"onednn::qconv2d_pointwise": 6.0,
                                    "quantized_decomposed::quantize_per_tensor": 14.0})}
    profiles = profile.measure(loaded, rows, verdict, batch=None)
    assert asked == [20, 20, 20]  # 0.5 s of calls each, at most 20
    first = profiles["tables"][0]
    assert first["variant"] == "ort-static" and first["float"] == "onnx-fp32"
    assert first["rows"][0] == {"kind": "convolution", "float_ms": 8.0, "ms": 3.0, "share": 0.6}
    assert profile.top_operators(profiles, "torch-static") == (
        "quantized_decomposed::quantize_per_tensor 14.00 ms (70%), "
        "onednn::qconv2d_pointwise 6.00 ms (30%)")
    text = "\n".join(profile.markdown(profiles))
    assert "| quantize/dequantize | - | 14.00 | 70% |" in text
    assert "| convolution | 8.00 | 3.00 | 60% |" in text


def test_a_slow_int8_warning_names_the_operators_measured_to_take_the_time():
    from stages.report import diagnosis, recommendation
    from tests.stages.test_report import _row

    rows = [_row("fp32", [10.0] * 6, 0.0, int8=False),
            _row("onnx-fp32", [5.0] * 6, 0.0, int8=False),
            _row("ort-static", [8.0] * 6, 0.0)]
    recommendation.speedups(rows, "fp32", 1.0)
    profiles = {"batch_size": 32, "variants": {"ort-static": {"calls": 5, "operators": {
        "DequantizeLinear": 4.0, "QLinearConv": 3.0, "Conv": 1.0}}}, "tables": []}
    slow = diagnosis.warnings_for(rows, "fp32", 1.0, {}, profiles)[0]
    assert slow.startswith("ort-static is slower than the fastest float variant onnx-fp32")
    assert slow.endswith(" Measured at batch 32, its time goes to DequantizeLinear 4.00 ms (50%), "
                         "QLinearConv 3.00 ms (38%), Conv 1.00 ms (12%).")
    assert "Measured" not in diagnosis.warnings_for(rows, "fp32", 1.0, {})[0]  # none profiled
    # On a CPU without VNNI the upstream cause is said in one line, with the measurement.
    no_vnni = diagnosis.warnings_for(rows, "fp32", 1.0, {}, profiles, vnni=False)[0]
    assert f"; and {diagnosis.NO_VNNI}. Measured at batch 32" in no_vnni
    assert diagnosis.NO_VNNI not in slow


def test_a_slow_int8_warning_at_a_batch_size_not_profiled_splits_call_and_image_costs():
    """mnasnet0_5's torch-static on the VNNI EPYC: 1.06 ms at batch 1 and 1.54 at 32, against
    onnx-fp32's 0.10 and 0.74: slower at both sizes, profiled at 32 only. At batch 1 the line
    through its two p50s says where: per call (1.04 against 0.08 ms), not per image."""
    from stages.measure import timing
    from stages.report import diagnosis, recommendation
    from tests.stages.test_report import _row

    def at(p50_by_size):
        latency = {}
        for size, ms in p50_by_size.items():
            rounds = [[ms / 1000] * 4] * 6  # Timing holds seconds
            latency[size] = timing.Timing(rounds).summary() | {"rounds_ms": rounds}
        return latency

    rows = [_row("fp32", [10.0] * 6, 0.0, int8=False), _row("onnx-fp32", [0.74] * 6, 0.0,
                                                               int8=False),
            _row("torch-static", [1.54] * 6, 0.0)]
    for row, p50 in zip(rows, ({"1": 3.0, "32": 10.0}, {"1": 0.10, "32": 0.74},
                               {"1": 1.06, "32": 1.54})):
        row["latency_ms"] = at(p50)
    recommendation.speedups(rows, "fp32", 1.0)
    profiles = {"batch_size": 32, "variants": {"torch-static": {"calls": 5, "operators": {
        "qconv_pointwise_tensor": 1.1}}}, "tables": []}
    at_one, at_32 = diagnosis.warnings_for(rows, "fp32", 1.0, {}, profiles)
    assert at_one.startswith("torch-static is slower than the fastest float variant onnx-fp32 "
                             "at batch 1")
    assert at_one.endswith(" By its p50 at batch 1 and 32, a call costs it 1.04 ms whatever its "
                           "size and 0.015 ms an image, against 0.08 and 0.021 ms for onnx-fp32:"
                           " at batch 1 the time is lost per call.")
    assert "Measured at batch 32" in at_32 and "By its p50" not in at_32  # the profile says
    rows[2]["latency_ms"] = at({"1": 0.12, "32": 3.0})  # as cheap a call, dearer images
    recommendation.speedups(rows, "fp32", 1.0)
    assert diagnosis.warnings_for(rows, "fp32", 1.0, {})[0].endswith(
        "at batch 1 the time is lost per image.")
    # Slower at batch 8 alone: the line through batch 1 and 32 cannot say where.
    for row, p50 in zip(rows, ({"1": 3.0, "8": 4.0, "32": 10.0},
                               {"1": 0.10, "8": 0.30, "32": 0.74},
                               {"1": 0.09, "8": 0.60, "32": 0.70})):
        row["latency_ms"] = at(p50)
    recommendation.speedups(rows, "fp32", 1.0)
    [at_8] = diagnosis.warnings_for(rows, "fp32", 1.0, {})
    assert "at batch 8" in at_8 and "By its p50" not in at_8


def test_the_report_shows_where_the_recommendations_time_goes(tiny_run):
    data = tiny_run["report"]
    verdict, profiles = data["verdict"], data["profiles"]
    recommended = verdict["recommended"]
    best_float = verdict["per_batch_size"][str(verdict["batch_size"])]["best_float"]
    assert profiles["batch_size"] == verdict["batch_size"]
    assert recommended in profiles["variants"] and best_float in profiles["variants"]
    first = profiles["tables"][0]
    assert first["variant"] == recommended
    assert first["float"] == (None if best_float == recommended else best_float)
    assert sum(row["share"] for row in first["rows"]) == pytest.approx(1.0)
    text = (tiny_run["run"].root / "report" / "report.md").read_text()
    assert "## Where the time goes" in text and f"`{recommended}`" in text


def test_a_profiler_that_fails_costs_its_table_not_the_report():
    rows = [_row("onnx-fp32", False, 10.0, 1.0, "onnx-fp32"),
            _row("ort-static", True, 5.0, 2.0, "onnx-fp32")]
    verdict = {"recommended": "ort-static", "batch_size": 32,
               "per_batch_size": {"32": {"best_float": "onnx-fp32"}}}

    class Broken:
        def profile(self, batch, calls):
            raise RuntimeError("profiler\nunavailable")

    class Working:
        def profile(self, batch, calls):
            return {"Conv": 4.0}

    profiles = profile.measure({"onnx-fp32": Working(), "ort-static": Broken()}, rows, verdict,
                               batch=None)
    assert profiles["tables"] == []  # ort-static's own table cannot be made
    assert profile.failures(profiles) == [
        "ort-static could not be profiled per operator (RuntimeError: profiler unavailable); "
        "its latency stands."]


def test_inductors_compiled_graph_is_named_in_words_and_counted_as_its_own_code():
    """torch.profiler records a compiled graph's call as "## Call CompiledFxGraph <hash> ##":
    efficientnet_b0's torch-qat warning printed that name as its largest operator."""
    from stages.runtimes import profilers

    name = profilers.torch_operator_name("## Call CompiledFxGraph fabc123 ##")
    assert name == "compiled graph (Inductor's own code)"
    assert profile.kind_of(name) == "compiled graph's own code"
    assert profilers.torch_operator_name("onednn::qconv_pointwise") == "onednn::qconv_pointwise"
    # Inductor's C++ wrapper: the C ABI's prefix goes; fused kernels add up by what they fuse.
    name = profilers.torch_operator_name("aoti_torch_cpu__qconv_pointwise_tensor")
    assert name == "qconv_pointwise_tensor" and profile.kind_of(name) == "convolution"
    name = profilers.torch_operator_name("graph_0_cpp_fused_quantize_per_tensor_13")
    assert name == "cpp_fused_quantize_per_tensor"
    assert profile.kind_of(name) == "quantize/dequantize"
    assert profile.kind_of(profilers.torch_operator_name(
        "aoti_torch_cpu__qlinear_pointwise_tensor")) == "matrix product"


def test_variants_not_profiled_are_let_go_before_the_profiler_runs(tiny_run, monkeypatch):
    """The profiler builds a session beside every loaded variant (at 224x224 each holds
    hundreds of MB): only the variants of the chosen pairs stay loaded."""
    from pipeline.config import ReportConfig
    from stages.data.datasets import splits_of_run
    from stages.report import measuring
    from tests.conftest import TINY_REPORT

    report = tiny_run["report"]
    rows = [row for row in report["models"] if row["device"] == "cpu"]
    loaded = {row["name"]: object() for row in rows}
    held = []
    monkeypatch.setattr(profile, "measure", lambda *args, **kwargs: held.append(set(loaded)))
    measuring.profiled(loaded, rows, report["verdict"]["reference"],
                       ReportConfig(**TINY_REPORT), splits_of_run(tiny_run["run"]))
    pairs = profile.chosen_pairs(rows, measuring.verdict(rows, report["verdict"]["reference"],
                                                         ReportConfig().max_accuracy_drop))
    kept = {name for pair in pairs for name in pair if name}
    assert held == [kept] and kept < {row["name"] for row in rows}
