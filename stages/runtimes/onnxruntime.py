"""ONNX Runtime: `onnx-fp32` (the float model exported to ONNX), `ort-dynamic` and `ort-static`
(ONNX Runtime's own int8 quantizers) and `ort-qat` (the QAT model exported as QDQ).

Static quantization writes QDQ graphs with uint8 activations and int8 weights: on x86 CPUs that
format runs on ONNX Runtime's fast int8 kernels, while QOperator and S8S8 graphs measured
several times slower than fp32 on the development machines (docs/design.md).
"""
from __future__ import annotations

import contextlib
import functools
import io
import logging
import shutil
from collections import defaultdict
from pathlib import Path

from stages.measure.evaluate import compare_logits, predict, scoring_batch_size
from stages.measure.machine import cpu_has_vnni
from stages.quantization import sensitivity, tuning
from stages.quantization.sensitivity import Scheme
from stages.run.errors import NotMade, PipelineError
from stages.run.files import atomic_path, converter_errors, raise_if_disk_failure
from stages.runtimes import FLOAT, Loaded, loader, onnx_export, profilers, variant
from stages.runtimes.onnx_export import INPUT_NAME, OUTPUT_NAME

ORT_TYPES = {"u8s8": ("QUInt8", "QInt8"), "s8s8": ("QInt8", "QInt8")}


def _session_options(threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    # The pool's threads otherwise spin for tens of milliseconds after a run returns, taking
    # the cores from whatever runs next (onnx-fp32 timed at 44.9 ms right after an ort-static
    # call, 20.7 ms alone); they start again with the next run.
    options.add_session_config_entry("session.force_spinning_stop", "1")
    return options


def ort_session(path: Path, threads: int, disabled_optimizers: tuple[str, ...] = (),
                profile_prefix: str | None = None):
    """A CPU InferenceSession with a fixed thread count, like torch.set_num_threads; with
    ``profile_prefix``, one that profiles its runs into a file of that prefix."""
    import onnxruntime as ort

    try:
        onnx_export.external_data_files(path)  # refuse data outside the folder before ORT reads
    except PipelineError:
        raise
    except Exception as exc:
        raise PipelineError(f"{path} is not a readable ONNX model: "
                            f"{str(exc).strip().splitlines()[0][:200]}") from exc
    options = _session_options(threads)
    if profile_prefix is not None:
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix
    try:
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"],
                                    disabled_optimizers=list(disabled_optimizers))
    except Exception as exc:  # NotMade: while quantize makes a variant, it costs that one
        raise_if_disk_failure(exc, path)  # a full disk or an I/O error stays the stage's
        raise NotMade(f"ONNX Runtime cannot load {path}: "
                      f"{str(exc).strip().splitlines()[0][:300]}") from exc


def ort_predict(session, images, batch_size: int | None = None):
    """Logits from an ORT session for a float tensor of images, as a torch tensor, in batches
    of at most scoring_batch_size images."""
    import numpy as np
    import torch

    batch_size = batch_size or scoring_batch_size(images.shape)
    outputs = []
    for start in range(0, len(images), batch_size):
        batch = images[start:start + batch_size].numpy().astype(np.float32, copy=False)
        with converter_errors("ONNX Runtime"):  # a kernel it lacks costs the variant
            outputs.append(torch.from_numpy(session.run([OUTPUT_NAME], {INPUT_NAME: batch})[0]))
    return torch.cat(outputs) if outputs else torch.empty(0)


def ort_call(session, batch):
    feed = {INPUT_NAME: batch.numpy()}
    return lambda: session.run(None, feed)


# Op types of the graph ONNX Runtime runs, after its fusions (QDQ pairs around a Conv become one
# QLinearConv, and so on), by kind and by whether the kernel computes in int8.
RUN_OPS = {"QLinearConv": ("Conv", "int8"), "ConvInteger": ("Conv", "int8"),
           "Conv": ("Conv", "float"), "FusedConv": ("Conv", "float"),
           "ConvTranspose": ("Conv", "float"), "QGemm": ("Linear", "int8"),
           "QLinearMatMul": ("Linear", "int8"), "MatMulInteger": ("Linear", "int8"),
           "MatMulIntegerToFloat": ("Linear", "int8"), "DynamicQuantizeMatMul": ("Linear", "int8"),
           "Gemm": ("Linear", "float"), "FusedGemm": ("Linear", "float"),
           "MatMul": ("Linear", "float"), "FusedMatMul": ("Linear", "float")}


