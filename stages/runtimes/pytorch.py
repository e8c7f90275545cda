"""PyTorch: the trained models as they are served (`fp32` eager, `amp` under autocast in its
training precision), the best float PyTorch (`fp32-compiled`: Inductor with freezing), and int8
through torchao's PT2E flow (`torch-dynamic`, `torch-static`, `torch-qat`; runtimes/pt2e.py),
then torch.compile with freezing so that oneDNN's int8 kernels run. After compiling, the
generated code is read to count which convolutions and linear layers really run in int8: a
silent float fallback is an error, not a result. `serve` is how each variant runs: the loader,
the GPU rows (runtimes/gpu.py) and export all take it from there.
"""
from __future__ import annotations

import contextlib
import copy
import functools
from dataclasses import dataclass

from stages.measure.evaluate import compare_logits, predict
from stages.models.build import build_from_spec
from stages.quantization import sensitivity, tuning
from stages.quantization.sensitivity import Scheme
from stages.run.errors import PipelineError
from stages.run.files import converter_errors, sha256_file
from stages.run.loading import load_checkpoint
from stages.run.trained import FLOAT_MODELS
from stages.runtimes import FLOAT, Loaded, declare, inductor, loader, profilers, pt2e, variant

# ---------------------------------------------------------------- float models


def load_float_module(run, name: str):
    """A trained (or imported) model as an eager fp32 module, from its verified file."""
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


# ---------------------------------------------------------------- making the variants


# Made by the train (or import) stage.
declare("fp32", runtime="pytorch", source=None, int8=False, trained=True, stage="train",
        description="trained in float32, eager PyTorch")
declare("amp", runtime="pytorch", source=None, int8=False, trained=True, stage="train",
        description="trained with autocast, served in its training precision")


@variant("fp32-compiled", runtime="pytorch", source=FLOAT, int8=False,
         description="the float weights under torch.compile (Inductor, freezing, C++ "
                     "wrapper)")
def make_compiled(ctx) -> dict:
    """No new file: the float source's weights, compiled at load; checked here once, after
    the stage's exports (each one resets every compiled model of the process)."""
    info = {"compiler": "torch.compile(dynamic=False), Inductor freezing and C++ wrapper"}

    def check() -> None:
        model = ctx.float_model()
        images = ctx.check_images()
        with converter_errors("torch.compile (Inductor)"):
            compiled = inductor.compiled_once(ctx.run.entry(ctx.source)["sha256"], "float",
                                              lambda: copy.deepcopy(model))
            counts = inductor.compiled_counts(compiled, images[:inductor.COMPILED_BATCH])
        info["parity_vs_source"] = compare_logits(predict(model, images),
                                                  inductor.predict_compiled(compiled, images))
        ctx.register("fp32-compiled", ctx.run.verified_path(ctx.source), info, fmt="pytorch",
                     op_counts=counts)

    ctx.after_exports("fp32-compiled", check)
    return info


@variant("amp-compiled", runtime="pytorch", source=FLOAT, int8=False,
         description="the float weights under torch.compile in bf16 autocast: the AMP model "
                     "as Inductor serves it, on a CPU with bf16 instructions")
def make_bf16_compiled(ctx) -> dict:
    """No new file, like fp32-compiled; scored against the float model on the held-out images
    (a bf16 kernel that loses accuracy is refused, with its record)."""
    from stages.measure.machine import cpu_has_bf16

    if not cpu_has_bf16():
        return ctx.refuse("amp-compiled", "not made: this CPU has no bf16 instructions "
                          "(AVX-512 BF16 or AMX), where bf16 is emulated more slowly than fp32")
    info = {"compiler": "torch.compile(dynamic=False), Inductor freezing and C++ wrapper",
            "autocast": "bf16"}

    def check() -> None:
        model = ctx.float_model()
        images = ctx.check_images()
        with converter_errors("torch.compile (Inductor)"):  # compiled at its first call
            compiled = inductor.compiled_once(
                ctx.run.entry(ctx.source)["sha256"], "float-bf16",
                lambda: autocast_module(copy.deepcopy(model), "bf16"))
            counts = inductor.compiled_counts(compiled, images[:inductor.COMPILED_BATCH])
        record = ctx.score_without_search(
            "amp-compiled", functools.partial(inductor.predict_compiled, compiled),
            lambda images: predict(model, images), ctx.source, {"autocast": "bf16"})
        if record["chosen"] is None:
            ctx.not_kept("amp-compiled", record)
            return
        info.update(tuning=record, parity_vs_source=compare_logits(
            predict(model, images), inductor.predict_compiled(compiled, images)))
        ctx.register("amp-compiled", ctx.run.verified_path(ctx.source), info, fmt="pytorch",
                     op_counts=counts)

    ctx.after_exports("amp-compiled", check)
    return info


