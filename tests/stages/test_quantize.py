"""Every variant of the tiny run: listed, int8 where it says so, reloadable, and checked."""
import copy
import errno
import json
from pathlib import Path

import onnx
import pytest
import torch

from pipeline.config import QatConfig, QuantizeConfig, ReportConfig, TrainConfig
from stages import quantize, runtimes, train
from stages.data.datasets import load_splits
from stages.measure import machine
from stages.measure.evaluate import predict
from stages.run import artifacts, loading
from stages.run.errors import PipelineError, UsageError
from stages.runtimes import inductor, pt2e
from stages.runtimes import onnxruntime as ort_runtime
from stages.runtimes import pytorch as torch_runtime
from tests.conftest import FROM_QUANTIZE, QUANTIZE_METHODS, TINY_TRAIN


def _op_types(path):
    return {node.op_type for node in onnx.load(str(path)).graph.node}


def test_every_variant_is_listed_with_a_matching_sha256_and_its_source(tiny_run):
    run = tiny_run["run"]
    listed = set(run.artifacts())
    assert set(FROM_QUANTIZE) <= listed
    for name in FROM_QUANTIZE:
        run.verified_path(name)
        assert run.entry(name)["stage"] == ("train" if name in ("fp32", "amp") else "quantize")
    parents = {name: run.entry(name)["parent"] for name in FROM_QUANTIZE}
    assert parents["torch-static"] == "amp" and parents["fp32-compiled"] == "amp"
    assert parents["ort-static"] == "onnx-fp32" and parents["openvino-int8"] == "openvino-fp32"


def stored_weight_bytes(run, name: str) -> dict:
    """Bytes of int8 and of float tensors stored in a PT2E graph file or an ONNX model, beside
    the bytes of the float model's Conv/Linear weights: int8 weights are a quarter of those."""
    import numpy as np
    from onnx import numpy_helper

    from stages.runtimes.pytorch import load_float_module

    model = load_float_module(run, "amp")
    weights = sum(m.weight.numel() * 4 for m in model.modules()
                  if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)))
    if run.entry(name)["format"] == "pytorch":
        tensors = list(loading.load_checkpoint(run.verified_path(name))["graph"][
            "tensors"].values())
        sizes = [(t.dtype in (torch.int8, torch.uint8), t.numel() * t.element_size())
                 for t in tensors]
    else:
        graph = onnx.load(str(run.verified_path(name))).graph
        arrays = [numpy_helper.to_array(i) for i in graph.initializer]
        sizes = [(a.dtype in (np.int8, np.uint8), a.nbytes) for a in arrays]
    return {"int8": sum(n for is_int8, n in sizes if is_int8),
            "float": sum(n for is_int8, n in sizes if not is_int8),
            "float_model_weights": weights}


def test_int8_variants_store_their_weights_in_int8_and_count_int8_ops_in_what_runs(tiny_run):
    run = tiny_run["run"]
    for name in ("torch-static", "ort-static"):
        stored = stored_weight_bytes(run, name)
        # Every Conv/Linear weight in one byte (ORT adds a few bytes of zero points), and no
        # float copy: what is float is scales and biases.
        assert stored["float_model_weights"] // 4 <= stored["int8"] < (
            stored["float_model_weights"] // 4 + 64), (name, stored)
        assert stored["float"] < 0.1 * stored["float_model_weights"], (name, stored)
    for name in ("torch-static", "ort-static", "openvino-int8"):
        counts = run.entry(name)["quantization"]["op_counts"]
        assert counts["Conv"] == {**counts["Conv"], "int8": 3, "float": 0}, (name, counts)
    # OpenVINO's weights file holds the int8 weights and a float scale per channel (its .xml,
    # which grows with every quantize node, is most of this tiny model's IR).
    weights = stored_weight_bytes(run, "ort-static")["float_model_weights"]
    int8_bin = run.entry("openvino-int8")["files"][0]["bytes"]
    assert weights // 4 <= int8_bin <= weights // 4 + 2048
    assert run.entry("openvino-fp32")["files"][0]["bytes"] >= weights
    # Dynamic quantization leaves the convolutions float, weights included, and makes the
    # Linear layer int8.
    dynamic = run.entry("torch-dynamic")["quantization"]["op_counts"]
    assert dynamic["Conv"] == {"int8": 0, "float": 3} and dynamic["Linear"]["int8"] == 1
    linear = [m.weight.numel() for m in torch_runtime.load_float_module(run, "amp").modules()
              if isinstance(m, torch.nn.Linear)]
    assert stored_weight_bytes(run, "torch-dynamic")["int8"] == sum(linear)
    assert run.entry("fp32-compiled")["quantization"]["op_counts"]["Conv"]["int8"] == 0


def test_the_openvino_ir_pair_is_listed_and_checked_together(tiny_run):
    run = tiny_run["run"]
    for name in ("openvino-fp32", "openvino-int8"):
        entry = run.entry(name)
        assert entry["path"].endswith(".xml") and entry["files"][0]["path"].endswith(".bin")
        on_disk = [(run.root / path).stat().st_size
                   for path in (entry["path"], entry["files"][0]["path"])]
        assert run.shipped_bytes(name) == sum(on_disk) and min(on_disk) > 0
    assert run.entry("openvino-fp32")["quantization"]["precision_hint"] == "f32"
    parity = run.entry("openvino-fp32")["quantization"]["parity_vs_onnx_fp32"]
    assert parity["max_abs_diff"] < 1e-4 and parity["top1_agreement"] == 1.0


