"""PyTorch: the trained models as they are served (`fp32` eager, `amp` under autocast in its
training precision), the best float PyTorch (`fp32-compiled`: Inductor with freezing), and int8
through torchao's PT2E flow (`torch-dynamic`, `torch-static`, `torch-qat`): torch.export, an
X86InductorQuantizer, convert_pt2e, then torch.compile with freezing so that oneDNN's int8
kernels run. After compiling, the generated code is read to count which convolutions and
linear layers really run in int8: a silent float fallback is an error, not a result.

A PT2E model is stored as data (stages/graph_file), never with torch.export.save, whose loader
runs code from the file.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import re
import warnings

from stages.measure.evaluate import compare_logits, predict
from stages.measure.machine import cpu_has_vnni
from stages.models.build import build_from_spec
from stages.quantization import sensitivity, tuning
from stages.quantization.sensitivity import Scheme
from stages.run.artifacts import atomic_torch_save, load_checkpoint, sha256_file
from stages.run.errors import PipelineError
from stages.runtimes import (
    FLOAT,
    Loaded,
    declare,
    graph_file,
    loader,
    profilers,
    torchao_patterns,
    variant,
)

# What Inductor emits for each kind of kernel (torch 2.14, torchao 0.18).
KERNELS = {
    ("Conv", "int8"): r"torch\.ops\.onednn\.qconv(?:2d)?_pointwise[\w.]*\(",
    ("Linear", "int8"): r"torch\.ops\.onednn\.qlinear_pointwise[\w.]*\(",
    ("Conv", "float"): r"(?:mkldnn\._convolution_pointwise[\w.]*\(|extern_kernels\.convolution\(|"
                       r"aten\.convolution[\w.]*\()",
    ("Linear", "float"): r"(?:mkldnn\._linear_pointwise[\w.]*\(|extern_kernels\.(?:mm|addmm|bmm|"
                         r"baddbmm)\(|mkl\._mkl_linear[\w.]*\()",
}


# ---------------------------------------------------------------- float models


def load_float_module(run, name: str):
    """A trained (or imported) model as an eager fp32 module, from its verified weights-only
    file."""
    data = load_checkpoint(run.verified_path(name))
    if not isinstance(data, dict) or "state_dict" not in data or "model_spec" not in data:
        raise PipelineError(f"{name}: {run.verified_path(name)} is not a pipeline model file")
    model = build_from_spec(data["model_spec"])
    try:
        model.load_state_dict(data["state_dict"])
    except RuntimeError as exc:
        raise PipelineError(f"{name}: the weights in {run.verified_path(name)} do not fit "
                            f"{data['model_spec']['model']}: {str(exc).splitlines()[0]}") from None
    return model.eval()


def eager_counts(model) -> dict[str, dict[str, int]]:
    from torch import nn

    counts = {}
    for module in model.modules():
        kind = ("Conv" if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) else
                "Linear" if isinstance(module, nn.Linear) else None)
        if kind:
            counts.setdefault(kind, {"int8": 0, "float": 0})["float"] += 1
    return counts


def _call(model, batch, context=contextlib.nullcontext):
    import torch

    def call():
        with torch.inference_mode(), context():
            return model(batch)

    return call


COMPILED_BATCH = 32  # compiled models predict in batches of this size: one graph to build
KERNEL_AGREEMENT_TO_WARN = 0.99  # compiled against the quantized graph, top-1 on check images


def _compile(module):
    """torch.compile for inference: Inductor with freezing (weights become constants, so
    oneDNN can pre-pack them and fuse int8 patterns), one graph per batch size (compiling
    with dynamic shapes failed on the second batch size in the int8 convolution)."""
    import torch
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True
    # Inductor's own int8 lowering copies a tensor the way it tells others not to.
    warnings.filterwarnings("ignore", message="To copy construct from a tensor",
                            category=UserWarning, module=r"torch\._inductor")
    return torch.compile(module, dynamic=False)


# Compiled models kept for the life of the process, keyed by the sha256 of the file they came
# from, what was compiled and the thread count Inductor generated their kernels for: in a
# chain, quantize has already compiled what report then loads, and each compile takes 3 to 15 s
# on the 2-core development machine (Inductor's graph cache skips graphs with frozen weights).
_COMPILED: dict[tuple[str, str, int], object] = {}


def compiled_once(sha256: str, kind: str, build):
    """``_compile(build())``, or the module compiled for the same file before in this process."""
    import torch

    key = (sha256, kind, torch.get_num_threads())
    if key not in _COMPILED:
        _COMPILED[key] = _compile(build())
    return _COMPILED[key]


def predict_compiled(compiled, images):
    """Logits of a compiled model in batches of one size, the last one padded with zeros, so
    that scoring a data set builds no graph beyond the one timed at that size."""
    import torch

    outputs = []
    for start in range(0, len(images), COMPILED_BATCH):
        batch = images[start:start + COMPILED_BATCH]
        padded = torch.cat([batch, batch.new_zeros(COMPILED_BATCH - len(batch),
                                                   *batch.shape[1:])])
        outputs.append(predict(compiled, padded)[:len(batch)])
    return torch.cat(outputs) if outputs else torch.empty(0)


def _generated_code(compiled, batch) -> str:
    """The code Inductor generates when ``compiled`` first runs on ``batch``'s shape. Captured
    as it is written rather than with run_and_get_code, which resets Dynamo and so throws away
    every other compiled model of the process."""
    import torch
    from torch._inductor.graph import GraphLowering

    code: list[str] = []
    real = GraphLowering.save_output_code
    GraphLowering.save_output_code = staticmethod(code.append)
    try:
        with torch.inference_mode():
            compiled(batch)
    finally:
        GraphLowering.save_output_code = real
    return "\n".join(code)


_CODE: dict[tuple[int, tuple[int, ...]], str] = {}  # (id of a compiled model, input shape)


def compiled_counts(compiled, batch) -> dict[str, dict[str, int]]:
    """Count the convolution and linear kernels, by kind, in the code Inductor generated for
    ``compiled`` at ``batch``'s shape (compiling it there if it was not yet)."""
    key = (id(compiled), tuple(batch.shape))
    if key not in _CODE:
        _CODE[key] = _generated_code(compiled, batch)
    if not _CODE[key]:  # compiled before this process kept its code: compile it afresh
        import torch
        from torch._inductor.utils import run_and_get_code

        with torch.inference_mode():
            _CODE[key] = "\n".join(run_and_get_code(compiled, batch)[1])
    counts: dict[str, dict[str, int]] = {}
    for (kind, precision), pattern in KERNELS.items():
        found = len(re.findall(pattern, _CODE[key]))
        if found:
            counts.setdefault(kind, {"int8": 0, "float": 0})[precision] += found
    return counts


