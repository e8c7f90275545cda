"""OpenVINO: `openvino-fp32` (the ONNX model as OpenVINO IR, run with the f32 precision hint),
`openvino-bf16` (the same IR run in bf16, on a CPU with bf16 instructions) and `openvino-int8`
(NNCF post-training quantization on training images).

The hint matters: on CPUs with AMX or AVX-512 BF16, OpenVINO runs float models in bf16 unless
told f32, so `openvino-fp32` asks for f32 and `openvino-bf16` is what a user gets by default
there: a float variant that int8 is credited against like the others. An IR is an
.xml graph and a .bin of weights, listed together in the manifest; reading one runs no code
from the files (no extensions are ever added to the Core).
"""
from __future__ import annotations

import contextlib
import functools
import io
import logging
import math
import shutil
from pathlib import Path

from stages.measure.evaluate import compare_logits, scoring_batch_size
from stages.quantization import sensitivity, tuning
from stages.quantization.sensitivity import Scheme
from stages.run.errors import PipelineError
from stages.run.files import atomic_path, converter_errors
from stages.runtimes import Loaded, loader, profilers, variant

INPUT_NAME = "input"
COMPUTE_LAYERS = {"Convolution": "Conv", "Deconvolution": "Conv", "FullyConnected": "Linear",
                  "MatMul": "Linear"}
COMPUTE_OPS = ("Convolution", "GroupConvolution", "MatMul")


def _openvino():
    """OpenVINO with its usage telemetry declined in this process: the tool runs offline and
    must not try to send anything (it costs seconds per conversion and writes to ~/intel)."""
    try:
        from openvino_telemetry.utils.opt_in_checker import ConsentCheckResult, OptInChecker

        OptInChecker.check = lambda self, *args, **kwargs: ConsentCheckResult.DECLINED
    except ImportError:  # a release without that module sends nothing through it
        pass
    try:
        import openvino
    except ImportError:
        raise PipelineError("OpenVINO is not installed: pip install openvino nncf, or leave "
                            "openvino-* out of --methods") from None
    return openvino


def _nncf():
    _openvino()
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # a CUDA notice
    try:
        import nncf
    except ImportError:
        raise PipelineError("NNCF is not installed: pip install nncf, or leave openvino-int8 "
                            "out of --methods") from None
    nncf.set_log_level(logging.WARNING)
    return nncf


@functools.cache
def core():
    """The one OpenVINO Core of the process. Each Core's CPU plugin gives the calling thread
    an alternate signal stack of its own and, when the Core is freed, puts back the one it
    found: two Cores freed in the order they were made (first made, first freed) leave the
    main thread's pointing at freed memory, and the next signal (Ctrl-C, torchrun's SIGTERM)
    killed the process with SIGSEGV (OpenVINO 2026.4; tests/stages/runtimes/test_openvino.py)."""
    return _openvino().Core()


def compile_model(model, threads: int, profiling: bool = False, precision: str = "f32"):
    config = {"INFERENCE_PRECISION_HINT": precision, "INFERENCE_NUM_THREADS": threads,
              "PERFORMANCE_HINT": "LATENCY", "PERF_COUNT": profiling}
    with converter_errors("OpenVINO's compile_model"):  # it cannot take the model: NotMade
        return core().compile_model(model, "CPU", config)


def runner(compiled):
    """(predict, call_for) of a compiled model; one request, inputs shared, not copied."""
    import numpy as np
    import torch

    request = compiled.create_infer_request()

    def predict(images, batch_size: int | None = None):
        batch_size = batch_size or scoring_batch_size(images.shape)
        outputs = []
        for start in range(0, len(images), batch_size):
            batch = np.ascontiguousarray(images[start:start + batch_size].numpy(),
                                         dtype=np.float32)
            with converter_errors("OpenVINO"):  # a kernel it lacks costs the variant, as ORT's
                outputs.append(torch.from_numpy(
                    request.infer({0: batch}, share_inputs=True)[0].copy()))
        return torch.cat(outputs) if outputs else torch.empty(0)

    def call_for(batch):
        array = np.ascontiguousarray(batch.numpy(), dtype=np.float32)
        return lambda: request.infer({0: array}, share_inputs=True, share_outputs=True)

    return predict, call_for