def test_onnx_graphs_have_the_promised_formats(tiny_run):
    run = tiny_run["run"]
    assert {"QuantizeLinear", "DequantizeLinear"} <= _op_types(run.verified_path("ort-static"))
    # Dynamic int8 of the fully connected layer alone: ConvInteger is ORT's slow path.
    dynamic = _op_types(run.verified_path("ort-dynamic"))
    assert {"DynamicQuantizeLinear", "MatMulInteger"} <= dynamic and "ConvInteger" not in dynamic
    assert "QuantizeLinear" not in _op_types(run.verified_path("onnx-fp32"))
    info = run.entry("onnx-fp32")["quantization"]
    assert info["parity_vs_pytorch"]["max_abs_diff"] < 1e-4
    assert info["parity_vs_pytorch"]["top1_agreement"] == 1.0
    static = run.entry("ort-static")["quantization"]
    assert static["format"] == "QDQ" and static["calibration_samples"] == 128


def test_a_pt2e_model_file_is_data_and_loads_the_same_graph_each_time(tiny_run):
    run = tiny_run["run"]
    data = loading.load_checkpoint(run.verified_path("torch-static"))  # weights_only=True
    graph = data["graph"]
    assert graph["format"] == "fx-graph-1" and data["recipe"]["float_layers"] == []
    targets = {n["target"] for n in graph["nodes"] if n["op"] == "call_function"}
    assert "quantized_decomposed.quantize_per_tensor.default" in targets
    assert all(t.split(".")[0] in ("aten", "quantized_decomposed") for t in targets)
    assert any(t.dtype == torch.int8 for t in graph["tensors"].values())
    images = load_splits(TrainConfig(**TINY_TRAIN)).test.tensors[0]
    first = predict(pt2e.load_pt2e(run, "torch-static"), images)
    second = predict(pt2e.load_pt2e(run, "torch-static"), images)
    assert torch.equal(first, second)
    # quantize compiled the file it reloaded and compared it with the graph
    kernels = run.entry("torch-static")["quantization"]["compiled_vs_graph"]
    assert kernels["samples"] == 128 and kernels["top1_agreement"] >= 0.99


@pytest.mark.parametrize("name", ["ort-static", "ort-dynamic", "onnx-fp32", "openvino-int8"])
def test_file_variants_give_the_same_logits_each_time_they_load(tiny_run, name):
    run = tiny_run["run"]
    images = load_splits(TrainConfig(**TINY_TRAIN)).test.tensors[0][:32]
    first = runtimes.load(run, name, threads=1).predict(images)
    second = runtimes.load(run, name, threads=2).predict(images)
    assert first.shape == (32, 10)
    assert torch.allclose(first, second, atol=1e-5)


def test_ort_static_alone_exports_onnx_first_and_unknown_methods_are_refused(tmp_path,
                                                                           monkeypatch):
    """Also: without --calibration-samples, the number for the model's image size is what
    calibration uses and what config.json records (the report's held-out set leaves those
    images out)."""
    from stages.runtimes import context

    run = artifacts.create_run(tmp_path, "only-static")
    train.run(TrainConfig(**TINY_TRAIN | {"epochs": 1, "baseline": False}), run)
    monkeypatch.setattr(context, "default_calibration_samples", {8: 48}.get)
    results = quantize.run(QuantizeConfig(methods="ort-static", quiet=True), run)
    assert list(results) == ["onnx-fp32", "ort-static"]
    assert run.recorded_config("quantize")["calibration_samples"] == 48
    assert run.entry("ort-static")["quantization"]["calibration_samples"] == 48
    assert "torch-static" not in run.artifacts()
    with pytest.raises(UsageError,
                       match="torch-qat, ort-qat, openvino-qat come from 'pipeline qat'"):
        quantize.plan(run, ("torch-qat",))
    with pytest.raises(ValueError, match="--methods 'onnx' is not one of"):
        QuantizeConfig(methods="onnx")


@pytest.mark.slow
def test_an_int8_variant_where_nothing_runs_in_int8_is_refused(cheap_run, monkeypatch):
    """On a run without torch-static (cheap_run: fp32 and ort-static)."""
    # As if Inductor had fallen back to float kernels for every layer.
    monkeypatch.setattr(inductor, "compiled_counts",
                        lambda compiled, batch: {"Conv": {"int8": 0, "float": 3}})
    with pytest.raises(PipelineError, match="torch-static: nothing in the model runs in int8"):
        quantize.run(QuantizeConfig(methods="torch-static", calibration_samples=64,
                                    quiet=True), cheap_run)
    assert "torch-static" not in cheap_run.artifacts()