def _example(spec: dict, batch: int = 2):
    import torch

    return torch.zeros(batch, spec["in_channels"], spec["image_size"], spec["image_size"])


# ---------------------------------------------------------------- PT2E


def _pt2e():
    """torchao's PT2E API, with the notices it prints on import silenced."""
    import logging

    # Two notices through logging: torchao's import registers an Enum the deprecated way, and
    # a CUDA build on a machine without CUDA says so at the first compile.
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchao.quantization.pt2e import quantize_pt2e
            from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer
    except ImportError:
        raise PipelineError("torch int8 needs torchao: pip install 'torchao>=0.18', or leave "
                            "torch-* out of --methods") from None
    torchao_patterns.install()
    return quantize_pt2e, x86_inductor_quantizer


def export_graph(model, spec: dict, train: bool = False):
    """torch.export with a dynamic batch axis. Strict mode: non-strict export of torchvision's
    ResNets (one ReLU module called twice) fails in X86InductorQuantizer with "Input partition
    has more than one output node"."""
    import torch

    model = model.train() if train else model.eval()
    try:
        return torch.export.export(model, (_example(spec, 4),), strict=True, dynamic_shapes=(
            {0: torch.export.Dim("batch", min=1)},)).module()
    except Exception as exc:
        raise PipelineError(f"torch.export of {spec['model']} failed, so PT2E int8 cannot be "
                            f"made: {str(exc).strip().splitlines()[0][:300]}") from exc


