"""ONNX export and its checks: one step, used by the ONNX runtimes.

The model is exported with torch.export (the dynamo exporter) and a dynamic batch axis, checked
with onnx.checker, and saved as one self-contained file. External data that a model names
outside its own folder is refused, so that a model from elsewhere cannot make us read an
arbitrary file.
"""
from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

from stages.run.errors import PipelineError
from stages.run.files import atomic_path, raise_if_disk_failure

INPUT_NAME = "input"
OUTPUT_NAME = "logits"


def external_data_files(path: Path) -> list[Path]:
    """The external data files an ONNX model names; one outside the model's folder is refused."""
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


def export_onnx(model, example, path: Path) -> None:
    """Export with torch.export (dynamo) and a dynamic batch axis, as one self-contained file."""
    import onnx
    import torch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # The exporter's own files go beside the target: the disk that must hold it is the one
    # whose space is checked, and a full one is named as such.
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".export-") as scratch, \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scratch_file = Path(scratch) / "model.onnx"
        try:
            torch.onnx.export(model, (example,), str(scratch_file), dynamo=True, verbose=False,
                              input_names=[INPUT_NAME], output_names=[OUTPUT_NAME],
                              dynamic_shapes=({0: torch.export.Dim("batch", min=1)},))
        except Exception as exc:
            raise_if_disk_failure(exc, path)
            raise PipelineError(f"ONNX export of {type(model).__name__} failed: "
                                f"{str(exc).strip().splitlines()[0][:300]}") from exc
        # The exporter writes weights to model.onnx.data; under 2 GB one file is easier to ship.
        proto = onnx.load(str(scratch_file), load_external_data=True)
        _drop_weight_value_info(proto.graph)
        with atomic_path(path) as tmp:
            onnx.save_model(proto, str(tmp), save_as_external_data=False)
    check_onnx(path)


def _drop_weight_value_info(graph) -> None:
    """Remove the exporter's value_info entries for weights: an initializer carries its own
    shape. onnxruntime 1.30's quantize_dynamic turns Gemm into MatMul by transposing the
    weight and leaves such an entry behind, and ONNX's shape inference then refuses the model
    ("Inferred shape and existing shape differ in dimension 0: (512) vs (10)")."""
    weights = {initializer.name for initializer in graph.initializer}
    kept = [info for info in graph.value_info if info.name not in weights]
    del graph.value_info[:]
    graph.value_info.extend(kept)


def check_onnx(path: Path) -> None:
    import onnx

    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as exc:
        raise PipelineError(f"{path} fails onnx.checker: {str(exc).splitlines()[0][:300]}") from exc
