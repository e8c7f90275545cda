"""Static int8 choices: --auto, the sensitivity fallback, and dynamic int8 on a Linear-heavy
model."""
import dataclasses

import pytest
import torch

from pipeline.config import QuantizeConfig, TrainConfig
from stages import quantize, runtimes, train
from stages.data.datasets import splits_of_run
from stages.measure.evaluate import predict
from stages.quantization import tuning
from stages.run import artifacts, files
from stages.runtimes.pytorch import load_float_module
from tests.conftest import TINY_TRAIN

# A backend for tests that script tuning.score: it builds and predicts nothing, and (without
# layers) has no per-layer fallback.
NOTHING_BUILT = tuning.Backend(build=lambda options, float_layers: None,
                               predict=lambda model, images: None)


def _outlier_run(tmp_path):
    """A trained smallcnn whose second block's output has one channel 1000x larger, and the
    next convolution scaled down to match: the float model computes the same function, but
    one per-tensor int8 range must now span the outlier and the normal channels alike."""
    run = artifacts.create_run(tmp_path, "outliers")
    train.run(TrainConfig(**TINY_TRAIN | {"epochs": 3, "baseline": False}), run)
    model = load_float_module(run, "amp")
    images = splits_of_run(run).val.tensors[0]
    with torch.no_grad():
        reference = predict(model, images)
        channel = int(model[:6](images).mean(dim=(0, 2, 3)).argmax())
        model[4].weight[channel] *= 1000.0
        model[4].bias[channel] *= 1000.0
        model[7].weight[:, channel] /= 1000.0
        assert torch.allclose(predict(model, images), reference, atol=1e-2)
    entry = run.entry("amp")
    path = run.root / entry["path"]
    files.atomic_torch_save({"model_spec": entry["model_spec"],
                                 "state_dict": model.state_dict()}, path)
    run.register("amp", path, kind="model", stage="test", config=entry["config"],
                 format="pytorch", model_spec=entry["model_spec"], training=entry["training"],
                 checkpoint_bytes=entry["checkpoint_bytes"])
    return run


@pytest.mark.slow
def test_outliers_miss_the_budget_until_sensitive_layers_stay_float(tmp_path):
    run = _outlier_run(tmp_path)
    quantize.run(QuantizeConfig(methods="torch-static,ort-static,openvino-int8",
                                calibration_samples=256, quiet=True), run)
    for name in ("torch-static", "ort-static", "openvino-int8"):
        info = run.entry(name)["quantization"]
        fallback = info["tuning"]["fallback"]
        assert fallback["plain_drop_points"] > 1.0, (name, fallback)  # plain int8 misses
        assert fallback["met_budget"] and info["tuning"]["chosen"]["worst_drop_points"] <= 1.0
        assert 1 <= len(info["float_layers"]) <= 3 and len(fallback["ranking"]) == 4
        # Ranked in one pass (each layer's own error) for every backend: no model per layer.
        assert fallback["ranked_by"].startswith("one pass")
        assert fallback["ranking"][0]["error"] > fallback["ranking"][-1]["error"] >= 0
        counts = info["op_counts"]
        # The layers kept float are float in what runs, and the rest is still int8.
        floats = sum(c["float"] for c in counts.values())
        assert floats == len(info["float_layers"]), (name, counts, info["float_layers"])
        assert sum(c["int8"] for c in counts.values()) == 4 - floats, (name, counts)


@pytest.mark.slow
@pytest.mark.longest
def test_auto_tries_several_configurations_and_keeps_the_fastest_within_budget(tiny_run,
                                                                                tmp_path):
    from tests.conftest import _copy

    run = _copy(tiny_run["run"], tmp_path / "artifacts")
    # A budget every configuration of the tiny model meets, so that speed alone decides.
    quantize.run(QuantizeConfig(methods="torch-static,ort-static,openvino-int8", auto=True,
                                max_accuracy_drop=20.0, calibration_samples=128, quiet=True),
                 run)
    tried = run.entry("torch-static")["quantization"]["tuning"]["tried"]
    assert [(t["options"]["observer"], t["options"]["equalize"]) for t in tried] == [
        ("histogram", False), ("minmax", False), ("histogram", True)]
    assert len({t["logit_mse"] for t in tried}) == 3  # three real, different models
    ort = run.entry("ort-static")["quantization"]["tuning"]["tried"]
    assert [t["options"]["equalize"] for t in ort] == [  # per-tensor weights are equalized
        not t["options"]["per_channel"] for t in ort]
    for name, count in (("torch-static", 3), ("ort-static", 5), ("openvino-int8", 2)):
        record = run.entry(name)["quantization"]["tuning"]
        assert len(record["tried"]) == count
        assert all(t["drop_points"] <= 20.0 and t["latency_ms_p50"] > 0 for t in record["tried"])
        fastest = min(t["latency_ms_p50"] for t in record["tried"])
        assert record["chosen"]["latency_ms_p50"] == fastest
        assert record["why"].startswith(f"fastest ({fastest:.2f} ms) of {count} configuration")
        assert record["images"] > 300  # validation split plus unused training images
    assert run.entry("ort-static")["quantization"]["format"] == "QDQ"