def pt2e_options(dynamic: bool = False, observer: str = "histogram") -> dict:
    """X86InductorQuantizer's recipe (per-channel symmetric weights, per-tensor activations),
    with 7-bit weights (-63..63) on a CPU without VNNI, where full-range u8 x s8 products
    saturate in the kernels (two products summed in int16). torchao's own `reduce_range`
    narrows the activations instead; on mnasnet0_5 that lost 33 points on held-out images
    where 7-bit weights lose 6.7, and its compiled kernels strayed further from their own
    reference (largest logit error 1.5 output standard deviations against 0.4)."""
    options = {"dynamic": dynamic, "per_channel": True, "weight_bits": 8 if cpu_has_vnni() else 7}
    return options if dynamic else options | {"observer": observer}


def make_quantizer(options: dict, float_layers=(), qat: bool = False):
    import dataclasses

    import torch

    _, x86 = _pt2e()
    config = x86.get_default_x86_inductor_quantization_config(
        is_dynamic=options.get("dynamic", False), is_qat=qat)
    if options.get("weight_bits", 8) != 8:
        limit = 2 ** (options["weight_bits"] - 1) - 1  # symmetric: oneDNN needs zero point 0
        config = dataclasses.replace(config, weight=dataclasses.replace(
            config.weight, quant_min=-limit, quant_max=limit))
    if options.get("observer") == "minmax" and not qat:
        # The activations' range from their extremes rather than X86InductorQuantizer's
        # histogram (which trims outliers to lower the rounding error of the rest).
        from torchao.quantization.pt2e.observer import MinMaxObserver

        spec = config.input_activation
        config = dataclasses.replace(config, input_activation=dataclasses.replace(
            spec, observer_or_fake_quant_ctr=MinMaxObserver.with_args(eps=2 ** -12)))
    if qat:
        config = _qat_weights_as_deployed(config)
    quantizer = x86.X86InductorQuantizer()
    if options.get("dynamic"):
        # Dynamic int8 for the Linear layers alone, as ort-dynamic: set globally, it also
        # stored resnet18's convolution weights in int8 and dequantized them at every call
        # (47.9 ms at batch 32 against 18.8 for fp32-compiled, AMD EPYC).
        quantizer.set_module_type_qconfig(torch.nn.Linear, config)
    else:
        quantizer.set_global(config)
    for name in float_layers:
        quantizer.set_module_name_qconfig(name, None)
    return quantizer


def _qat_weights_as_deployed(config):
    """The QAT config with weights fake-quantized by the qparams convert_pt2e will use.

    torchao 0.18 fake-quantizes QAT weights with the fused kernel
    (torch.fused_moving_avg_obs_fake_quant), which makes a per-channel "symmetric" range
    affine where a channel's weights are all of one sign: half the step and a zero point of
    +-127/128. convert_pt2e asks the observer instead, which is symmetric with zero point 0,
    as oneDNN's int8 kernels need. So training saw finer weights than the model deployed:
    on mnasnet0_5 (depthwise channels of 9 weights, often of one sign) the converted graph
    agreed with its fake-quantized self on 87.5% of images. Plain FakeQuantize takes its
    qparams from the same observer as convert. Fixed upstream after 0.18 (pytorch/ao#4824)."""
    import dataclasses

    from torchao.quantization.pt2e.fake_quantize import FakeQuantize
    from torchao.quantization.pt2e.observer import MovingAveragePerChannelMinMaxObserver

    spec = config.weight
    weight = dataclasses.replace(spec, observer_or_fake_quant_ctr=FakeQuantize.with_args(
        observer=MovingAveragePerChannelMinMaxObserver, quant_min=spec.quant_min,
        quant_max=spec.quant_max, dtype=spec.dtype, qscheme=spec.qscheme, ch_axis=spec.ch_axis,
        eps=2 ** -12))
    return dataclasses.replace(config, weight=weight)