def test_the_compiled_code_is_read_for_int8_kernels():
    """compiled_counts reads the code Inductor generated: a float model's two convolutions and
    its linear layer run float kernels, the same layers of its PT2E int8 graph oneDNN's int8
    ones (a float fallback would count as float)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3, padding=1),
        torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        torch.nn.Linear(8, 10)).eval()
    spec = {"model": "net", "num_classes": 10, "in_channels": 1, "image_size": 8}
    images = torch.rand(64, 1, 8, 8)
    compiled = inductor.compile_module(copy.deepcopy(model))
    assert inductor.compiled_counts(compiled, images[:4]) == {
        "Conv": {"int8": 0, "float": 2}, "Linear": {"int8": 0, "float": 1}}
    graph = pt2e.quantize_pt2e(model, spec, pt2e.pt2e_options(), [images])
    assert inductor.compiled_counts(inductor.compile_module(graph), images[:4]) == {
        "Conv": {"int8": 2, "float": 0}, "Linear": {"int8": 1, "float": 0}}


def _compiled_against_its_graph(options: dict) -> float:
    """Largest logit difference between a PT2E int8 graph and its compiled kernels, in units of
    the logits' spread. Inputs near the top of their range and weights of one sign make every
    u8 x s8 product large: two of them overflow int16 unless one operand has 7 bits."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10)).eval()
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 1.0)
    spec = {"model": "net", "num_classes": 10, "in_channels": 64, "image_size": 1}
    images = torch.rand(256, 64, 1, 1) * 0.2 + 0.8
    graph = pt2e.quantize_pt2e(model, spec, options, [images[:128]])
    reference = predict(graph, images)
    compiled = inductor.predict_compiled(inductor.compile_module(graph), images)
    return float((compiled - reference).abs().max() / reference.std())


def test_compiled_int8_computes_what_its_graph_says():
    """The kernels must not saturate: on a CPU without VNNI that takes 7-bit weights, on one
    with VNNI full range. Full-range weights on the AMD EPYC here (AVX2) drift by half
    the logits' spread (0.52)."""
    # (which width on which CPU: tests/stages/runtimes/test_pt2e_depthwise.py)
    assert _compiled_against_its_graph(pt2e.pt2e_options()) < 0.05


def test_onnx_runtime_op_counts_are_read_from_the_graph_it_runs(tiny_run):
    run = tiny_run["run"]
    counts = ort_runtime.onnx_op_counts(run.verified_path("ort-dynamic"))
    assert counts["Conv"] == {"int8": 0, "float": 3, "ops": {"Conv": 3}}
    assert counts["Linear"] == {"int8": 1, "float": 0, "ops": {"DynamicQuantizeMatMul": 1}}
    static = ort_runtime.onnx_op_counts(run.verified_path("ort-static"))
    assert static["Conv"] == {"int8": 3, "float": 0, "ops": {"QLinearConv": 3}}
    assert run.entry("ort-static")["quantization"]["op_counts"] == static
    # The same QDQ file with ONNX Runtime's QDQ fusion off runs float kernels between its
    # quantize/dequantize pairs, and is counted so.
    unfused = ort_runtime.onnx_op_counts(run.verified_path("ort-static"),
                                         {"session.disable_quant_qdq": "1"})
    assert unfused["Conv"] == {"int8": 0, "float": 3, "ops": {"Conv": 3}}


def test_a_qdq_model_onnx_runtime_leaves_unfused_is_not_kept(fresh_tiny_run, monkeypatch):
    real = ort_runtime.onnx_op_counts
    monkeypatch.setattr(ort_runtime, "onnx_op_counts", lambda path, entries=None: real(
        path, {"session.disable_quant_qdq": "1"}))
    with pytest.raises(PipelineError, match=r"ort-static: nothing in the model runs in int8 "
                                            r"\(Conv 0/3 int8, Linear 0/1 int8\)"):
        quantize.run(QuantizeConfig(methods="ort-static", calibration_samples=64, quiet=True),
                     fresh_tiny_run)
    assert "ort-static" not in fresh_tiny_run.artifacts()


def test_quantize_records_what_it_chose_from(tiny_run):
    config = json.loads((tiny_run["run"].root / "config.json").read_text())
    assert config["quantize"]["source"] == "amp"
    assert config["quantize"]["methods"] == QUANTIZE_METHODS  # all it makes, in its order