def onnx_op_counts(path: Path, config_entries: dict[str, str] | None = None) -> dict:
    """Conv and Linear (MatMul, Gemm) ops in the graph ONNX Runtime runs: the session's own
    optimized model (written with `optimized_model_filepath` at the level every session here
    uses), so that a QDQ model ORT leaves unfused counts as the float model it runs as."""
    import tempfile

    import onnx
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as scratch:
        optimized = Path(scratch) / "optimized.onnx"
        options = _session_options(threads=1)
        options.optimized_model_filepath = str(optimized)
        for key, value in (config_entries or {}).items():
            options.add_session_config_entry(key, value)
        ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        graph = onnx.load(str(optimized), load_external_data=False).graph
    counts: dict[str, dict] = defaultdict(lambda: {"int8": 0, "float": 0, "ops": {}})
    for node in graph.node:
        if node.op_type in RUN_OPS:
            kind, precision = RUN_OPS[node.op_type]
            counts[kind][precision] += 1
            counts[kind]["ops"][node.op_type] = counts[kind]["ops"].get(node.op_type, 0) + 1
    return dict(counts)


def _quiet_ort_logging():
    # The quantizer logs a pre-processing hint at WARNING even when we did pre-process.
    logging.getLogger().setLevel(max(logging.getLogger().level, logging.ERROR))


def static_options(types: str = "u8s8", per_channel: bool = False,
                   calibration_method: str = "minmax", quant_format: str = "qdq") -> dict:
    """The options record of one static configuration; reduce_range follows the CPU."""
    activation, weight = ORT_TYPES[types]
    # Without VNNI, 8-bit weights can overflow the int16 accumulation of AVX2 kernels.
    return {"format": quant_format.upper(), "types": types, "activation_type": activation,
            "weight_type": weight, "per_channel": per_channel,
            "calibration_method": calibration_method, "reduce_range": not cpu_has_vnni()}


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


def weight_sizes(path: Path, nodes: list[str]) -> list[int]:
    """Elements of each named Conv/Gemm/MatMul node's weight (its second input), 0 where the
    weight is not a stored tensor: what matches a node to a PyTorch layer."""
    import math

    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    shapes = {i.name: list(i.dims) for i in graph.initializer}
    by_name = {n.name: n for n in graph.node}
    return [math.prod(shapes.get(by_name[n].input[1], [0])) for n in nodes]