def _backend(ctx, calibration) -> tuning.Backend:
    spec = ctx.spec
    # Exported once per source model: export is most of a trial's time (4.4 of 7.3 s on
    # mnasnet0_5), and the per-layer fallback builds one trial per layer.
    exported = functools.cache(lambda equalize: pt2e.export_graph(
        copy.deepcopy(ctx.source_model({"equalize": equalize})), spec))
    return tuning.Backend(
        build=lambda options, float_layers: pt2e.quantize_pt2e(
            ctx.source_model(options), spec, options, calibration, float_layers,
            exported=exported(bool(options.get("equalize")))),
        predict=predict,
        call=lambda graph, batch: _call(inductor.compile_module(graph), batch),
        layers=lambda options: _quantized_layers(ctx.float_model(), options),
        errors=lambda options: sensitivity.layer_errors(
            ctx.source_model(options), calibration,
            Scheme(per_channel=True, weight_bits=options.get("weight_bits", 8))))


def _quantized_layers(model, options: dict) -> list[str]:
    """The layers a configuration quantizes: what the per-layer fallback may keep in float."""
    floats = set(pt2e.depthwise_names(model)) if options.get("float_depthwise") else set()
    return [name for name in pt2e.layer_names(model) if name not in floats]


def save_and_check(ctx, name: str, graph, recipe: dict, info: dict) -> dict:
    """Save and rebuild from the file (same predictions as before saving); then, once the
    stage's exports are done, compile and check for int8 kernels in the compiled code."""
    import torch

    path = ctx.folder / f"{name}.pt"
    pt2e.save_pt2e(graph, path, ctx.spec, recipe)
    images = ctx.check_images()
    reloaded = pt2e.load_graph_file(path, name)
    before, after = predict(graph, images), predict(reloaded, images)
    if not torch.equal(before, after):
        raise PipelineError(f"{name}: the model rebuilt from {path} does not reproduce its "
                            "predictions; please report this with --debug output")
    ctx.after_exports(name, lambda: _check_compiled(ctx, name, path, reloaded, after, info))
    return info


KERNEL_AGREEMENT_TO_WARN = 0.99  # compiled against the quantized graph, top-1 on check images