def test_auto_goes_on_to_qat_only_when_every_post_training_variant_misses_the_budget():
    from types import SimpleNamespace

    from stages.quantize import post_training_verdict

    def run_with(drops, not_kept=(), worst=None):
        entries = {name: {"quantization": {"tuning": {"chosen": {
            "drop_points": drop, "worst_drop_points": (worst or {}).get(name, drop)}}}}
            for name, drop in drops.items()}
        entries["onnx-fp32"] = {"quantization": {}}
        return SimpleNamespace(entry=entries.__getitem__, artifacts=lambda: entries,
                               recorded_config=lambda stage: {"not_kept": {
                                   name: "not kept: ..." for name in not_kept}})

    names = ["torch-static", "onnx-fp32", "ort-static"]
    met, why = post_training_verdict(run_with({"torch-static": 2.5, "ort-static": 0.4}), names, 1.0)
    assert met and why.startswith("ort-static kept within 1 point(s)")
    met, why = post_training_verdict(run_with({"torch-static": 2.5, "ort-static": 1.2}), names, 1.0)
    assert not met
    assert why == ("no post-training configuration kept within 1 point(s) of the float model on "
                   "the held-out images at 95% confidence (ort-static -1.20 points at worst, "
                   "torch-static -2.50 points at worst)")
    # What counts is the worst the held-out images allow, not the measured drop.
    met, why = post_training_verdict(run_with({"ort-static": 0.6}, worst={"ort-static": 1.3}),
                                     names, 1.0)
    assert not met and why.endswith("(ort-static -1.30 points at worst)")
    # A search that kept nothing counts as missing the budget.
    met, why = post_training_verdict(run_with({"torch-static": 2.5}, ["ort-static"]), names, 1.0)
    assert not met and why.endswith("(ort-static not kept, torch-static -2.50 points at worst)")
    # A dynamic variant within the budget rescues nothing: its convolutions stay float (on
    # efficientnet_b0, every static backend refused and ort-dynamic kept, QAT was skipped).
    every_static_refused = run_with({"ort-dynamic": 0.1}, ["torch-static", "ort-static"])
    every_static_refused.entry("ort-dynamic")["quantization"]["options"] = {"dynamic": True}
    met, why = post_training_verdict(every_static_refused,
                                     ["ort-dynamic", "torch-static", "ort-static"], 1.0)
    assert not met and why.endswith("(ort-static not kept, torch-static not kept)")
    # Nor do the float variants scored the same way (bf16 within a point of fp32 on any CPU
    # with bf16 instructions had skipped QAT there), made or refused.
    bf16 = run_with({"openvino-bf16": 0.1, "amp-compiled": 0.0, "torch-static": 2.5},
                    ["ort-static", "torch-dynamic"])
    met, why = post_training_verdict(bf16, ["amp-compiled", "torch-dynamic", "torch-static",
                                            "ort-static", "openvino-bf16"], 1.0)
    assert not met and why.endswith("(ort-static not kept, torch-static -2.50 points at worst)")


@pytest.mark.slow
def test_compiled_kernels_that_depart_from_the_graph_are_recorded_and_said(
        fresh_tiny_run, monkeypatch, capsys):
    """The report measures Inductor's compiled code: where it disagrees with the quantized
    graph (efficientnet_b0's int8 kernels did on 2-4% of images), quantize says so."""
    real = inductor.predict_compiled
    monkeypatch.setattr(inductor, "predict_compiled",
                        lambda compiled, images: -real(compiled, images))
    quantize.run(QuantizeConfig(methods="torch-static", calibration_samples=64), fresh_tiny_run)
    kernels = fresh_tiny_run.entry("torch-static")["quantization"]["compiled_vs_graph"]
    assert kernels["samples"] == 128 and kernels["top1_agreement"] < 0.5
    assert (f"torch-static: compiled, its int8 kernels agree with the quantized graph on "
            f"{kernels['top1_agreement']:.1%} of 128 training images") in capsys.readouterr().err


@pytest.mark.slow
def test_a_search_that_finds_nothing_within_the_budget_keeps_nothing_and_says_why(
        cheap_run, monkeypatch, capsys):
    """A budget no configuration meets and no time for the fallback: ort-static is not kept
    (not even the one an earlier quantize made), the stage says so in one line and goes on,
    and the report says why."""
    from stages import report
    from stages.quantization import tuning

    assert "ort-static" in cheap_run.artifacts()  # made by the fixture's quantize
    monkeypatch.setattr(tuning, "_within", lambda trial, budget: False)
    quantize.run(QuantizeConfig(methods="ort-static", calibration_samples=64,
                                tuning_time=0.001), cheap_run)
    assert "ort-static" not in cheap_run.artifacts()
    assert not (cheap_run.root / "quantize" / "ort-static.onnx").exists()
    said = [line for line in capsys.readouterr().err.splitlines() if "not kept" in line]
    assert len(said) == 1 and said[0].startswith(
        "ort-static: not kept: nothing stayed within 1 point(s) of the float model on ")
    why = json.loads((cheap_run.root / "config.json").read_text())["quantize"]["not_kept"]
    assert list(why) == ["ort-static"]
    data = report.run(ReportConfig(batch_sizes=(32,), rounds=3, max_rounds=3, repeats=7,
                                   warmup=1, quiet=True), cheap_run)
    assert "ort-static" not in [m["name"] for m in data["models"]]
    assert f"ort-static (quantize): {why['ort-static']}" in data["warnings"]


def test_dynamic_int8_is_held_to_the_budget_like_the_searched_variants(
        tiny_run, cheap_run, monkeypatch, capsys):
    """Dynamic variants are scored on the held-out images like the searched ones, and one that
    loses more than the budget (mobilenet_v2's ort-dynamic fell to chance on notMNIST) is not
    written: the stage says so in one line each and goes on."""
    from stages.quantization import tuning

    for name in ("torch-dynamic", "ort-dynamic"):
        record = tiny_run["run"].entry(name)["quantization"]["tuning"]
        assert record["images"] > 0 and record["chosen"]["worst_drop_points"] <= 1.0, name
        assert record["why"] == "the one configuration asked for is within the budget"
    monkeypatch.setattr(tuning, "_within", lambda trial, budget: False)
    quantize.run(QuantizeConfig(methods="torch-dynamic,ort-dynamic", calibration_samples=64),
                 cheap_run)
    assert not {"torch-dynamic", "ort-dynamic"} & set(cheap_run.artifacts())
    assert not list((cheap_run.root / "quantize").glob("*-dynamic.*"))
    said = [line for line in capsys.readouterr().err.splitlines() if "not kept" in line]
    assert [line.split(":")[0] for line in said] == ["torch-dynamic", "ort-dynamic"]
    assert all("nothing stayed within 1 point(s) of the float model" in line for line in said)
    why = json.loads((cheap_run.root / "config.json").read_text())["quantize"]["not_kept"]
    assert set(why) == {"torch-dynamic", "ort-dynamic"}


