"""The float models as a GPU user serves them, for the report's GPU rows on a CUDA machine.

    fp32@cuda             `fp32`, eager PyTorch on the GPU
    fp32-compiled@cuda    the float weights under torch.compile on the GPU
    amp@cuda              `amp` in its training precision: float16 or bfloat16 autocast
    onnx-fp32@cuda        `onnx-fp32` in ONNX Runtime's CUDA execution provider (onnxruntime-gpu)
    onnx-fp16@cuda        the same graph converted to float16 (keeping float32 inputs, outputs)

The int8 variants stay CPU rows: their kernels (oneDNN, ONNX Runtime's and OpenVINO's int8
CPU kernels) are CPU kernels. PyTorch rows are timed with CUDA events; ONNX Runtime's `run`
returns when its work is done, so its rows are timed on the host's clock.
"""
from __future__ import annotations

import contextlib
import io

from stages.runtimes import Loaded
from stages.runtimes.onnx_export import INPUT_NAME, OUTPUT_NAME

ROWS = {"fp32@cuda": "fp32", "fp32-compiled@cuda": "fp32-compiled", "amp@cuda": "amp",
        "onnx-fp32@cuda": "onnx-fp32", "onnx-fp16@cuda": "onnx-fp32"}
REFERENCE = "fp32@cuda"


def available() -> bool:
    import torch

    return torch.cuda.is_available()


def wanted(device: str) -> bool:
    """GPU rows where the user did not ask for the CPU and a CUDA device is there."""
    return device != "cpu" and available()


def _torch_row(run, row: str, name: str) -> Loaded:
    import torch

    from stages.measure.evaluate import predict
    from stages.runtimes.pytorch import eager_counts, serve

    device = torch.device("cuda")
    model, context, how = serve(run, name, "cuda")

    def call_for(batch):
        on_device = batch.to(device).contiguous(memory_format=torch.channels_last)

        def call():
            with torch.inference_mode(), context():
                return model(on_device)

        return call

    return Loaded(lambda images: predict(model, images, device=device, autocast=context),
                  call_for, eager_counts(model), how.words("cuda"),
                  precision=how.autocast or "fp32", device="cuda", timer="cuda-events")


def _float16_copy(path, scratch):
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    converted = convert_float_to_float16(onnx.load(str(path)), keep_io_types=True)
    target = scratch / "onnx-fp16.onnx"
    onnx.save(converted, str(target))
    return target


def _ort_row(run, row: str, name: str, scratch) -> Loaded | None:
    import onnxruntime as ort

    from stages.runtimes.onnxruntime import onnx_op_counts, ort_predict

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return None  # onnxruntime without CUDA; onnxruntime-gpu in its place has it
    path = run.verified_path(name)
    if row == "onnx-fp16@cuda":
        path = _float16_copy(path, scratch)
    with contextlib.redirect_stdout(io.StringIO()):  # its fallback's banner is print()ed
        session = ort.InferenceSession(str(path), providers=["CUDAExecutionProvider"])
    if session.get_providers()[0] != "CUDAExecutionProvider":
        return None  # CUDA's provider could not start (no cuDNN): ORT fell back to the CPU

    def call_for(batch):
        binding = session.io_binding()
        value = ort.OrtValue.ortvalue_from_numpy(batch.numpy(), "cuda", 0)
        binding.bind_ortvalue_input(INPUT_NAME, value)
        binding.bind_output(OUTPUT_NAME, "cuda")
        return lambda: session.run_with_iobinding(binding)

    precision = "fp16" if row == "onnx-fp16@cuda" else "fp32"
    return Loaded(lambda images: ort_predict(session, images), call_for,
                  onnx_op_counts(run.verified_path(name)),
                  f"ONNX Runtime {ort.__version__}, CUDA execution provider, {precision}",
                  precision=precision, device="cuda", timer="wall")


def load(run, row: str, scratch) -> Loaded | None:
    """The GPU row ``row`` of ``run``; None where this machine cannot run it."""
    name = ROWS[row]
    if name not in run.artifacts():
        return None
    if name.startswith("onnx"):
        return _ort_row(run, row, name, scratch)
    return _torch_row(run, row, name)


def peak_memory(call) -> int:
    """The allocator's peak while ``call`` runs (PyTorch's own allocations only)."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    call()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated())


def name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if available() else "none"