def test_choose_prefers_the_fastest_within_budget_and_says_when_none_fits():
    def trial(drop, ms, worst=None):
        return tuning.Trial({"types": "u8s8"}, (), None, 0.9, drop,
                            drop if worst is None else worst, 0.0, 1.0, ms)

    best, why = tuning.choose([trial(0.5, 3.0), trial(2.0, 1.0), trial(0.9, 2.0)], 1.0)
    assert best.latency_ms == 2.0 and "fastest (2.00 ms) of 2 configuration(s)" in why
    none, why = tuning.choose([trial(1.5, 1.0)], 1.0)
    assert none is None and "none of 1 configuration(s) stayed within 1 point" in why
    # The budget holds the worst the held-out images allow, not the measured drop: a candidate
    # measured at -0.9 whose flips leave -1.5 possible is not kept over a slower sure one.
    best, _ = tuning.choose([trial(0.9, 1.0, worst=1.5), trial(0.3, 2.0, worst=0.8)], 1.0)
    assert best.latency_ms == 2.0


def test_score_bounds_the_drop_by_the_images_that_flipped():
    """40 of 1,000 held-out images flip: 25 lost and 15 gained, a measured drop of 1.0 point;
    at 95% confidence it may be 1.0 + 1.645 x 0.632 = 2.04 points. A model that flips none
    loses its measured drop and no more."""
    labels = torch.zeros(1000, dtype=torch.long)
    reference_logits = torch.zeros(1000, 2)
    reference_logits[:900, 0] = 1.0  # the float model gets 900 right
    reference_logits[900:, 1] = 1.0
    logits = reference_logits.clone()
    logits[:25] = torch.tensor([0.0, 1.0])  # 25 it got right, now wrong
    logits[900:915] = torch.tensor([1.0, 0.0])  # 15 it got wrong, now right
    reference = {"images": None, "labels": labels, "logits": reference_logits,
                 "accuracy": 0.9}
    backend = tuning.Backend(build=lambda options, layers: None,
                             predict=lambda model, images: logits)
    trial = tuning.score(backend, {}, (), reference)
    assert trial.drop_points == pytest.approx(1.0)
    assert trial.worst_drop_points == pytest.approx(1.0 + 1.645 * 0.6317, abs=1e-3)
    assert trial.agreement == pytest.approx(0.96)
    same = dataclasses.replace(backend, predict=lambda model, images: reference_logits)
    assert tuning.score(same, {}, (), reference).worst_drop_points == pytest.approx(0.0)


@pytest.mark.slow
def test_dynamic_int8_makes_a_linear_heavy_model_smaller_with_int8_linear_layers(tmp_path,
                                                                                monkeypatch):
    """Made as on a CPU without VNNI, ort-dynamic's weights are 7-bit (as ort-static's), so
    that AVX2's u8 x s8 products cannot saturate, and its record says so."""
    import onnx
    from onnx import numpy_helper

    from stages.runtimes import onnxruntime as ort_variants

    run = artifacts.create_run(tmp_path, "mixer")
    train.run(TrainConfig(model="tests.stages.quantization.linear_heavy:mixer", epochs=3, lr=0.05,
                          baseline=False, measure_memory=False, quiet=True), run)
    monkeypatch.setattr(ort_variants, "cpu_has_vnni", lambda: False)
    quantize.run(QuantizeConfig(methods="torch-dynamic,ort-dynamic", quiet=True), run)
    assert run.entry("ort-dynamic")["quantization"]["options"]["reduce_range"] is True
    weights = [numpy_helper.to_array(t) for t in onnx.load(str(run.verified_path(
        "ort-dynamic"))).graph.initializer if t.data_type == onnx.TensorProto.INT8]
    assert weights and max(int(abs(w.astype(int)).max()) for w in weights) <= 64
    assert run.shipped_bytes("torch-dynamic") < 0.35 * run.shipped_bytes("amp")
    assert run.shipped_bytes("ort-dynamic") < 0.35 * run.shipped_bytes("onnx-fp32")
    counts = run.entry("torch-dynamic")["quantization"]["op_counts"]["Linear"]
    assert counts["int8"] == 6 and counts["float"] == 0, counts  # six Linear layers
    ort = run.entry("ort-dynamic")["quantization"]["op_counts"]["Linear"]
    # Counted in the graph ORT runs: it fuses the activation's quantization into the product.
    assert ort["int8"] == 6 and set(ort["ops"]) == {"DynamicQuantizeMatMul"}, ort
    images = splits_of_run(run).val.tensors[0][:64]
    float_logits = runtimes.load(run, "amp", 1).predict(images)
    for name in ("torch-dynamic", "ort-dynamic"):
        logits = runtimes.load(run, name, 1).predict(images)
        assert (logits.argmax(1) == float_logits.argmax(1)).float().mean() >= 0.95, name