def runtime_op_counts(compiled) -> dict[str, dict[str, int]]:
    """Conv and Linear layers of the graph OpenVINO really executes, by the precision of the
    kernel it chose (i8/u8 is an int8 kernel): fusion and fallback both show here."""
    counts: dict[str, dict[str, int]] = {}
    for op in compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        kind = COMPUTE_LAYERS.get(info["layerType"].astype(str))
        if kind is None:
            continue
        precision = info["runtimePrecision"].astype(str)
        slot = counts.setdefault(kind, {"int8": 0, "float": 0})
        slot["int8" if precision in ("i8", "u8") else "float"] += 1
    return counts


def runtime_kernels(compiled) -> dict[str, int]:
    """How many Conv and Linear layers of the executed graph ran each oneDNN kernel, by the
    name OpenVINO gives it (`brgconv_avx512_amx_I8` against `jit_avx512_core_vnni_I8`): whether
    AMX ran shows here."""
    kernels: dict[str, int] = {}
    for op in compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        if info["layerType"].astype(str) in COMPUTE_LAYERS:
            kernel = info["primitiveType"].astype(str)
            kernels[kernel] = kernels.get(kernel, 0) + 1
    return kernels


def layer_names(model) -> list[str]:
    """Names NNCF's ignored scope takes for each Conv and MatMul. An ONNX Gemm becomes a
    MatMul named '<name>/WithoutBiases' beside an Add that keeps '<name>': the Add's name
    would match and leave the MatMul int8."""
    return [op.get_friendly_name() for op in model.get_ordered_ops()
            if op.get_type_name() in COMPUTE_OPS]


def hard_excitation_multiplies(model) -> list[str]:
    """Names of the squeeze-excitation multiplies gated by a HardSigmoid: x times
    HardSigmoid(f(x)) (mobilenet_v3), which openvino-int8 leaves float. OpenVINO's CPU plugin
    runs HardSigmoid with its reference kernel and fuses no FakeQuantize into it, so a quantized
    gate pays for a FakeQuantize of its own: in mobilenet_v3_large's openvino-int8 (batch 32,
    7.45 ms a call by the perf counters) FakeQuantize took 4.25 ms, nearly all of it after the
    eight gates, against 1.84 ms for the 1x1 convolutions. Left float, openvino-int8 went from
    1.20x to 1.48-1.90x the fastest float in six reports.
    efficientnet's Sigmoid gates fuse theirs: left float, they cost 0.3 ms of FakeQuantize
    elsewhere, so they stay int8 (docs/measurements.md's git history)."""
    names = []
    for op in model.get_ordered_ops():
        if op.get_type_name() == "HardSigmoid":
            gated = op.input_value(0).get_node().get_name()
            names += [user.get_node().get_friendly_name()
                      for user in op.output(0).get_target_inputs()
                      if _gates_other_features(user.get_node(), op.get_name(), gated)]
    return names


def unquantize_hard_gates(model) -> list[str]:
    """Bypass, in place, the FakeQuantize ops that quantize a HardSigmoid's output for
    squeeze-excitation multiplies alone (a QDQ model OpenVINO read: openvino-qat), for the reason
    `hard_excitation_multiplies` gives: in mobilenet_v3_large's openvino-qat three such ops took
    0.93 of 3.83 ms a call at batch 32. Within the quantizer's range the gate moves by at most
    half a step; openvino-qat's parity check with torch-qat bounds the rest. x * hardsigmoid(x)
    (a Hardswish written out) is left as it is. Returns the multiplies whose gate is now float."""
    multiplies = []
    for op in model.get_ordered_ops():
        gate = op.input_value(0) if op.get_type_name() == "FakeQuantize" else None
        if gate is None or gate.get_node().get_type_name() != "HardSigmoid":
            continue
        gated = gate.get_node().input_value(0).get_node().get_name()
        users = [user.get_node() for user in op.output(0).get_target_inputs()]
        if users and all(_gates_other_features(user, op.get_name(), gated) for user in users):
            op.output(0).replace(gate)
            multiplies += [user.get_friendly_name() for user in users]
    if multiplies:
        model.validate_nodes_and_infer_types()  # after our rewrite: an error is ours
    return multiplies