def quantize_pt2e(model, spec: dict, options: dict, calibration, float_layers=(),
                  exported=None):
    """The float ``model`` (untouched) as a converted PT2E int8 graph; ``exported``, if given,
    is its export_graph, copied rather than exported again."""
    import torch

    quantize_pt2e_module, _ = _pt2e()
    graph = (copy.deepcopy(exported) if exported is not None
             else export_graph(copy.deepcopy(model), spec))
    prepared = quantize_pt2e_module.prepare_pt2e(graph, make_quantizer(options, float_layers))
    with torch.inference_mode():
        for batch in calibration:
            prepared(batch)
    return plain_graph(quantize_pt2e_module.convert_pt2e(prepared))


def plain_graph(graph):
    """The converted graph as a plain GraphModule of operators (what a file holds), so that
    the model measured is the model saved; convert_pt2e's result also keeps the unused float
    weights and export's guard module."""
    return graph_file.from_data(graph_file.to_data(graph))


def layer_names(model) -> list[str]:
    """Module names of the Conv and Linear layers: what set_module_name_qconfig keeps float."""
    from torch import nn

    return [name for name, module in model.named_modules()
            if isinstance(module, (nn.Conv2d, nn.Linear))]


def save_pt2e(graph, path, spec: dict, recipe: dict) -> None:
    """The converted graph as data (stages/graph_file), with the recipe that made it."""
    atomic_torch_save({"model_spec": spec, "recipe": recipe,
                       "graph": graph_file.to_data(graph)}, path)


def load_pt2e(run, name: str):
    """A PT2E int8 graph from its verified file, ready to compile."""
    return load_graph_file(run.verified_path(name), name)


def load_graph_file(path, name: str):
    data = load_checkpoint(path)
    if not isinstance(data, dict) or "graph" not in data:
        raise PipelineError(f"{name}: {path} is not a pipeline PT2E model file")
    _pt2e()  # registers the quantized_decomposed operators and Inductor's int8 passes
    try:
        return graph_file.from_data(data["graph"])
    except PipelineError as exc:
        raise PipelineError(f"{name}: {path}: {exc}") from None
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise PipelineError(f"{name}: {path} is not a well-formed graph file "
                            f"({type(exc).__name__}: {exc})") from None


# ---------------------------------------------------------------- making the variants


# Made by the train (or import) stage.
declare("fp32", runtime="pytorch", source=None, int8=False, trained=True,
        description="trained in float32, eager PyTorch")
declare("amp", runtime="pytorch", source=None, int8=False, trained=True,
        description="trained with autocast, served in its training precision")


@variant("fp32-compiled", runtime="pytorch", source=FLOAT, int8=False,
         description="the float weights under torch.compile (Inductor, freezing)")
def make_compiled(ctx) -> dict:
    """No new file: the float source's weights, compiled at load; checked here once, after
    the stage's exports (each one resets every compiled model of the process)."""
    info = {"compiler": "torch.compile(dynamic=False), Inductor freezing"}

    def check() -> None:
        model = ctx.float_model()
        images = ctx.check_images()
        compiled = compiled_once(ctx.run.entry(ctx.source)["sha256"], "float",
                                 lambda: copy.deepcopy(model))
        counts = compiled_counts(compiled, images[:COMPILED_BATCH])
        info["parity_vs_source"] = compare_logits(predict(model, images),
                                                  predict_compiled(compiled, images))
        ctx.register("fp32-compiled", ctx.run.verified_path(ctx.source), info, fmt="pytorch",
                     op_counts=counts)

    ctx.after_exports("fp32-compiled", check)
    return info