def test_trials_built_from_one_export_equal_trials_exported_afresh():
    """The per-layer fallback exports the model once and copies it per trial: a trial must
    not change the export the next one starts from."""
    from stages.models.builtin import smallcnn
    from stages.runtimes import pt2e

    torch.manual_seed(0)
    model = smallcnn(10, 1).eval()
    spec = {"model": "smallcnn", "num_classes": 10, "in_channels": 1, "image_size": 8}
    calibration = [torch.rand(32, 1, 8, 8) for _ in range(2)]
    images = torch.rand(64, 1, 8, 8)
    options = pt2e.pt2e_options()
    exported = pt2e.export_graph(model, spec)
    layer = pt2e.layer_names(model)[1]

    def logits(float_layers, exported=None):
        return predict(pt2e.quantize_pt2e(model, spec, options, calibration,
                                          float_layers, exported=exported), images)

    first = logits((), exported)
    with_float_layer = logits((layer,), exported)
    assert not torch.equal(first, with_float_layer)
    assert torch.equal(logits((), exported), first)
    assert torch.equal(logits(()), first)
    assert not any("activation_post_process" in name for name, _ in exported.named_modules())


def test_labels_name_every_choice_a_configuration_makes():
    assert tuning.label({"preset": "PERFORMANCE"}) == "performance preset"
    assert tuning.label({"per_channel": True, "weight_bits": 7}) == "per-channel 7-bit weights"
    assert tuning.label({"per_channel": False, "weight_bits": 8}) == "per-tensor"
    assert tuning.label({}) == "default"  # not an empty name before ": accuracy change"
    assert tuning.label({"per_channel": True, "weight_bits": 8, "float_depthwise": True}) == (
        "per-channel depthwise in float")
    assert tuning.label({"per_channel": True, "float_depthwise": False}) == "per-channel"


def _scripted_fallback(monkeypatch, layers, logit_mse_of, errors=None, deadline=None):
    """keep_sensitive_layers_float with every trial scored by logit_mse_of(float_layers),
    each 0.01 of logit error costing one point; returns its record and the trials it built."""
    built = []

    def score(backend, options, float_layers, reference):
        built.append(tuple(float_layers))
        mse = logit_mse_of(tuple(float_layers))
        return tuning.Trial(options, tuple(float_layers), None, 0.9, mse * 100, mse * 100, mse,
                            0.9)

    monkeypatch.setattr(tuning, "score", score)
    record = tuning.keep_sensitive_layers_float(NOTHING_BUILT, {}, layers, {}, budget_points=1.0,
                                                errors=errors, deadline=deadline)
    return record, built


def test_with_one_pass_errors_the_fallback_builds_no_model_to_rank_layers(monkeypatch):
    """30 layers: the per-layer ranking built 31 models before keeping any in float; ranked
    by their own quantization error, the pass builds the all-int8 model and then one per
    layer it tries, most sensitive first."""
    layers = [f"conv{i}" for i in range(30)]
    errors = {layer: 0.001 * i for i, layer in enumerate(layers)}  # conv29 the most sensitive

    def logit_mse(float_layers):
        return 0.03 - 0.011 * len({"conv29", "conv28"} & set(float_layers))

    record, built = _scripted_fallback(monkeypatch, layers, logit_mse, errors=errors)
    assert built == [(), ("conv29",), ("conv29", "conv28")]
    assert record["met_budget"] and record["ranked_by"].startswith("one pass")
    assert [r["layer"] for r in record["ranking"][:3]] == ["conv29", "conv28", "conv27"]
    assert record["ranking"][0]["error"] == pytest.approx(0.029)