def _gates_other_features(node, gate: str, gated: str) -> bool:
    """Whether ``node`` multiplies the output of ``gate`` (a HardSigmoid, or the FakeQuantize
    after it) with features other than the gate's own input ``gated``, directly or through a
    FakeQuantize of their own: a squeeze-excitation gate, not x * hardsigmoid(x)."""
    if node.get_type_name() != "Multiply" or node.get_input_size() != 2:
        return False
    others = [node.input_value(i).get_node() for i in range(2)
              if node.input_value(i).get_node().get_name() != gate]
    if len(others) != 1:
        return False
    other = others[0]
    if other.get_type_name() == "FakeQuantize":
        other = other.input_value(0).get_node()
    return other.get_name() != gated


def means_as_avg_pools(model) -> list[str]:
    """Rewrite, in place, each ReduceMean over the two spatial axes of a 4-D tensor whose height
    and width are fixed (global average pooling, as torch.export writes AdaptiveAvgPool2d(1)
    and x.mean((2, 3))) as the AvgPool OpenVINO's CPU plugin runs with a kernel of its own.
    OpenVINO 2026.4's ReduceMean kernel grows slower with a second thread: in efficientnet_b0's
    openvino-int8 (batch 32) its 17 took 0.27 ms a call on one thread and 0.54 ms on two, 16%
    of the call; as AvgPool, 0.05 ms (docs/measurements.md). The result is the same mean.
    Returns the names of the rewritten ops."""
    opset = _openvino().opset15
    rewritten = []
    for op in model.get_ordered_ops():
        if op.get_type_name() != "ReduceMean":
            continue
        features = op.input_value(0)
        shape = features.get_partial_shape()
        axes = op.input_value(1).get_node()
        if (shape.rank.is_dynamic or shape.rank.get_length() != 4
                or not (shape[2].is_static and shape[3].is_static)
                or axes.get_type_name() != "Constant"
                or sorted(int(axis) % 4 for axis in axes.get_data().ravel()) != [2, 3]):
            continue
        pool = opset.avg_pool(features, strides=[1, 1], pads_begin=[0, 0], pads_end=[0, 0],
                              kernel_shape=[shape[2].get_length(), shape[3].get_length()],
                              exclude_pad=True)
        mean = pool if op.get_attributes()["keep_dims"] else opset.squeeze(
            pool, opset.constant([2, 3], dtype=int))
        mean.set_friendly_name(op.get_friendly_name())
        op.output(0).replace(mean.output(0))
        rewritten.append(op.get_friendly_name())
    if rewritten:
        model.validate_nodes_and_infer_types()  # after our rewrite: an error is ours
    return rewritten


def weight_sizes(model) -> list[int]:
    """Elements of each Conv/MatMul's weight, in layer_names' order (0: not fixed, Q x K^T)."""
    shapes = [op.input(1).get_partial_shape() for op in model.get_ordered_ops()
              if op.get_type_name() in COMPUTE_OPS]
    return [0 if shape.is_dynamic else math.prod(shape.to_shape()) for shape in shapes]


def save_ir(model, xml: Path, scratch: Path) -> Path:
    """Write the IR pair under its real names: each file to a temporary name, fsynced and
    renamed, weights first so that a listed .xml never points at a missing .bin."""
    ov = _openvino()
    staged = scratch / xml.name
    with converter_errors("OpenVINO's save_model", staged):  # a full disk stays the stage's
        ov.save_model(model, str(staged), compress_to_fp16=False)
    weights = xml.with_suffix(".bin")
    for source, target in ((staged.with_suffix(".bin"), weights), (staged, xml)):
        with atomic_path(target) as tmp:
            shutil.copyfile(source, tmp)
    return weights