def _backend(ctx, calibration) -> dict:
    spec = ctx.spec
    # Exported once per source model: export is most of a trial's time (4.4 of 7.3 s on
    # mnasnet0_5), and the per-layer fallback builds one trial per layer.
    exported = functools.cache(lambda equalize: export_graph(
        copy.deepcopy(ctx.source_model({"equalize": equalize})), spec))
    return {"build": lambda options, float_layers: quantize_pt2e(
                ctx.source_model(options), spec, options, calibration, float_layers,
                exported=exported(bool(options.get("equalize")))),
            "predict": lambda graph, images: predict(graph, images),
            "call": lambda graph, batch: _call(_compile(graph), batch),
            "layers": lambda options: layer_names(ctx.float_model()),
            "errors": lambda options: sensitivity.layer_errors(
                ctx.source_model(options), calibration,
                Scheme(per_channel=True, weight_bits=options.get("weight_bits", 8)))}


def _finish(ctx, name: str, graph, recipe: dict, info: dict) -> dict:
    """Save and rebuild from the file (same predictions as before saving); then, once the
    stage's exports are done, compile and check for int8 kernels in the compiled code."""
    import torch

    path = ctx.folder / f"{name}.pt"
    save_pt2e(graph, path, ctx.spec, recipe)
    images = ctx.check_images()
    reloaded = load_graph_file(path, name)
    before, after = predict(graph, images), predict(reloaded, images)
    if not torch.equal(before, after):
        raise PipelineError(f"{name}: the model rebuilt from {path} does not reproduce its "
                            "predictions; please report this with --debug output")
    ctx.after_exports(name, lambda: _check_compiled(ctx, name, path, reloaded, after, info))
    return info


def _check_compiled(ctx, name: str, path, reloaded, after, info: dict) -> None:
    images = ctx.check_images()
    compiled = compiled_once(sha256_file(path), "pt2e", lambda: reloaded)
    counts = compiled_counts(compiled, images[:COMPILED_BATCH])
    # What runs is Inductor's code, not the graph: on efficientnet_b0 they disagreed on 2-4%
    # of images (mnasnet0_5: none). Its squeeze-excitation pools are quantized averages whose
    # input and output share a scale, so a mean on an exact half step rounds either way by
    # summation order, and Inductor's fused kernel sums in another order than ATen.
    kernels = compare_logits(after, predict_compiled(compiled, images))
    info |= {"format": "PT2E (torchao), compiled with Inductor freezing",
             "parity_vs_source": compare_logits(predict(ctx.float_model(), images), after),
             "compiled_vs_graph": kernels}
    if kernels["top1_agreement"] < KERNEL_AGREEMENT_TO_WARN:
        ctx.say(f"{name}: compiled, its int8 kernels agree with the quantized graph on "
                f"{kernels['top1_agreement']:.1%} of {kernels['samples']} training images (max "
                f"logit difference {kernels['max_abs_diff']:.3g}); the report measures the "
                "compiled model")
    ctx.register(name, path, info, fmt="pytorch", op_counts=counts)


@variant("torch-dynamic", runtime="pytorch", source=FLOAT, int8=True,
         description="PT2E dynamic int8 of the Linear layers (activations quantized at run "
                     "time), compiled")
def make_dynamic(ctx) -> dict:
    import torch

    model = ctx.float_model()
    if not any(isinstance(m, torch.nn.Linear) for m in model.modules()):
        return ctx.refuse("torch-dynamic", "not made: the model has no fully connected layer "
                          "(Linear), the only kind PT2E dynamic int8 quantizes; torch-static "
                          "quantizes convolutions")
    options = pt2e_options(dynamic=True)
    # Activations are quantized at run time; one batch lets the weight observers see weights.
    graph = quantize_pt2e(model, ctx.spec, options, ctx.calibration()[:1])
    record = ctx.score_without_search("torch-dynamic", lambda images: predict(graph, images),
                                      lambda images: predict(model, images), options)
    if record["chosen"] is None:
        return ctx.not_kept("torch-dynamic", record)
    recipe = {"options": options, "float_layers": []}
    return _finish(ctx, "torch-dynamic", graph, recipe, recipe | {"tuning": record})