def test_the_fallback_keeps_in_float_only_layers_the_configuration_quantizes(monkeypatch):
    """One-pass errors cover every layer; a configuration that already keeps some in float
    (torch-static's depthwise convolutions without VNNI) offers the fallback only the rest."""
    errors = {"conv0": 0.1, "dw1": 0.9, "conv2": 0.2, "conv3": 0.05}

    def logit_mse(float_layers):
        return 0.03 - 0.011 * len({"conv2", "conv0"} & set(float_layers))

    offered = ["conv0", "conv2", "conv3"]
    record, built = _scripted_fallback(monkeypatch, offered, logit_mse, errors=errors)
    assert built == [(), ("conv2",), ("conv2", "conv0")]
    assert [r["layer"] for r in record["ranking"]] == ["conv2", "conv0", "conv3"]
    # Errors under none of the backend's names: ranked by building, not left unranked.
    record, built = _scripted_fallback(monkeypatch, offered, logit_mse, errors={"dw1": 0.9})
    assert record["ranked_by"].startswith("one model per layer") and ("conv0",) in built
    assert record["met_budget"]


def test_the_fallback_stops_when_its_time_is_spent(monkeypatch):
    import time

    layers = [f"conv{i}" for i in range(10)]
    record, built = _scripted_fallback(monkeypatch, layers, lambda fl: 0.05,
                                       errors={layer: 1.0 for layer in layers},
                                       deadline=time.monotonic() - 1)
    assert built == [()] and not record["met_budget"]
    assert record["stopped"] == "--tuning-time spent after 0 trial(s)"


def test_a_time_boxed_search_tries_what_it_can_and_keeps_nothing_outside_the_budget(monkeypatch):
    def score(backend, options, float_layers, reference):
        time.sleep(0.02)
        return tuning.Trial(options, tuple(float_layers), None, 0.9, 3.0, 3.0, 0.03, 0.9)

    import time

    monkeypatch.setattr(tuning, "score", score)
    monkeypatch.setattr(tuning, "time_trials", lambda backend, trials, shape: None)
    candidates = [{"types": "u8s8", "per_channel": pc} for pc in (False, True)]
    backend = dataclasses.replace(NOTHING_BUILT, layers=lambda options: ["conv0"])
    chosen, record = tuning.tune(backend, candidates,
                                 {"labels": [0] * 5, "images": torch.zeros(5, 1, 8, 8)}, 1.0,
                                 seconds=0.01)
    assert chosen is None and record["chosen"] is None
    assert record["not_tried"] == ["u8s8 per-channel"] and len(record["tried"]) == 1
    assert "fallback" not in record  # no time left for it, and the record says so
    assert record["why"].endswith("--tuning-time spent before u8s8 per-channel could be tried; "
                                  "--tuning-time spent before layers could be kept in float")


def test_a_backend_without_layers_has_no_fallback_and_keeps_nothing_beyond_the_budget(
        monkeypatch):
    """Dynamic int8 is scored as one configuration: beyond the budget it is not kept, and the
    record names how close it came, without a layer search it cannot do."""
    monkeypatch.setattr(tuning, "score", lambda backend, options, float_layers, reference:
                        tuning.Trial(options, (), None, 0.1, 80.0, 80.0, 4.0, 0.1))
    chosen, record = tuning.tune(NOTHING_BUILT, [{"per_channel": False}],
                                 {"labels": [0] * 5, "images": torch.zeros(5, 1, 8, 8)}, 1.0)
    assert chosen is None and record["chosen"] is None and "fallback" not in record
    assert record["closest"]["drop_points"] == 80.0
    assert record["why"] == ("none of 1 configuration(s) stayed within 1 point(s) of the float "
                             "model on the held-out images at 95% confidence")


def test_the_fallback_starts_from_the_search_s_closest_trial_without_rebuilding_it(monkeypatch):
    """Two configurations miss the budget; the fallback goes on from the closer one as the
    search scored it: one all-int8 model per configuration, then one per layer tried."""
    built = []

    def score(backend, options, float_layers, reference):
        built.append((options["per_channel"], tuple(float_layers)))
        drop = 0.5 if float_layers else (3.0 if options["per_channel"] else 2.0)
        return tuning.Trial(options, tuple(float_layers), None, 0.9, drop, drop, drop / 100, 0.9)

    monkeypatch.setattr(tuning, "score", score)
    monkeypatch.setattr(tuning, "time_trials", lambda backend, trials, shape: None)
    backend = dataclasses.replace(NOTHING_BUILT, layers=lambda options: ["conv0", "conv1"],
                                  errors=lambda options: {"conv0": 0.2, "conv1": 0.1})
    candidates = [{"per_channel": pc} for pc in (False, True)]
    chosen, record = tuning.tune(backend, candidates,
                                 {"labels": [0] * 5, "images": torch.zeros(5, 1, 8, 8)}, 1.0)
    assert built == [(False, ()), (True, ()), (False, ("conv0",))]
    assert chosen.float_layers == ("conv0",) and record["fallback"]["plain_drop_points"] == 2.0