def quantize_static(pre_processed: Path, path: Path, batches, options: dict,
                    nodes_to_exclude: list[str] | None = None,
                    calibration_cache: Path | None = None) -> dict:
    """Static int8 of a pre-processed model, calibrated on ``batches`` of training images.
    With ``calibration_cache``, the tensor ranges are kept there and read back by the next call
    on the same model, batches and calibration method: the accuracy fallback's trials differ in
    the nodes they leave float, not in the ranges (py-spy put 77% of a minute of resnet18's
    fallback at 224x224 in calibration, Zen 4 EPYC)."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
    )
    from onnxruntime.quantization import quantize_static as ort_quantize_static

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
    cache = {} if calibration_cache is None else {"calibration_cache_path": str(calibration_cache)}
    # The histogram calibrators print their progress with print(); keep our output short.
    with atomic_path(path) as tmp, contextlib.redirect_stdout(io.StringIO()), \
            converter_errors("ONNX Runtime's static quantization", path):
        ort_quantize_static(str(pre_processed), str(tmp), TrainingBatches(),
                            quant_format=QuantFormat.QDQ if options["format"] == "QDQ"
                            else QuantFormat.QOperator,
                            activation_type=getattr(QuantType, options["activation_type"]),
                            weight_type=getattr(QuantType, options["weight_type"]),
                            per_channel=options["per_channel"],
                            reduce_range=options["reduce_range"], calibrate_method=method,
                            nodes_to_exclude=nodes_to_exclude or [], **cache)
    return options | {"calibration_batches": len(batches),
                      "calibration_samples": int(sum(len(b) for b in batches))}


def _finish(ctx, name: str, made: Path, source: str, info: dict) -> dict:
    """Move a quantized file into place, check it, compare it with its source, register it."""
    path = ctx.folder / f"{name}.onnx"
    with atomic_path(path) as tmp:
        shutil.copyfile(made, tmp)
    onnx_export.check_onnx(path, made_by="ONNX Runtime's quantizer")
    images = ctx.check_images()
    written = ort_predict(ort_session(path, threads=1), images)
    info[f"parity_vs_{source.replace('-', '_')}"] = compare_logits(ctx.logits_of(source, images),
                                                                   written)
    ctx.register(name, path, info, fmt="onnx", op_counts=onnx_op_counts(path))
    return info


@variant("onnx-fp32", runtime="onnxruntime", source=FLOAT, int8=False,
         description="the float model exported to ONNX, run by ONNX Runtime")
def make_onnx_fp32(ctx) -> dict:
    model = ctx.float_model()
    images = ctx.check_images()
    path = ctx.folder / "model.onnx"
    pools = onnx_export.export_onnx(model, images[:2], path)
    parity = compare_logits(predict(model, images),
                            ort_predict(ort_session(path, threads=1), images))
    info = {"exporter": "torch.onnx.export(dynamo=True)", "means_as_global_average_pool": pools,
            "parity_vs_pytorch": parity}
    ctx.register("onnx-fp32", path, info, fmt="onnx", op_counts=onnx_op_counts(path))
    if parity["top1_agreement"] < 0.99:
        ctx.say(f"warning: onnx-fp32 agrees with PyTorch on only {parity['top1_agreement']:.1%} "
                f"of training images (max logit difference {parity['max_abs_diff']:.3g})")
    return info


# Dynamic int8 where ONNX Runtime means it to run (fully connected layers, attention, LSTM),
# as torch-dynamic quantizes Linear alone. Its int8 convolutions (ConvInteger) ran 6.6x slower
# than onnx-fp32 on resnet18 (156.7 against 23.9 ms at batch 32, AMD EPYC, 2026-12-02) and left
# mobilenet_v2 at chance on notMNIST (16.7%); ORT's documentation recommends static
# quantization for convolutional networks.
DYNAMIC_OP_TYPES = ["MatMul", "Attention", "LSTM"]


@variant("ort-dynamic", runtime="onnxruntime", source="onnx-fp32", int8=True,
         description="ONNX Runtime dynamic int8 of the fully connected layers (activations at "
                     "run time)")
def make_dynamic(ctx) -> dict:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    if (pointless := ctx.pointless_dynamic_int8("ort-dynamic", "ort-static")) is not None:
        return pointless
    _quiet_ort_logging()
    made = ctx.scratch / "ort-dynamic.onnx"
    # 7-bit weights without VNNI, as ort-static's: AVX2's u8 x s8 products can saturate.
    reduce_range = not cpu_has_vnni()
    with atomic_path(made) as tmp, converter_errors("ONNX Runtime's dynamic quantization", made):
        quantize_dynamic(str(ctx.run.verified_path("onnx-fp32")), str(tmp),
                         weight_type=QuantType.QInt8, op_types_to_quantize=DYNAMIC_OP_TYPES,
                         reduce_range=reduce_range)
    if not any(c["int8"] for c in onnx_op_counts(made).values()):
        return ctx.refuse("ort-dynamic", "not made: the model has no fully connected layer "
                          "(MatMul), the only kind dynamic int8 quantizes here; ort-static "
                          "quantizes convolutions")
    options = {"dynamic": True, "weight_type": "QInt8", "per_channel": False,
               "op_types": DYNAMIC_OP_TYPES, "reduce_range": reduce_range}
    source = ort_session(ctx.run.verified_path("onnx-fp32"), ctx.threads)
    record = ctx.score_without_search(
        "ort-dynamic", lambda images: ort_predict(ort_session(made, ctx.threads), images),
        lambda images: ort_predict(source, images), "onnx-fp32", options)
    if record["chosen"] is None:
        return ctx.not_kept("ort-dynamic", record)
    return _finish(ctx, "ort-dynamic", made, "onnx-fp32", {"options": options,
                                                           "tuning": record})


def _pre_processed(ctx, equalize: bool) -> Path:
    """ORT's shape inference and graph clean-up (quant_pre_process) of onnx-fp32, or of the
    equalized float model exported beside it in the scratch folder."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    source = ctx.run.verified_path("onnx-fp32")
    if equalize:
        source = ctx.scratch / "equalized.onnx"
        onnx_export.export_onnx(ctx.equalized_model()[0], ctx.check_images()[:2], source)
    pre = ctx.scratch / f"pre-processed{'-equalized' if equalize else ''}.onnx"
    with converter_errors("ONNX Runtime's quant_pre_process", pre):
        quant_pre_process(str(source), str(pre))
    return pre


