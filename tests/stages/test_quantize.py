import onnx
import pytest

from stages.errors import PipelineError
import torch

from pipeline.config import QuantizeConfig, TrainConfig
from stages import artifacts, export, quantize, train
from tests.conftest import TINY_TRAIN

VARIANTS = ["fp32", "amp", "torch-dynamic", "torch-static", "onnx-fp32", "ort-dynamic", "ort-static"]


def _op_types(path):
    return {node.op_type for node in onnx.load(str(path)).graph.node}


def test_every_variant_is_listed_with_a_matching_sha256(tiny_run):
    run = tiny_run["run"]
    for name in VARIANTS:
        entry = run.entry(name)
        assert run.verified_path(name).stat().st_size == entry["bytes"]
    assert run.entry("torch-static")["parent"] == "amp"
    assert run.entry("ort-static")["parent"] == "onnx-fp32"


def test_quantized_files_are_int8_sized_and_rebuild_from_a_state_dict(tiny_run):
    run = tiny_run["run"]
    fp32_bytes = run.entry("fp32")["bytes"]
    for name in ("torch-static", "ort-static", "ort-dynamic"):
        assert run.entry(name)["bytes"] < 0.5 * fp32_bytes, name
    data = artifacts.load_checkpoint(run.verified_path("torch-static"))  # weights_only=True
    assert set(data) >= {"model_spec", "state_dict", "quantization", "backend"}
    assert data["quantization"] == "fx-static-int8"
    assert any(v.dtype == torch.qint8 for v in data["state_dict"].values()
               if isinstance(v, torch.Tensor))


def test_onnx_graphs_have_the_promised_formats(tiny_run):
    run = tiny_run["run"]
    assert {"QuantizeLinear", "DequantizeLinear"} <= _op_types(run.verified_path("ort-static"))
    assert "ConvInteger" in _op_types(run.verified_path("ort-dynamic"))
    assert "QuantizeLinear" not in _op_types(run.verified_path("onnx-fp32"))
    info = run.entry("onnx-fp32")["quantization"]
    assert info["checker"] == "passed"
    assert info["parity_vs_pytorch"]["max_abs_diff"] < 1e-4
    assert info["parity_vs_pytorch"]["top1_agreement"] == 1.0
    static = run.entry("ort-static")["quantization"]
    assert static["format"] == "QDQ" and static["calibration_samples"] == 128


def test_a_torch_static_model_reloads_with_the_predictions_it_had(tiny_run):
    run = tiny_run["run"]
    images = train.load_splits(TrainConfig(**TINY_TRAIN)).test.tensors[0]
    float_model = quantize.load_torch_model(run, "amp")
    calibration = [images[:64]]
    options = quantize.torch_static_options("minmax", per_channel=False)
    model = quantize._fx_int8(float_model, quantize.pytorch_quant_backend(), images[:2],
                              calibration, options, float_layers=("0",))
    path = run.root / "roundtrip.pt"
    artifacts.atomic_torch_save({"model_spec": run.entry("amp")["model_spec"],
                                 "state_dict": model.state_dict(), "quantization": "fx-static-int8",
                                 "backend": quantize.pytorch_quant_backend(), "options": options,
                                 "float_modules": ["0"]}, path)
    run.register("roundtrip", path, kind="model", stage="test")
    reloaded = quantize.load_torch_model(run, "roundtrip")
    assert torch.equal(train.predict(model, images), train.predict(reloaded, images))


@pytest.mark.parametrize("name", ["ort-static", "ort-dynamic", "onnx-fp32"])
def test_onnx_variants_give_the_same_logits_each_time_they_load(tiny_run, name):
    run = tiny_run["run"]
    images = train.load_splits(TrainConfig(**TINY_TRAIN)).test.tensors[0][:32]
    first = export.ort_predict(export.ort_session(run.verified_path(name), 1), images)
    second = export.ort_predict(export.ort_session(run.verified_path(name), 2), images)
    assert first.shape == (32, 10)
    assert torch.allclose(first, second, atol=1e-5)


def test_ort_static_alone_exports_onnx_first(tmp_path):
    run = artifacts.create_run(tmp_path, "only-static")
    train.run(TrainConfig(**TINY_TRAIN | {"epochs": 1, "baseline": False}), run)
    results = quantize.run(QuantizeConfig(methods="ort-static", calibration_samples=64,
                                          quiet=True), run)
    assert list(results) == ["onnx-fp32", "ort-static"]
    assert "torch-static" not in run.artifacts()


def test_onnx_size_counts_external_data(tmp_path, tiny_run):
    model = onnx.load(str(tiny_run["run"].verified_path("onnx-fp32")))
    path = tmp_path / "split.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, location="split.onnx.data",
                    size_threshold=0)
    data_bytes = (tmp_path / "split.onnx.data").stat().st_size
    assert data_bytes > 10_000
    assert export.onnx_size_bytes(path) == path.stat().st_size + data_bytes


def test_external_data_outside_the_model_folder_is_refused(tmp_path, tiny_run):
    model = onnx.load(str(tiny_run["run"].verified_path("onnx-fp32")))
    inside = tmp_path / "model"
    inside.mkdir()
    path = inside / "evil.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, location="weights.data",
                    size_threshold=0)
    proto = onnx.load(str(path), load_external_data=False)
    for tensor in proto.graph.initializer:
        for item in tensor.external_data:
            if item.key == "location":
                item.value = "../weights.data"
    onnx.save_model(proto, str(path))
    (inside / "weights.data").rename(tmp_path / "weights.data")
    with pytest.raises(PipelineError, match="outside its folder"):
        export.ort_session(path, threads=1)
    path.write_bytes(b"not an onnx file")
    with pytest.raises(PipelineError, match="not a readable ONNX model"):
        export.ort_session(path, threads=1)