def test_dynamic_int8_of_a_model_whose_fully_connected_layers_are_a_sliver_is_not_made(
        cheap_run, monkeypatch, capsys):
    """smallcnn's Linear holds 2.7% of its weights (tiny_run makes both dynamic variants);
    under a 3% floor it is resnet18's case (0.05%): neither is made, each says why."""
    from stages.runtimes import context

    monkeypatch.setattr(context, "DYNAMIC_INT8_MIN_SHARE", 0.03)
    quantize.run(QuantizeConfig(methods="torch-dynamic,ort-dynamic", calibration_samples=64),
                 cheap_run)
    assert not {"torch-dynamic", "ort-dynamic"} & set(cheap_run.artifacts())
    said = capsys.readouterr().err
    for name, static in (("torch-dynamic", "torch-static"), ("ort-dynamic", "ort-static")):
        assert (f"{name}: not made: the fully connected layers, all that dynamic int8 quantizes,"
                " hold 2.7% of the model's weights and do 0.11% of its work") in said
        assert f"neither size nor speed by 1%; {static} quantizes the rest" in said
    why = json.loads((cheap_run.root / "config.json").read_text())["quantize"]["not_kept"]
    assert set(why) == {"torch-dynamic", "ort-dynamic"}


def test_ort_dynamic_of_a_model_without_fully_connected_layers_says_so(cheap_run, monkeypatch,
                                                                       capsys):
    monkeypatch.setattr(ort_runtime, "DYNAMIC_OP_TYPES", ["LSTM"])  # nothing here to quantize
    quantize.run(QuantizeConfig(methods="ort-dynamic", calibration_samples=64), cheap_run)
    assert "ort-dynamic" not in cheap_run.artifacts()
    assert ("ort-dynamic: not made: the model has no fully connected layer (MatMul), the only "
            "kind dynamic int8 quantizes here") in capsys.readouterr().err


def test_ort_static_is_equalized_by_default_and_torch_static_is_not(tiny_run):
    """smallcnn's first two convolutions meet through a ReLU (the third follows a max pool):
    ort-static's per-tensor weights are made from the equalized model, and the manifest and
    the report say so; torch-static's per-channel weights are not."""
    run = tiny_run["run"]
    ort = run.entry("ort-static")["quantization"]
    assert ort["equalize"] is True and ort["per_channel"] is False
    record = ort["equalization"]
    assert (record["pairs"], record["batchnorms_folded"], record["pairs_left_alone"]) == (1, 3, 0)
    assert record["max_abs_logit_change"] < 1e-4  # design.md, Quantization
    assert run.entry("torch-static")["quantization"]["options"]["equalize"] is False
    assert "equalization" not in run.entry("torch-static")["quantization"]
    text = (run.root / "report" / "report.md").read_text()
    section = text[text.index("## Quantization"):]
    row = next(line for line in section.splitlines() if line.startswith("| `ort-static` | "))
    assert "u8s8 per-tensor minmax QDQ equalized" in row


def test_no_equalize_makes_ort_static_from_the_float_model_as_it_is(cheap_run):
    quantize.run(QuantizeConfig(methods="ort-static", calibration_samples=64, equalize=False,
                                quiet=True), cheap_run)
    plain = cheap_run.entry("ort-static")
    assert plain["quantization"]["equalize"] is False
    assert "equalization" not in plain["quantization"]
    quantize.run(QuantizeConfig(methods="ort-static", calibration_samples=64, quiet=True),
                 cheap_run)
    equalized = cheap_run.entry("ort-static")
    assert equalized["quantization"]["equalize"] is True
    assert equalized["sha256"] != plain["sha256"]  # other int8 weights, not a relabelled file


def test_bf16_variants_are_made_only_where_the_cpu_has_bf16_instructions(fresh_tiny_run,
                                                                          monkeypatch):
    """Elsewhere bf16 is emulated, slower than fp32: neither float contender is made, and the
    run's record says why (the report lists it)."""
    monkeypatch.setattr(machine, "cpu_has_bf16", lambda: False)
    quantize.run(QuantizeConfig(methods="amp-compiled,openvino-bf16", calibration_samples=64,
                                quiet=True), fresh_tiny_run)
    refused = fresh_tiny_run.recorded_config("quantize")["not_kept"]
    assert set(refused) == {"amp-compiled", "openvino-bf16"}
    assert all("this CPU has no bf16 instructions" in why for why in refused.values())
    assert not {"amp-compiled", "openvino-bf16"} & set(fresh_tiny_run.artifacts())
    assert "openvino-fp32" in fresh_tiny_run.artifacts()  # the source was made all the same


