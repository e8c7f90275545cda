"""ONNX export with checks, and ONNX Runtime dynamic and static int8 quantization.

Static quantization writes QDQ graphs with uint8 activations and int8 weights: on x86 CPUs with
VNNI that format runs on ONNX Runtime's fast int8 kernels, while QOperator and S8S8 graphs
measured several times slower than fp32 on the development machine (DESIGN.md).
"""
from __future__ import annotations

import contextlib
import io
import logging
import tempfile
import warnings
from pathlib import Path

from stages.artifacts import atomic_path
from stages.errors import PipelineError

INPUT_NAME = "input"
OUTPUT_NAME = "logits"


def external_data_files(path: Path) -> list[Path]:
    """The external data files an ONNX model names; one outside the model's folder is refused,
    so that a downloaded model cannot make us read an arbitrary file."""
    import onnx

    path = Path(path)
    model = onnx.load(str(path), load_external_data=False)
    folder = path.parent.resolve()
    tensors = list(model.graph.initializer) + [
        attr.t for node in model.graph.node for attr in node.attribute if attr.HasField("t")]
    files = []
    for tensor in tensors:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        location = next((item.value for item in tensor.external_data if item.key == "location"), "")
        target = (folder / location).resolve()
        if Path(location).is_absolute() or folder not in target.parents:
            raise PipelineError(f"{path} points its external data outside its folder "
                                f"({location!r}); refusing to read it")
        if target not in files:
            files.append(target)
    return files


def onnx_size_bytes(path: Path) -> int:
    """Bytes a user ships for an ONNX model: the file plus every external data file it names."""
    return Path(path).stat().st_size + sum(f.stat().st_size for f in external_data_files(path))


def export_onnx(model, example, path: Path) -> None:
    """Export with torch.export (dynamo) and a dynamic batch axis, as one self-contained file."""
    import onnx
    import torch

    model = model.eval().cpu()
    with tempfile.TemporaryDirectory() as scratch, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scratch_file = Path(scratch) / "model.onnx"
        try:
            torch.onnx.export(model, (example,), str(scratch_file), dynamo=True, verbose=False,
                              input_names=[INPUT_NAME], output_names=[OUTPUT_NAME],
                              dynamic_shapes=({0: torch.export.Dim("batch", min=1)},))
        except Exception as exc:
            raise PipelineError(f"ONNX export of {type(model).__name__} failed: "
                                f"{str(exc).strip().splitlines()[0][:300]}") from exc
        # The exporter writes weights to model.onnx.data; under 2 GB one file is easier to ship.
        proto = onnx.load(str(scratch_file), load_external_data=True)
        with atomic_path(path) as tmp:
            onnx.save_model(proto, str(tmp), save_as_external_data=False)
    check_onnx(path)


def check_onnx(path: Path) -> None:
    import onnx

    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as exc:
        raise PipelineError(f"{path} fails onnx.checker: {str(exc).splitlines()[0][:300]}") from exc


def ort_session(path: Path, threads: int):
    """A CPU InferenceSession with a fixed thread count, like torch.set_num_threads."""
    import onnxruntime as ort

    try:
        external_data_files(path)  # refuse external data outside the folder before ORT reads it
    except PipelineError:
        raise
    except Exception as exc:
        raise PipelineError(f"{path} is not a readable ONNX model: "
                            f"{str(exc).strip().splitlines()[0][:200]}") from exc
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    try:
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise PipelineError(f"ONNX Runtime cannot load {path}: "
                            f"{str(exc).strip().splitlines()[0][:300]}") from exc


def ort_predict(session, images, batch_size: int = 256):
    """Logits from an ORT session for a float tensor of images, as a torch tensor."""
    import numpy as np
    import torch

    outputs = []
    for start in range(0, len(images), batch_size):
        batch = images[start:start + batch_size].numpy().astype(np.float32, copy=False)
        outputs.append(torch.from_numpy(session.run([OUTPUT_NAME], {INPUT_NAME: batch})[0]))
    return torch.cat(outputs) if outputs else torch.empty(0)