def test_layers_that_help_only_together_are_kept_float_together(monkeypatch):
    """As in the outlier model: keeping float the convolution that makes an outlier channel, or
    the one that reads it, alone brings the logits no closer; the two together do. (The pass
    that added a layer only where the logits came 1% closer kept neither.)"""
    layers = [f"conv{i}" for i in range(6)]
    errors = {layer: 0.1 * i for i, layer in enumerate(layers)}  # conv5, conv4 first

    def logit_mse(float_layers):
        return 0.005 if {"conv5", "conv4"} <= set(float_layers) else 0.05

    record, built = _scripted_fallback(monkeypatch, layers, logit_mse, errors=errors)
    assert record["met_budget"] and set(record["trial"].float_layers) == {"conv5", "conv4"}
    assert built == [(), ("conv5",), ("conv5", "conv4")] and record["stopped"] == "budget met"


def test_the_fallback_narrows_down_to_the_fewest_layers_that_meet_the_budget(monkeypatch):
    """Five of twenty needed: counts 1, 2, 4 miss, 8 meets, then 6 and 5 meet: six trials,
    where one layer at a time took five and, with fifteen needed, fifteen."""
    layers = [f"conv{i}" for i in range(20)]
    errors = {layer: float(i) for i, layer in enumerate(layers)}

    record, built = _scripted_fallback(monkeypatch, layers,
                                       lambda fl: 0.005 if len(fl) >= 5 else 0.05, errors=errors)
    assert record["float_counts_tried"] == [1, 2, 4, 8, 6, 5]
    assert record["trial"].float_layers == ("conv19", "conv18", "conv17", "conv16", "conv15")
    assert record["met_budget"] and len(built) == 1 + 6


def test_a_fallback_that_cannot_meet_the_budget_stops_after_a_few_trials(monkeypatch):
    """Nothing meets it (resnet18 at 224x224 after one epoch, where one layer at a time made
    20 trials per backend): 1, 2, 4, 8, 16 and 29 of 30 layers, and the closest is recorded."""
    layers = [f"conv{i}" for i in range(30)]
    errors = {layer: float(i) for i, layer in enumerate(layers)}

    record, built = _scripted_fallback(
        monkeypatch, layers, lambda fl: 0.02 + 0.001 * abs(len(fl) - 4), errors=errors)
    assert [len(b) for b in built] == [0, 1, 2, 4, 8, 16, 29]
    assert not record["met_budget"] and len(record["trial"].float_layers) == 4
    assert record["stopped"] == ("missed even with the 29 most sensitive of 30 layers in "
                                 "float; all of them would be the float model")


def test_the_fallback_stops_as_soon_as_the_budget_holds(monkeypatch):
    layers = [f"conv{i}" for i in range(10)]

    def logit_mse(float_layers):
        return 0.03 - 0.011 * len(float_layers) if "conv0" not in float_layers else 0.05

    record, built = _scripted_fallback(monkeypatch, layers, logit_mse)
    assert record["met_budget"] and len(record["trial"].float_layers) == 2
    assert len(built) == 1 + 10 + 2 and record["stopped"] == "budget met"


def test_the_fallback_never_keeps_every_layer_float(monkeypatch):
    """Only the float model itself meets the budget (a budget of 0 points did that to smallcnn
    under torchrun): the fallback stops one layer short and keeps nothing, where an int8
    variant with nothing in int8 would have been registered and failed the stage."""
    layers = ["conv0", "conv1", "conv2"]

    def logit_mse(float_layers):
        return 0.0 if len(float_layers) == 3 else 0.05 - 0.01 * len(float_layers)

    record, built = _scripted_fallback(monkeypatch, layers, logit_mse)
    assert not record["met_budget"] and len(record["trial"].float_layers) == 2
    assert ("conv0", "conv1", "conv2") not in [tuple(sorted(b)) for b in built]
    assert record["stopped"] == ("missed even with the 2 most sensitive of 3 layers in "
                                 "float; all of them would be the float model")