@variant("openvino-fp32", runtime="openvino", source="onnx-fp32", int8=False,
         description="onnx-fp32 as OpenVINO IR, f32 precision hint")
def make_fp32(ctx) -> dict:
    ov = _openvino()
    with converter_errors("OpenVINO's model converter"):  # (our own errors pass through)
        model = ov.convert_model(str(ctx.run.verified_path("onnx-fp32")))
    pools = means_as_avg_pools(model)
    xml = ctx.folder / "openvino-fp32.xml"
    weights = save_ir(model, xml, ctx.scratch)
    images = ctx.check_images()
    predict, _ = runner(compile_model(core().read_model(str(xml)), threads=1))
    info = {"converter": "openvino.convert_model", "precision_hint": "f32",
            "means_as_avg_pool": pools, "parity_vs_onnx_fp32": compare_logits(
                ctx.logits_of("onnx-fp32", images), predict(images))}
    ctx.register("openvino-fp32", xml, info, fmt="openvino", companions=(weights,),
                 op_counts=runtime_op_counts(compile_model(core().read_model(str(xml)), 1)))
    return info


def precision_hint(name: str) -> str:
    """The INFERENCE_PRECISION_HINT a variant is compiled with (int8 IRs: their float layers)."""
    return "bf16" if name == "openvino-bf16" else "f32"


@variant("openvino-bf16", runtime="openvino", source="openvino-fp32", int8=False,
         description="openvino-fp32's IR run in bf16, OpenVINO's default on a CPU with bf16 "
                     "instructions")
def make_bf16(ctx) -> dict:
    """No new file: openvino-fp32's IR under the bf16 hint, scored against it (a bf16 kernel
    that loses accuracy is refused, with its record)."""
    from stages.measure.machine import cpu_has_bf16

    if not cpu_has_bf16():
        return ctx.refuse("openvino-bf16", "not made: this CPU has no bf16 instructions "
                          "(AVX-512 BF16 or AMX), where OpenVINO would emulate bf16 more slowly "
                          "than it runs f32")
    xml = ctx.run.verified_path("openvino-fp32")
    model = core().read_model(str(xml))
    fp32_predict = runner(compile_model(model, ctx.threads))[0]
    bf16_predict = runner(compiled := compile_model(model, ctx.threads, precision="bf16"))[0]
    record = ctx.score_without_search("openvino-bf16", bf16_predict, fp32_predict,
                                      "openvino-fp32", {"precision_hint": "bf16"})
    if record["chosen"] is None:
        return ctx.not_kept("openvino-bf16", record)
    images = ctx.check_images()
    info = {"precision_hint": "bf16", "tuning": record,
            "parity_vs_openvino_fp32": compare_logits(fp32_predict(images),
                                                      bf16_predict(images))}
    ctx.register("openvino-bf16", xml, info, fmt="openvino",
                 companions=(xml.with_suffix(".bin"),), op_counts=runtime_op_counts(compiled))
    return info


def _int8_backend(ctx, fp32_model, calibration) -> tuning.Backend:
    nncf = _nncf()
    dataset = nncf.Dataset([batch.numpy() for batch in calibration])

    gates = hard_excitation_multiplies(fp32_model)

    def build(options: dict, float_layers):
        names = list(float_layers) + gates
        scope = nncf.IgnoredScope(names=names) if names else None
        # NNCF draws progress bars on stdout, where the CLI prints the paths it wrote.
        with contextlib.redirect_stdout(io.StringIO()), converter_errors("NNCF"):
            return nncf.quantize(fp32_model, dataset, subset_size=len(calibration),
                                 preset=getattr(nncf.QuantizationPreset, options["preset"]),
                                 ignored_scope=scope)

    def runner_of(model):
        return runner(compile_model(model, ctx.threads))

    return tuning.Backend(
        build=build,
        predict=lambda model, images: runner_of(model)[0](images),
        call=lambda model, batch: runner_of(model)[1](batch),
        layers=lambda options: layer_names(fp32_model),
        # NNCF's presets: weights per channel, 8 bits (its overflow fix halves only the first
        # layer's range on CPUs without VNNI).
        errors=lambda options: sensitivity.by_position(
            ctx.float_model(), sensitivity.layer_errors(ctx.float_model(), calibration,
                                                        Scheme(per_channel=True)),
            layer_names(fp32_model), weight_sizes(fp32_model)))