def test_a_converter_that_cannot_take_the_model_costs_its_variants_not_the_stage(
        fresh_tiny_run, monkeypatch):
    """torch.export refusing the model costs torch-static; the ONNX exporter refusing it costs
    onnx-fp32 and ort-static, made from it; each says why, and the rest are made."""
    from stages.run.errors import NotMade
    from stages.runtimes import onnx_export, pt2e

    def refuses(*_, **__):
        raise NotMade("torch.export of smallcnn failed: a test's refusal")

    monkeypatch.setattr(pt2e, "export_graph", refuses)
    made = quantize.run(QuantizeConfig(methods="torch-static,ort-static", calibration_samples=64,
                                       quiet=True), fresh_tiny_run)
    not_kept = fresh_tiny_run.recorded_config("quantize")["not_kept"]
    assert not_kept == {"torch-static": "not made: torch.export of smallcnn failed: a test's "
                                        "refusal"}
    assert {"onnx-fp32", "ort-static"} <= set(fresh_tiny_run.artifacts()) and made
    monkeypatch.setattr(onnx_export, "export_onnx", refuses)
    quantize.run(QuantizeConfig(methods="onnx-fp32,ort-static", calibration_samples=64,
                                quiet=True), fresh_tiny_run)
    not_kept = fresh_tiny_run.recorded_config("quantize")["not_kept"]
    assert not_kept["ort-static"] == ("not made: it is made from onnx-fp32, which could not be "
                                      "made")
    assert not {"onnx-fp32", "ort-static"} & set(fresh_tiny_run.artifacts())


def test_onnx_runtime_refusing_a_model_costs_its_variants_not_the_stage(fresh_tiny_run,
                                                                         monkeypatch):
    """ONNX Runtime's own error when it loads or runs a model it was given (an operator or a
    graph it cannot take) was raised as the stage's: quantize stopped there, and torch-static,
    whose compile check is deferred to the end, was never made."""
    import onnxruntime

    def cannot_load(*_, **__):
        raise RuntimeError("[ONNXRuntimeError] : 10 : INVALID_GRAPH : a test's refusal")

    monkeypatch.setattr(onnxruntime, "InferenceSession", cannot_load)
    made = quantize.run(QuantizeConfig(methods="torch-static,onnx-fp32", calibration_samples=64,
                                       quiet=True), fresh_tiny_run)
    assert made == ["torch-static", "onnx-fp32"] and "torch-static" in fresh_tiny_run.artifacts()
    why = fresh_tiny_run.recorded_config("quantize")["not_kept"]["onnx-fp32"]
    assert why.startswith("not made: ONNX Runtime cannot load ") and "INVALID_GRAPH" in why

    class CannotRun:
        def __init__(self, *_, **__):
            pass

        def run(self, *_):
            raise RuntimeError("[ONNXRuntimeError] : 9 : NOT_IMPLEMENTED : a test's kernel")

    monkeypatch.setattr(onnxruntime, "InferenceSession", CannotRun)
    quantize.run(QuantizeConfig(methods="onnx-fp32", calibration_samples=64, quiet=True),
                 fresh_tiny_run)
    assert fresh_tiny_run.recorded_config("quantize")["not_kept"]["onnx-fp32"] == (
        "not made: ONNX Runtime failed: [ONNXRuntimeError] : 9 : NOT_IMPLEMENTED : a test's "
        "kernel")
    assert "onnx-fp32" not in fresh_tiny_run.artifacts()

    def disk_full(*_, **__):  # a write the system refused stays the stage's, said as such
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(onnxruntime, "InferenceSession", disk_full)
    with pytest.raises(PipelineError, match="model.onnx failed: No space left on device"):
        quantize.run(QuantizeConfig(methods="onnx-fp32", calibration_samples=64, quiet=True),
                     fresh_tiny_run)


def test_a_converters_own_error_costs_its_variant_and_what_was_made_from_it_before(
        fresh_tiny_run, monkeypatch):
    """ONNX Runtime's shape inference raising its own error had failed the stage; and an
    onnx-fp32 that can no longer be made left openvino-fp32, made from it by an earlier
    quantize, listed with no source, which failed every report after."""
    from onnxruntime.quantization import shape_inference

    from stages.run.errors import NotMade
    from stages.runtimes import onnx_export

    run = fresh_tiny_run
    quantize.run(QuantizeConfig(methods="openvino-fp32", calibration_samples=64, quiet=True), run)
    assert {"onnx-fp32", "openvino-fp32"} <= set(run.artifacts())

    def fails(*_, **__):
        raise RuntimeError("[ShapeInferenceError] a test's failure\nmore detail")

    monkeypatch.setattr(shape_inference, "quant_pre_process", fails)
    made = quantize.run(QuantizeConfig(methods="ort-static", calibration_samples=64, quiet=True),
                        run)
    assert made == ["ort-static"] and "ort-static" not in run.artifacts()
    assert run.recorded_config("quantize")["not_kept"]["ort-static"] == (
        "not made: ONNX Runtime's quant_pre_process failed: [ShapeInferenceError] a test's "
        "failure")

    def refuses(*_, **__):
        raise NotMade("ONNX export of SmallCNN failed: a test's refusal")

    monkeypatch.setattr(onnx_export, "export_onnx", refuses)
    quantize.run(QuantizeConfig(methods="onnx-fp32", calibration_samples=64, quiet=True), run)
    assert not {"onnx-fp32", "openvino-fp32"} & set(run.artifacts())
    assert run.recorded_config("quantize")["not_kept"]["openvino-fp32"] == (
        "not made: it is made from onnx-fp32, which could not be made")