@variant("torch-static", runtime="pytorch", source=FLOAT, int8=True,
         description="PT2E static int8 (X86InductorQuantizer), compiled")
def make_static(ctx) -> dict:
    config = ctx.config
    calibration = ctx.calibration()
    # --auto: the activations' range from a histogram (X86InductorQuantizer's own) or from
    # their extremes, and the histogram after cross-layer equalization; weights stay
    # per-channel, with 7 bits where the CPU lacks VNNI.
    equalize = ctx.equalizes(per_tensor_weights=False)
    candidates = [pt2e_options(observer="histogram") | {"equalize": equalize}]
    if config.auto:
        candidates.append(pt2e_options(observer="minmax") | {"equalize": equalize})
        if config.equalize is None and ctx.equalized_model()[1]["applied"]:
            candidates.append(pt2e_options(observer="histogram") | {"equalize": True})
    reference = ctx.reference(lambda images: predict(ctx.float_model(), images))
    ctx.say("torch-static: scoring on the validation slice")
    trial, record = tuning.tune(_backend(ctx, calibration), candidates, reference,
                                config.max_accuracy_drop, say=ctx.say,
                                seconds=config.tuning_time)
    if trial is None:
        return ctx.not_kept("torch-static", record)
    recipe = {"options": trial.options, "float_layers": list(trial.float_layers)}
    if trial.options["equalize"]:
        recipe["equalization"] = ctx.equalized_model()[1]
    return _finish(ctx, "torch-static", trial.model, recipe, recipe | {
        "tuning": record, "calibration_samples": int(sum(len(b) for b in calibration)),
        "calibration_split": "train"})


# Made by the qat stage.
declare("torch-qat", runtime="pytorch", source=FLOAT, int8=True, trained=True,
        description="fine-tuned with fake quantization (PT2E QAT), converted to int8")


# ---------------------------------------------------------------- loading


@loader("pytorch")
def load(run, name: str, threads: int) -> Loaded:
    import torch

    torch.set_num_threads(threads)
    entry = run.entry(name)
    if name in ("fp32", "amp") or name == "fp32-compiled":
        source = name if name != "fp32-compiled" else entry["parent"]
        model = load_float_module(run, source)
        if name == "fp32-compiled":
            compiled = compiled_once(run.entry(source)["sha256"], "float", lambda: model)
            return Loaded(lambda images: predict_compiled(compiled, images),
                          lambda batch: _call(compiled, batch),
                          entry["quantization"]["op_counts"],
                          "torch.compile (Inductor, freezing), fp32",
                          profile=_profiled(compiled))
        precision = (entry.get("training") or {}).get("precision", "fp32")
        if name == "amp" and precision in ("bf16", "fp16"):
            dtype = torch.bfloat16 if precision == "bf16" else torch.float16
            context = lambda: torch.autocast("cpu", dtype=dtype)  # noqa: E731
            return Loaded(lambda images: predict(model, images, autocast=context),
                          lambda batch: _call(model, batch, context), eager_counts(model),
                          f"eager PyTorch under {precision} autocast, as trained",
                          profile=_profiled(model, context))
        return Loaded(lambda images: predict(model, images), lambda batch: _call(model, batch),
                      eager_counts(model), "eager PyTorch, fp32", profile=_profiled(model))
    run.verified_path(name)  # checked every time, compiled once per process
    compiled = compiled_once(entry["sha256"], "pt2e", lambda: load_pt2e(run, name))
    return Loaded(lambda images: predict_compiled(compiled, images),
                  lambda batch: _call(compiled, batch),
                  entry["quantization"]["op_counts"], "PT2E int8, torch.compile (Inductor)",
                  profile=_profiled(compiled))


def _profiled(model, context=contextlib.nullcontext):
    return lambda batch, calls: profilers.torch_profile(_call(model, batch, context), calls)