def _static_backend(ctx) -> tuning.Backend:
    calibration = ctx.calibration()
    pre = functools.cache(lambda equalize: _pre_processed(ctx, equalize))
    groups = functools.cache(lambda equalize: layer_groups(pre(equalize)))
    counter = iter(range(10**6))

    def build(options: dict, float_layers) -> Path:
        made = ctx.scratch / f"ort-static-{next(counter)}.onnx"
        equalize = bool(options.get("equalize"))
        excluded = [n for layer in float_layers for n in groups(equalize).get(layer, ())]
        ranges = ctx.scratch / f"{pre(equalize).stem}-{options['calibration_method']}.json"
        quantize_static(pre(equalize), made, calibration, options, excluded, ranges)
        return made

    def errors(options: dict) -> dict:
        equalize = bool(options.get("equalize"))
        model = ctx.source_model(options)
        scheme = Scheme(per_channel=options["per_channel"],
                        weight_bits=7 if options["reduce_range"] else 8)
        return sensitivity.by_position(model, sensitivity.layer_errors(model, calibration, scheme),
                                       list(groups(equalize)),
                                       weight_sizes(pre(equalize), list(groups(equalize))))

    return tuning.Backend(
        build=build,
        predict=lambda path, images: ort_predict(ort_session(path, ctx.threads), images),
        call=lambda path, batch: ort_call(ort_session(path, ctx.threads), batch),
        layers=lambda options: list(groups(bool(options.get("equalize")))), errors=errors)


@variant("ort-static", runtime="onnxruntime", source="onnx-fp32", int8=True,
         description="ONNX Runtime static int8, QDQ, calibrated on training images")
def make_static(ctx) -> dict:
    config = ctx.config
    _quiet_ort_logging()
    if config.auto:
        candidates = [static_options("u8s8", pc, cal)
                      for cal in ("minmax", "percentile") for pc in (False, True)]
        candidates.append(static_options("s8s8", False, "minmax"))
    else:  # per-tensor measured fastest with VNNI (docs/design.md)
        candidates = [static_options(config.ort_types or "u8s8", bool(config.per_channel),
                                     config.calibration_method or "minmax",
                                     config.ort_format or "qdq")]
    for options in candidates:  # equalized where weights share one scale per tensor
        options["equalize"] = ctx.equalizes(per_tensor_weights=not options["per_channel"])
    backend = _static_backend(ctx)
    reference = ctx.reference(lambda images: ort_predict(
        ort_session(ctx.run.verified_path("onnx-fp32"), ctx.threads), images), "onnx-fp32")
    ctx.say("ort-static: scoring on the validation slice")
    trial, record = tuning.tune(backend, candidates, reference, config.max_accuracy_drop,
                                say=ctx.say, seconds=config.tuning_time)
    if trial is None:
        return ctx.not_kept("ort-static", record)
    info = trial.options | {"float_layers": list(trial.float_layers), "tuning": record,
                            "calibration_samples": int(sum(len(b) for b in ctx.calibration())),
                            "calibration_split": "train", "pre_processed": True}
    if trial.options["equalize"]:
        info["equalization"] = ctx.equalized_model()[1]
    return _finish(ctx, "ort-static", trial.model, "onnx-fp32", info)


@loader("onnxruntime")
def load(run, name: str, threads: int) -> Loaded:
    import onnxruntime

    path = run.verified_path(name)
    session = ort_session(path, threads)
    kind = (run.entry(name).get("quantization") or {}).get("format", "")
    return Loaded(lambda images: ort_predict(session, images),
                  lambda batch: ort_call(session, batch), onnx_op_counts(path),
                  f"ONNX Runtime {onnxruntime.__version__}" + (f", {kind}" if kind else ""),
                  profile=lambda batch, calls: profilers.onnxruntime_profile(
                      lambda prefix: ort_session(path, threads, profile_prefix=prefix), batch,
                      calls))
