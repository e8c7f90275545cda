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

from stages.run.errors import NotMade, PipelineError
from stages.run.files import atomic_path, converter_errors, raise_if_disk_failure

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


def export_onnx(model, example, path: Path) -> list[str]:
    """Export with torch.export (dynamo) and a dynamic batch axis, as one self-contained file,
    global average pooling written as such (`means_as_global_pools`, whose list it returns)."""
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
            raise NotMade(f"ONNX export of {type(model).__name__} failed: "
                                f"{str(exc).strip().splitlines()[0][:300]}") from exc
        # The exporter writes weights to model.onnx.data; under 2 GB one file is easier to ship.
        proto = onnx.load(str(scratch_file), load_external_data=True)
        _drop_weight_value_info(proto.graph)
        pools = means_as_global_pools(proto)
        with atomic_path(path) as tmp:
            onnx.save_model(proto, str(tmp), save_as_external_data=False)
    check_onnx(path)
    return pools


def means_as_global_pools(proto) -> list[str]:
    """Rewrite, in place, each ReduceMean over the two spatial axes of a 4-D tensor (as
    torch.export writes AdaptiveAvgPool2d(1) and x.mean((2, 3))) as GlobalAveragePool, the
    same mean, which ONNX Runtime runs in its blocked layout and, between quantized tensors,
    fuses into QLinearGlobalAveragePool: efficientnet_b0's onnx-fp32 ran 1.10x faster at batch
    32 and its QDQ int8 1.03x, with 17 quantize/dequantize pairs fewer. A mean over a map of
    one pixel (a 32-pixel image through five stride-2 stages) is that pixel: it becomes an
    Identity, or a Squeeze where the mean dropped the axes: between quantize steps, a
    1280-channel 1x1 map took 0.20 ms at batch 32 as QLinearGlobalAveragePool against 0.06 ms
    as a float ReduceMean, and mobilenet_v2's QDQ int8 ran 12% slower
    (docs/measurements.md's git history). Returns the names of the rewritten nodes."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    graph = proto.graph
    known = {init.name: init for init in graph.initializer}
    known |= {node.output[0]: node.attribute[0].t for node in graph.node
              if node.op_type == "Constant" and node.attribute
              and node.attribute[0].name == "value"}
    # The exporter writes the shape of every tensor it makes; one without is left alone.
    # GlobalAveragePool takes float types alone before opset 22; ReduceMean takes more.
    floats = {TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16}
    shapes = {info.name: [d.dim_value if d.HasField("dim_value") else None
                          for d in info.type.tensor_type.shape.dim]
              for info in list(graph.value_info) + list(graph.input)
              if info.type.tensor_type.HasField("shape")
              and info.type.tensor_type.elem_type in floats}
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)
    rewritten, nodes, freed = [], [], set()
    for node in graph.node:
        keep = _global_mean_keeps_axes(node, known, shapes)
        if keep is None or (not keep and opset < 13):
            nodes.append(node)
            continue
        one_pixel = shapes[node.input[0]][2:] == [1, 1]
        if keep:
            nodes.append(helper.make_node("Identity" if one_pixel else "GlobalAveragePool",
                                          [node.input[0]], [node.output[0]], name=node.name))
        else:
            pooled = f"{node.output[0]}_pooled"
            spatial = f"{node.output[0]}_spatial_axes"  # tensor names are unique
            graph.initializer.append(numpy_helper.from_array(np.array([2, 3], np.int64), spatial))
            if not one_pixel:
                nodes.append(helper.make_node("GlobalAveragePool", [node.input[0]], [pooled],
                                              name=node.name))
            nodes.append(helper.make_node(
                "Squeeze", [node.input[0] if one_pixel else pooled, spatial], [node.output[0]],
                name=node.name if one_pixel else f"{node.output[0]}_squeeze"))
        rewritten.append(node.name)
        freed.update(node.input[1:])
    freed -= {name for node in nodes for name in node.input}
    del graph.node[:]
    graph.node.extend(node for node in nodes
                      if not (node.op_type == "Constant" and node.output[0] in freed))
    kept = [init for init in graph.initializer if init.name not in freed]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    return rewritten


def _global_mean_keeps_axes(node, known: dict, shapes: dict) -> bool | None:
    """For a ReduceMean over the spatial axes of a 4-D tensor, its keepdims; otherwise None."""
    import numpy as np
    from onnx import helper, numpy_helper

    if node.op_type != "ReduceMean" or len(shapes.get(node.input[0], ())) != 4:
        return None
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    axes = attributes.get("axes")
    if axes is None and len(node.input) > 1 and node.input[1] in known:
        axes = numpy_helper.to_array(known[node.input[1]])
    if axes is None or sorted(int(a) % 4 for a in np.ravel(axes)) != [2, 3]:
        return None
    return bool(attributes.get("keepdims", 1))


def _drop_weight_value_info(graph) -> None:
    """Remove the exporter's value_info entries for weights: an initializer carries its own
    shape. onnxruntime 1.30's quantize_dynamic turns Gemm into MatMul by transposing the
    weight and leaves such an entry behind, and ONNX's shape inference then refuses the model
    ("Inferred shape and existing shape differ in dimension 0: (512) vs (10)")."""
    weights = {initializer.name for initializer in graph.initializer}
    kept = [info for info in graph.value_info if info.name not in weights]
    del graph.value_info[:]
    graph.value_info.extend(kept)


def check_onnx(path: Path, made_by: str | None = None) -> None:
    """A file onnx.checker refuses: where a converter (``made_by``) wrote it as it is, that
    converter could not write this model, which costs the variant (NotMade); after our own
    rewrites (None) it is our error, the stage's."""
    import onnx

    if made_by:
        with converter_errors(f"{made_by} (onnx.checker on {path.name})", path):
            onnx.checker.check_model(str(path), full_check=True)
        return
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as exc:
        raise PipelineError(f"{path} fails onnx.checker: {str(exc).splitlines()[0][:300]}; "
                            "please report this with --debug output") from exc