def compare_logits(reference, candidate) -> dict:
    """How far two models' logits are apart on the same inputs."""
    return {
        "max_abs_diff": float((reference - candidate).abs().max()),
        "top1_agreement": float((reference.argmax(1) == candidate.argmax(1)).float().mean()),
        "samples": len(reference),
    }


def _quiet_ort_logging():
    # The quantizer logs a pre-processing hint at WARNING even when we did pre-process.
    logging.getLogger().setLevel(max(logging.getLogger().level, logging.ERROR))


def quantize_ort_dynamic(source: Path, path: Path) -> dict:
    """Weights to int8 ahead of time, activations at run time (ConvInteger/MatMulInteger)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    _quiet_ort_logging()
    options = {"weight_type": "QInt8", "per_channel": False}
    with atomic_path(path) as tmp:
        quantize_dynamic(str(source), str(tmp), weight_type=QuantType.QInt8)
    return options


def cpu_has_vnni() -> bool:
    """VNNI (AVX-512 or AVX) lets uint8 x int8 products run without saturation."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_vnni" in flags or "avx_vnni" in flags or "amx_int8" in flags


ORT_TYPES = {"u8s8": ("QUInt8", "QInt8"), "s8s8": ("QInt8", "QInt8")}


def ort_static_options(types: str = "u8s8", per_channel: bool = False,
                       calibration_method: str = "minmax", quant_format: str = "qdq") -> dict:
    """The options record of one ORT static configuration; reduce_range follows the CPU."""
    activation, weight = ORT_TYPES[types]
    # Without VNNI, 8-bit weights can overflow the int16 accumulation of AVX2 kernels.
    return {"format": quant_format.upper(), "types": types, "activation_type": activation,
            "weight_type": weight, "per_channel": per_channel,
            "calibration_method": calibration_method, "reduce_range": not cpu_has_vnni()}


def pre_process(source: Path, target: Path) -> None:
    """Shape inference and graph clean-up that ORT's quantizer expects before it runs."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    _quiet_ort_logging()
    quant_pre_process(str(source), str(target))


def layer_groups(path: Path) -> dict[str, list[str]]:
    """Each Conv/Gemm/MatMul node with the single-consumer Relu/Clip/pooling nodes after it:
    what has to stay float together for a layer's output to stay float."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    consumers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    groups = {}
    for node in graph.node:
        if node.op_type not in ("Conv", "Gemm", "MatMul"):
            continue
        members, current = [node.name], node
        while len(consumers.get(current.output[0], [])) == 1:
            follower = consumers[current.output[0]][0]
            if follower.op_type not in ("Relu", "Clip", "MaxPool", "AveragePool",
                                        "GlobalAveragePool", "Flatten"):
                break
            members.append(follower.name)
            current = follower
        groups[node.name] = members
    return groups


def quantize_ort_static(pre_processed: Path, path: Path, batches, options: dict,
                        nodes_to_exclude: list[str] | None = None) -> dict:
    """Static int8 of a pre-processed model, calibrated on ``batches`` of training images."""
    from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat,
                                          QuantType, quantize_static)

    _quiet_ort_logging()
    if not batches:
        raise PipelineError("static quantization needs calibration data and got none; "
                            "raise --calibration-samples")

    class TrainingBatches(CalibrationDataReader):
        def __init__(self) -> None:
            self._feeds = iter([{INPUT_NAME: b.numpy()} for b in batches])

        def get_next(self):
            return next(self._feeds, None)

    method = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
              "percentile": CalibrationMethod.Percentile}[options["calibration_method"]]
    # The histogram calibrators print their progress with print(); keep our output short.
    with atomic_path(path) as tmp, contextlib.redirect_stdout(io.StringIO()):
        quantize_static(str(pre_processed), str(tmp), TrainingBatches(),
                        quant_format=QuantFormat.QDQ if options["format"] == "QDQ"
                        else QuantFormat.QOperator,
                        activation_type=getattr(QuantType, options["activation_type"]),
                        weight_type=getattr(QuantType, options["weight_type"]),
                        per_channel=options["per_channel"], reduce_range=options["reduce_range"],
                        calibrate_method=method, nodes_to_exclude=nodes_to_exclude or [])
    return options | {"calibration_batches": len(batches),
                      "calibration_samples": int(sum(len(b) for b in batches)),
                      "pre_processed": True}