def _check_compiled(ctx, name: str, path, reloaded, after, info: dict) -> None:
    images = ctx.check_images()
    with converter_errors("torch.compile (Inductor)"):
        compiled = inductor.compiled_once(sha256_file(path), "pt2e", lambda: reloaded)
        counts = inductor.compiled_counts(compiled, images[:inductor.COMPILED_BATCH])
    # What runs is Inductor's code, not the graph: on efficientnet_b0 they disagreed on 2-4%
    # of images (mnasnet0_5: none). Its squeeze-excitation pools are quantized averages whose
    # input and output share a scale, so a mean on an exact half step rounds either way by
    # summation order, and Inductor's fused kernel sums in another order than ATen.
    kernels = compare_logits(after, inductor.predict_compiled(compiled, images))
    info |= {"format": "PT2E (torchao), compiled with Inductor freezing and C++ wrapper",
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
    if (pointless := ctx.pointless_dynamic_int8("torch-dynamic", "torch-static")) is not None:
        return pointless
    options = pt2e.pt2e_options(dynamic=True)
    # Activations are quantized at run time; one batch lets the weight observers see weights.
    graph = pt2e.quantize_pt2e(model, ctx.spec, options, ctx.calibration()[:1])
    record = ctx.score_without_search("torch-dynamic", lambda images: predict(graph, images),
                                      lambda images: predict(model, images), ctx.source,
                                      options)
    if record["chosen"] is None:
        return ctx.not_kept("torch-dynamic", record)
    recipe = {"options": options, "float_layers": []}
    return save_and_check(ctx, "torch-dynamic", graph, recipe, recipe | {"tuning": record})


def static_candidates(equalize: bool, auto: bool, also_equalized: bool,
                      depthwise: bool) -> list[dict]:
    """torch-static's configurations: X86InductorQuantizer's recipe (pt2e_options), and with
    --auto also the activations' range from their extremes rather than a histogram, the
    histogram after cross-layer equalization, and (on a model with depthwise convolutions)
    those in the other precision than this CPU's default, timed rather than assumed. Without
    ``depthwise`` (none, or nothing else to quantize) no configuration keeps them float."""
    depthwise_choice = {} if depthwise else {"float_depthwise": False}
    default = pt2e.pt2e_options(observer="histogram") | {"equalize": equalize} | depthwise_choice
    if not auto:
        return [default]
    candidates = [default, pt2e.pt2e_options(observer="minmax") | {"equalize": equalize}
                  | depthwise_choice]
    if also_equalized:
        candidates.append(default | {"equalize": True})
    if depthwise:
        candidates.append(default | {"float_depthwise": not default["float_depthwise"]})
    return candidates


@variant("torch-static", runtime="pytorch", source=FLOAT, int8=True,
         description="PT2E static int8 (X86InductorQuantizer), compiled")
def make_static(ctx) -> dict:
    config = ctx.config
    calibration = ctx.calibration()
    candidates = static_candidates(
        ctx.equalizes(per_tensor_weights=False), config.auto,
        also_equalized=config.auto and config.equalize is None
        and ctx.equalized_model()[1]["applied"],
        depthwise=bool(pt2e.depthwise_names(ctx.float_model()))
        and bool(_quantized_layers(ctx.float_model(), {"float_depthwise": True})))
    reference = ctx.reference(lambda images: predict(ctx.float_model(), images), ctx.source)
    ctx.say("torch-static: scoring on the validation slice")
    trial, record = tuning.tune(_backend(ctx, calibration), candidates, reference,
                                config.max_accuracy_drop, say=ctx.say,
                                seconds=config.tuning_time)
    if trial is None:
        return ctx.not_kept("torch-static", record)
    recipe = {"options": trial.options, "float_layers": list(trial.float_layers)}
    if trial.options["equalize"]:
        recipe["equalization"] = ctx.equalized_model()[1]
    return save_and_check(ctx, "torch-static", trial.model, recipe, recipe | {
        "tuning": record, "calibration_samples": int(sum(len(b) for b in calibration)),
        "calibration_split": "train"})


# ---------------------------------------------------------------- serving


def autocast_module(module, precision: str):
    """``module`` run under ``precision``'s autocast inside its forward, so that torch.compile
    traces the autocast region (and, with freezing, folds the weights' casts into constants)."""
    import torch

    class Autocast(torch.nn.Module):
        def __init__(self, module, precision: str):
            super().__init__()
            self.module, self.dtype = module, {"bf16": torch.bfloat16,
                                               "fp16": torch.float16}[precision]

        def forward(self, images):
            with torch.autocast(images.device.type, dtype=self.dtype):
                return self.module(images).float()

    return Autocast(module, precision).eval()


@dataclass(frozen=True)
class Serving:
    """How a PyTorch variant runs, read from its manifest entry: what the report measures,
    the GPU rows serve and an export's predict.py repeats."""

    source: str  # the variant whose file holds the module (fp32-compiled: its float parent)
    graph: bool  # a PT2E int8 graph (runtimes/pt2e.py); else a float module
    compiled: bool  # under torch.compile
    autocast: str | None  # "bf16" or "fp16": amp, served in its training precision
    # As it trained (training/layout.py): 2.1x faster under bf16 autocast at 224 (measured:
    # docs/measurements.md's git history)
    channels_last: bool = False

    def load(self, run):
        """The module as its verified file holds it: eager, on the CPU, not yet wrapped."""
        return pt2e.load_pt2e(run, self.source) if self.graph else \
            load_float_module(run, self.source)

    def compiled_module(self, run):
        """What is compiled: the module, under its autocast where it has one."""
        module = self.load(run)
        return autocast_module(module, self.autocast) if self.autocast else module

    @property
    def kind(self) -> str:
        """What was compiled, for inductor.compiled_once's key."""
        return "pt2e" if self.graph else f"float-{self.autocast}" if self.autocast else "float"

    def context(self, device_type: str):
        """A context factory the model runs under: autocast, or nothing (a compiled model
        runs its autocast inside: `compiled_module`)."""
        import torch

        if self.autocast is None or self.compiled:
            return contextlib.nullcontext
        dtype = torch.bfloat16 if self.autocast == "bf16" else torch.float16
        return lambda: torch.autocast(device_type, dtype=dtype)

    def words(self, device_type: str) -> str:
        """How it runs, in words, for the report."""
        on = " on CUDA" if device_type == "cuda" else ""
        if self.graph:
            return "PT2E int8, torch.compile (Inductor)"
        if self.compiled:
            return (f"torch.compile (Inductor{', freezing' if not on else ''}){on}, "
                    + (f"{self.autocast} autocast" if self.autocast else "fp32"))
        layout = ", channels_last" if self.channels_last and not on else ""
        if self.autocast:
            return f"eager PyTorch{on} under {self.autocast} autocast{layout}, as trained"
        return f"eager PyTorch{on}, fp32{layout}"


def serving(run, name: str) -> Serving:
    """The trained models eager (`amp` under autocast where it was trained so), the float
    weights compiled (`fp32-compiled`), every int8 variant a compiled PT2E graph."""
    entry = run.entry(name)
    if name == "fp32-compiled":
        return Serving(entry["parent"], graph=False, compiled=True, autocast=None)
    if name == "amp-compiled":
        return Serving(entry["parent"], graph=False, compiled=True, autocast="bf16")
    if name in FLOAT_MODELS:
        training = entry.get("training") or {}
        precision = training.get("precision", "fp32")
        autocast = precision if name == "amp" and precision in ("bf16", "fp16") else None
        return Serving(name, graph=False, compiled=False, autocast=autocast,
                       channels_last=training.get("memory_format") == "channels_last")
    return Serving(name, graph=True, compiled=True, autocast=None)


def serve(run, name: str, device: str = "cpu"):
    """(model, context, serving): the variant loaded from its verified file and wrapped as it
    runs on ``device``. On the CPU a compiled model is compiled once per process (the file is
    verified at every call); on CUDA, compiled at each call with torch.compile's defaults."""
    import torch

    how = serving(run, name)
    if how.compiled and device == "cpu":
        run.verified_path(how.source)
        model = inductor.compiled_once(run.entry(how.source)["sha256"], how.kind,
                                       lambda: how.compiled_module(run))
    else:
        model = (how.compiled_module(run) if how.compiled else how.load(run)).to(device)
        if device == "cuda" or how.channels_last:  # as training ran; cuDNN wants NHWC too
            model = model.to(memory_format=torch.channels_last)
        if how.compiled:
            inductor.graph_per_shape()
            model = torch.compile(model, dynamic=False)
    return model, how.context(torch.device(device).type), how


@loader("pytorch")
def load(run, name: str, threads: int) -> Loaded:
    import torch

    torch.set_num_threads(threads)
    model, context, how = serve(run, name)
    if how.compiled:  # the kernels counted in Inductor's code when the variant was made
        predict_fn = functools.partial(inductor.predict_compiled, model)
        counts = run.entry(name)["quantization"]["op_counts"]
    else:
        predict_fn = functools.partial(predict, model, autocast=context)
        counts = eager_counts(model)
    return Loaded(predict_fn, lambda batch: _call(model, batch, context), counts,
                  how.words("cpu"), precision="int8" if how.graph else how.autocast or "fp32",
                  profile=lambda batch, calls: profilers.torch_profile(
                      _call(model, batch, context), calls),
                  kernels=lambda batch: profilers.onednn_kernels(_call(model, batch, context)))
