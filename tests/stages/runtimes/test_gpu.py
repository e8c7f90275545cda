"""The GPU rows' parts that run without a GPU: when they are wanted, and the float16 copy of
the ONNX model that ONNX Runtime's CUDA provider serves as onnx-fp16@cuda."""
import torch

from stages.runtimes import gpu
from stages.runtimes.onnxruntime import ort_predict, ort_session


def test_gpu_rows_are_wanted_only_with_a_cuda_device_and_not_against_device_cpu(monkeypatch):
    monkeypatch.setattr(gpu, "available", lambda: True)
    assert gpu.wanted("auto") and gpu.wanted("cuda") and not gpu.wanted("cpu")
    monkeypatch.setattr(gpu, "available", lambda: False)
    assert not gpu.wanted("auto") and not gpu.wanted("cuda")


def test_the_float16_copy_keeps_float32_inputs_and_the_models_predictions(tiny_run, tmp_path):
    import onnx

    source = tiny_run["run"].verified_path("onnx-fp32")
    copy = gpu._float16_copy(source, tmp_path)
    model = onnx.load(str(copy))
    assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    weights = [i for i in model.graph.initializer if len(i.dims) == 4]
    assert weights and all(w.data_type == onnx.TensorProto.FLOAT16 for w in weights)
    images = torch.randn(64, 1, 8, 8)
    full = ort_predict(ort_session(source, 1), images)
    half = ort_predict(ort_session(copy, 1), images)
    assert (full.argmax(1) == half.argmax(1)).float().mean() >= 0.95
    assert (full - half).abs().max() < 0.05 * full.abs().max()


def test_an_onnx_row_whose_cuda_provider_fell_back_to_the_cpu_is_not_measured(tiny_run,
                                                                              monkeypatch,
                                                                              tmp_path, capsys):
    """ONNX Runtime falls back to its CPU provider when CUDA's cannot start (cuDNN missing),
    saying so on stdout: the row was timed on the CPU under the name of a GPU row."""
    import onnxruntime

    class FellBack:
        def __init__(self, *_, **__):
            print("EP Error ... Falling back to ['CPUExecutionProvider'] and retrying.")

        def get_providers(self):
            return ["CPUExecutionProvider"]

    monkeypatch.setattr(onnxruntime, "get_available_providers",
                        lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(onnxruntime, "InferenceSession", FellBack)
    assert gpu.load(tiny_run["run"], "onnx-fp32@cuda", tmp_path) is None
    assert capsys.readouterr().out == ""  # stdout holds the paths a stage wrote