@variant("openvino-int8", runtime="openvino", source="openvino-fp32", int8=True,
         description="NNCF post-training int8, run by OpenVINO")
def make_int8(ctx) -> dict:
    config = ctx.config
    fp32_model = core().read_model(str(ctx.run.verified_path("openvino-fp32")))
    calibration = ctx.calibration()
    # PERFORMANCE: symmetric activations, the fast default for conv nets; MIXED: asymmetric
    # activations, which suit activations that are not centred on zero.
    presets = ["PERFORMANCE", "MIXED"] if config.auto else ["PERFORMANCE"]
    fp32_predict, _ = runner(compile_model(fp32_model, ctx.threads))
    reference = ctx.reference(fp32_predict, "openvino-fp32")
    ctx.say("openvino-int8: scoring on the validation slice")
    trial, record = tuning.tune(_int8_backend(ctx, fp32_model, calibration),
                                [{"preset": p} for p in presets], reference,
                                config.max_accuracy_drop, say=ctx.say,
                                seconds=config.tuning_time)
    if trial is None:
        return ctx.not_kept("openvino-int8", record)
    xml = ctx.folder / "openvino-int8.xml"
    weights = save_ir(trial.model, xml, ctx.scratch)
    images = ctx.check_images()
    before, _ = runner(compile_model(trial.model, 1))
    written = compile_model(core().read_model(str(xml)), 1)
    after, _ = runner(written)
    import torch

    if not torch.equal(before(images), after(images)):
        raise PipelineError(f"openvino-int8: the IR reloaded from {xml} does not reproduce its "
                            "predictions; please report this with --debug output")
    info = trial.options | {
        "quantizer": "nncf.quantize", "float_layers": list(trial.float_layers),
        "float_excitation_multiplies": hard_excitation_multiplies(fp32_model),
        "bias_correction": "fast (nncf.quantize's default)",
        "tuning": record, "calibration_samples": int(sum(len(b) for b in calibration)),
        "calibration_split": "train",
        "parity_vs_openvino_fp32": compare_logits(fp32_predict(images), after(images))}
    ctx.register("openvino-int8", xml, info, fmt="openvino", companions=(weights,),
                 op_counts=runtime_op_counts(written))
    return info


@loader("openvino")
def load(run, name: str, threads: int) -> Loaded:
    ov = _openvino()
    path = run.verified_path(name)  # checks the .bin beside it too
    try:
        model = core().read_model(str(path))
    except Exception as exc:
        raise PipelineError(f"{name}: OpenVINO cannot read {path}: "
                            f"{str(exc).strip().splitlines()[0][:200]}") from exc
    hint = precision_hint(name)
    compiled = compile_model(model, threads, precision=hint)
    predict, call_for = runner(compiled)
    int8 = {"openvino-int8": "int8 (NNCF)", "openvino-qat": "int8 (QAT's QDQ model)"}.get(name)
    return Loaded(predict, call_for, runtime_op_counts(compiled),
                  f"OpenVINO {ov.get_version().split('-')[0]}, {int8 or f'{hint} hint'}",
                  precision="int8" if int8 else {"f32": "fp32"}.get(hint, hint),
                  profile=lambda batch, calls: profilers.openvino_profile(
                      compile_model(model, threads, profiling=True, precision=hint), batch,
                      calls),
                  kernels=lambda batch: runtime_kernels(compiled))