def test_a_variant_that_runs_its_sources_files_is_made_again_with_it():
    """openvino-bf16 is openvino-fp32's IR under another hint: openvino-fp32 made again alone
    left bf16 listed with the old files' sha256, and the report refused the run."""
    from types import SimpleNamespace

    listed = {"amp": {"path": "train/amp/model.pt"}, "onnx-fp32": {"path": "quantize/model.onnx"},
              "openvino-fp32": {"path": "quantize/openvino-fp32.xml"},
              "openvino-bf16": {"path": "quantize/openvino-fp32.xml"},
              "openvino-int8": {"path": "quantize/openvino-int8.xml"}}
    run = SimpleNamespace(name="fake", artifacts=lambda: listed)
    assert quantize.plan(run, ("openvino-fp32",)) == ["openvino-fp32", "openvino-bf16"]
    assert quantize.plan(run, ("openvino-int8",)) == ["openvino-int8"]


def test_auto_does_not_take_a_variant_its_converter_refused_for_an_accuracy_failure(
        fresh_tiny_run, monkeypatch):
    """torch.export refusing the model is no accuracy failure, and QAT starts from the same
    export: --auto says there is nothing to rescue rather than failing in QAT's export."""
    from stages.run.errors import NotMade
    from stages.runtimes import pt2e

    def refuses(*_, **__):
        raise NotMade("torch.export of smallcnn failed: a test's refusal")

    monkeypatch.setattr(pt2e, "export_graph", refuses)
    made = quantize.run(QuantizeConfig(methods="torch-static", auto=True, calibration_samples=64,
                                       quiet=True), fresh_tiny_run,
                        qat_config=QatConfig(epochs=1, quiet=True))
    assert made == ["torch-static"] and "torch-static" not in fresh_tiny_run.artifacts()
    assert fresh_tiny_run.recorded_config("quantize")["auto_verdict"] == (
        "no static int8 variant was made, so there is nothing for QAT to rescue")


def test_a_variant_refused_by_its_deferred_check_leaves_the_rest_made(fresh_tiny_run,
                                                                      monkeypatch):
    """amp-compiled is scored after the exports; off budget it is refused there, and what is
    checked after it (torch-static) is made and listed all the same."""
    from stages.runtimes.context import QuantContext

    scored = QuantContext.score_without_search

    def off_budget(self, name, *args, **kwargs):
        record = scored(self, name, *args, **kwargs)
        return record | {"chosen": None} if name == "amp-compiled" else record

    monkeypatch.setattr(machine, "cpu_has_bf16", lambda: True)
    monkeypatch.setattr(QuantContext, "score_without_search", off_budget)
    made = quantize.run(QuantizeConfig(methods="amp-compiled,torch-static", calibration_samples=64,
                                       quiet=True), fresh_tiny_run)
    assert made == ["amp-compiled", "torch-static"]
    assert fresh_tiny_run.recorded_config("quantize")["not_kept"]["amp-compiled"].startswith(
        "not kept: nothing stayed within")
    assert "torch-static" in fresh_tiny_run.artifacts()
    assert "amp-compiled" not in fresh_tiny_run.artifacts()


@pytest.mark.skipif(not machine.cpu_has_bf16(), reason="bf16 variants need bf16 instructions")
def test_bf16_variants_are_float_variants_run_in_bf16(tiny_run):
    """On a CPU with bf16 instructions: openvino-fp32's IR under OpenVINO's bf16 hint, and the
    float weights compiled under bf16 autocast, both scored against their float source."""
    rows = {m["name"]: m for m in tiny_run["report"]["models"]}
    for name, source in (("openvino-bf16", "openvino-fp32"), ("amp-compiled", "amp")):
        row = rows[name]
        assert (row["int8"], row["precision"], row["parent"]) == (False, "bf16", source)
        assert row["quantization"]["tuning"]["chosen"] is not None
    assert "bf16 hint" in rows["openvino-bf16"]["serving"]
    assert any("bf16" in kernel for kernel in rows["openvino-bf16"]["kernels"])
    assert rows["amp-compiled"]["serving"].endswith("bf16 autocast")


@pytest.mark.slow
def test_in_a_process_capped_for_training_quantize_runs_without_the_cap(tiny_run, tmp_path,
                                                                        monkeypatch):
    """As in `pipeline train quantize` on an AMX CPU: bf16 training capped oneDNN for the
    chain's process, and quantize scores and times what a deployment runs, without the cap."""
    from stages.run import isolated
    from tests.conftest import _copy

    run = _copy(tiny_run["run"], tmp_path / "artifacts")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    monkeypatch.setenv(isolated.CAPPED_FOR_TRAINING, "AVX512_CORE_BF16")
    made = quantize.run_as_deployed(QuantizeConfig(methods="ort-dynamic", quiet=True), run)
    assert made == ["ort-dynamic"] and "ort-dynamic" in run.artifacts()
    assert run.recorded_config("quantize")["onednn_max_cpu_isa"] == "not capped"
    monkeypatch.delenv(isolated.CAPPED_FOR_TRAINING)  # a cap of the user's own: kept
    quantize.run_as_deployed(QuantizeConfig(methods="ort-dynamic", quiet=True), run)
    assert run.recorded_config("quantize")["onednn_max_cpu_isa"] == "AVX512_CORE_BF16"


