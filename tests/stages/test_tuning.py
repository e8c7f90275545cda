"""Static int8 choices: --auto, the sensitivity fallback, and dynamic int8 on a Linear-heavy model."""
import torch

from pipeline.config import QuantizeConfig, TrainConfig
from stages import artifacts, bench, export, quantize, train
from tests.conftest import TINY_TRAIN


def _outlier_run(tmp_path):
    """A trained smallcnn whose second block's output has one channel 1000x larger, and the
    next convolution scaled down to match: the float model computes the same function, but
    one per-tensor int8 range must now span the outlier and the normal channels alike."""
    run = artifacts.create_run(tmp_path, "outliers")
    train.run(TrainConfig(**TINY_TRAIN | {"epochs": 3, "baseline": False}), run)
    model = quantize.load_torch_model(run, "amp")
    images = train.splits_of_run(run).val.tensors[0]
    with torch.no_grad():
        reference = train.predict(model, images)
        channel = int(model[:6](images).mean(dim=(0, 2, 3)).argmax())
        model[4].weight[channel] *= 1000.0
        model[4].bias[channel] *= 1000.0
        model[7].weight[:, channel] /= 1000.0
        assert torch.allclose(train.predict(model, images), reference, atol=1e-2)
    entry = run.entry("amp")
    path = run.root / entry["path"]
    artifacts.atomic_torch_save({"model_spec": entry["model_spec"],
                                 "state_dict": model.state_dict()}, path)
    run.register("amp", path, kind="model", stage="test", config=entry["config"],
                 format="pytorch", model_spec=entry["model_spec"], training=entry["training"],
                 checkpoint_bytes=entry["checkpoint_bytes"])
    return run


def test_outliers_miss_the_budget_until_sensitive_layers_stay_float(tmp_path):
    run = _outlier_run(tmp_path)
    quantize.run(QuantizeConfig(methods="torch-static,ort-static", calibration_samples=256,
                                quiet=True), run)
    for name in ("torch-static", "ort-static"):
        info = run.entry(name)["quantization"]
        fallback = info["tuning"]["fallback"]
        assert fallback["plain_drop_points"] > 1.0, (name, fallback)  # plain int8 misses
        assert fallback["met_budget"] and info["tuning"]["chosen"]["drop_points"] <= 1.0
        assert len(info["float_layers"]) == 2 and len(fallback["ranking"]) == 4
        assert fallback["ranking"][0]["logit_mse_gain"] > 0
        counts = info["op_counts"]["Conv"]
        assert counts["float"] == 2 and counts["int8"] == 1  # the rest is still int8


def test_auto_tries_several_configurations_and_keeps_the_fastest_within_budget(tiny_run):
    run = tiny_run["run"]
    quantize.run(QuantizeConfig(methods="torch-static,ort-static", auto=True,
                                calibration_samples=128, quiet=True), run)
    for name, count in (("torch-static", 4), ("ort-static", 5)):
        tuning = run.entry(name)["quantization"]["tuning"]
        assert len(tuning["tried"]) == count
        within = [t for t in tuning["tried"] if t["drop_points"] <= 1.0]
        if within:
            fastest = min(t["latency_ms_p50"] for t in within)
            assert tuning["chosen"]["latency_ms_p50"] == fastest
            assert "fastest" in tuning["why"]
        assert tuning["images"] > 300  # validation split plus unused training images
    assert run.entry("ort-static")["quantization"]["format"] == "QDQ"


def _min_ms(call, repeats=25):
    return bench.measure(call, warmup=3, repeats=repeats, max_seconds=20)["min"]


def test_dynamic_int8_makes_a_linear_heavy_model_smaller_and_faster(tmp_path):
    run = artifacts.create_run(tmp_path, "mixer")
    train.run(TrainConfig(model="mixer", epochs=1, baseline=False, quiet=True), run)
    quantize.run(QuantizeConfig(methods="torch-dynamic,onnx,ort-dynamic", quiet=True), run)
    assert run.entry("torch-dynamic")["bytes"] < 0.35 * run.entry("amp")["bytes"]
    assert run.entry("ort-dynamic")["shipped_bytes"] < 0.35 * run.entry("onnx-fp32")["shipped_bytes"]
    assert run.entry("torch-dynamic")["quantization"]["op_counts"]["Linear"]["float"] == 0
    batch = bench.random_batch((32, 1, 32, 32))
    torch.set_num_threads(2)
    # Minimum of many calls, in one process, one after the other: a ratio, not a timing.
    fp32 = _min_ms(bench.torch_call(quantize.load_torch_model(run, "amp"), batch))
    int8 = _min_ms(bench.torch_call(quantize.load_torch_model(run, "torch-dynamic"), batch))
    assert int8 < 0.8 * fp32, (int8, fp32)
    onnx_fp32 = _min_ms(bench.ort_call(export.ort_session(run.verified_path("onnx-fp32"), 2), batch))
    onnx_int8 = _min_ms(bench.ort_call(export.ort_session(run.verified_path("ort-dynamic"), 2), batch))
    assert onnx_int8 < 0.9 * onnx_fp32, (onnx_int8, onnx_fp32)