@pytest.mark.slow
def test_a_runtime_that_crashes_while_its_variant_is_made_costs_that_variant(fresh_tiny_run,
                                                                             monkeypatch):
    """openvino-fp32's making dies of a real SIGSEGV in quantize's process: the stage
    completes, ort-dynamic is made, openvino-fp32 and openvino-int8 (made from it) are not,
    and config.json says why; the openvino-fp32 an earlier quantize made is dropped, since
    the crashed child may have written over its file."""
    from click.testing import CliRunner

    from pipeline.cli import cli

    run = fresh_tiny_run
    quantize.run(QuantizeConfig(methods="openvino-fp32", quiet=True), run)
    assert "openvino-fp32" in run.artifacts()
    monkeypatch.setattr(quantize, "CHILD", "tests.stages.crashing_child:quantize_crashing")
    result = CliRunner().invoke(cli, ["--artifacts-dir", str(run.artifacts_dir), "--run",
                                      run.name, "quantize", "--methods",
                                      "ort-dynamic,openvino-fp32,openvino-int8"])
    assert result.exit_code == 0, result.output
    assert ("quantize: openvino-fp32: SIGSEGV while making openvino-fp32; making the others "
            "again without it") in result.output
    made = run.artifacts()
    assert "ort-dynamic" in made and not {"openvino-fp32", "openvino-int8"} & set(made)
    not_kept = run.recorded_config("quantize")["not_kept"]
    assert not_kept["openvino-fp32"].startswith("not made: its runtime crashed (SIGSEGV)")
    assert not_kept["openvino-int8"] == ("not made: it is made from openvino-fp32, whose "
                                         "runtime crashed")
    assert run.manifest()["stages"]["quantize"]["status"] == "complete"
    # The crashed child's scratch folder and temporary files are gone.
    assert not list((run.root / "quantize").glob(".*"))


def test_a_source_made_before_a_crash_is_named_with_the_paths_quantize_wrote(fresh_tiny_run,
                                                                             monkeypatch):
    """onnx-fp32, made as openvino-fp32's source by the child that then crashed, is listed;
    the plan made again after the crash no longer needs it, and its path went unsaid."""
    from click.testing import CliRunner

    from pipeline.cli import cli

    run = fresh_tiny_run
    monkeypatch.setattr(quantize, "CHILD", "tests.stages.crashing_child:quantize_crashing")
    result = CliRunner().invoke(cli, ["--artifacts-dir", str(run.artifacts_dir), "--run",
                                      run.name, "quantize", "--methods", "openvino-fp32"])
    assert result.exit_code == 0, result.output
    assert "onnx-fp32" in run.artifacts() and "openvino-fp32" not in run.artifacts()
    assert f"onnx-fp32: {run.root / run.entry('onnx-fp32')['path']}" in result.stdout


@pytest.mark.slow
def test_a_quantize_that_fails_leaves_the_variants_an_earlier_one_made_whole(fresh_tiny_run,
                                                                            monkeypatch):
    """torch-static made again (from fewer calibration images: another file) waits for the
    stage's exports before it is listed; a later variant fails meanwhile. The listed
    torch-static is the earlier one, whole, and nothing unlisted is left in quantize/."""
    import dataclasses

    run = fresh_tiny_run
    before = run.entry("torch-static")["sha256"]

    def fails(ctx):
        raise PipelineError("ort-static: failed")

    monkeypatch.setitem(runtimes.VARIANTS, "ort-static",
                        dataclasses.replace(runtimes.VARIANTS["ort-static"], make=fails))
    with pytest.raises(PipelineError, match="ort-static: failed"):
        quantize.run(QuantizeConfig(methods="torch-static,ort-static", calibration_samples=32,
                                    quiet=True), run)
    run.verified_path("torch-static")  # the file the manifest lists, not a newer one
    assert run.entry("torch-static")["sha256"] == before
    listed = {Path(record["path"]).name for entry in run.artifacts().values()
              for record in [entry, *entry.get("files", [])]}
    assert {p.name for p in (run.root / "quantize").iterdir()} <= listed


def test_a_run_whose_amp_model_train_did_not_finish_is_refused_not_quantized_from_fp32(
        fresh_tiny_run):
    """train makes the fp32 baseline first: where amp then failed, quantize had made every
    variant from the baseline without a word."""
    run = fresh_tiny_run
    assert run.entry("fp32")["stage"] == "train"
    run.unregister("amp")
    with pytest.raises(UsageError, match="run .fresh. has train's fp32 baseline but not its amp "
                                         "model, which quantize starts from .* 'pipeline --run "
                                         "fresh train --resume'"):
        quantize.run(QuantizeConfig(methods="ort-static", quiet=True), run)
    assert not (run.root / "quantize" / "model.onnx").exists()
