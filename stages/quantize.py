"""Post-training quantization of the `amp` model: PyTorch dynamic and static int8, ONNX and ORT.

Static int8 is scored on held-out training images (never the test split) against its float
source; with --auto several configurations are tried and the fastest within --max-accuracy-drop
is kept, and one that misses the budget keeps its most sensitive layers in float (stages/tuning).

Every method writes its file atomically, loads it back from disk, checks that the reloaded model
gives the predictions the in-memory one gave, and registers it in the manifest. A quantized
PyTorch model is stored as a state_dict plus what rebuilds it, never as a pickled module.
"""
from __future__ import annotations

import shutil
import tempfile
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from stages import bench, export, opstats, tuning
from stages.artifacts import Run, atomic_path, atomic_torch_save, load_checkpoint
from stages.data import (DataSplits, calibration_batches, check_calibration, first_images,
                         tuning_images)
from stages.errors import PipelineError
from stages.models import build_from_spec
from stages.progress import say
from stages.registry import lookup, register
from stages.train import predict, splits_of_run

SOURCE = "amp"  # the variant every quantized model is made from
METHODS: dict[str, Callable[["QuantContext"], dict]] = {}
VARIANT_OF_METHOD = {"onnx": "onnx-fp32"}  # every other method's variant has its own name
TUNING_BATCH = 32  # candidates are timed at the report's default large batch


def register_method(name: str):
    return register(METHODS, name)


@dataclass
class QuantContext:
    run: Run
    config: object
    splits: DataSplits
    spec: dict
    folder: Path
    scratch: Path
    _batches: list = field(default_factory=list)
    _float: object = None
    _val: tuple | None = None

    def float_model(self):
        """The `amp` model, loaded and verified once; no method mutates it (prepare_fx and
        quantize_dynamic work on copies)."""
        if self._float is None:
            self._float = load_torch_model(self.run, SOURCE)
        return self._float

    def calibration(self) -> list:
        """Training images, drawn once per stage and shared by every static method."""
        if not self._batches:
            try:
                self._batches = calibration_batches(self.splits, self.config.calibration_samples,
                                                    self.config.calibration_batch_size,
                                                    self.config.seed)
            except ValueError as exc:
                raise PipelineError(str(exc)) from None
            check_calibration(self._batches, self.input_shape())
        return self._batches

    def input_shape(self) -> tuple[int, int, int]:
        return (self.spec["in_channels"], self.spec["image_size"], self.spec["image_size"])

    def validation(self):
        """Held-out training images (validation split and what calibration did not use)."""
        if self._val is None:
            self._val = tuning_images(self.splits, self.config.calibration_samples,
                                      self.config.seed)
        return self._val

    def reference(self, predict_fn) -> dict:
        images, labels = self.validation()
        logits = predict_fn(images)
        return {"images": images, "labels": labels, "logits": logits,
                "accuracy": float((logits.argmax(1) == labels).float().mean())}

    def check_images(self):
        """A fixed slice of training images to compare a model before and after saving."""
        return first_images(self.splits.calibration, 128)

    def latency_ms(self, call_for) -> float:
        batch = bench.random_batch((TUNING_BATCH, *self.input_shape()))
        return bench.measure(call_for(batch), warmup=2, repeats=10, max_seconds=3.0)["p50"]


# ---------------------------------------------------------------- PyTorch backend


def pytorch_quant_backend() -> str:
    """The quantized engine this torch build offers, best first; a clear error where none."""
    import torch

    try:
        from torch.ao.quantization import quantize_fx  # noqa: F401  (presence check)
    except ImportError:
        raise PipelineError("this torch build has no torch.ao.quantization FX API; install "
                            "torch>=2.10,<2.15 or skip torch-static with --methods") from None
    engines = torch.backends.quantized.supported_engines
    for engine in ("x86", "fbgemm", "onednn", "qnnpack"):
        if engine in engines:
            return engine
    raise PipelineError(f"this torch build offers no quantized engine (has {engines}); "
                        "skip torch-static and torch-dynamic with --methods")


def torch_static_options(observer: str = "histogram", per_channel: bool = True) -> dict:
    """minmax observes the range; histogram (the backend default) picks a range that minimises
    the quantization error, clipping outliers. reduce_range only where VNNI is missing."""
    return {"observer": observer, "per_channel": per_channel,
            "reduce_range": not export.cpu_has_vnni()}


def _qconfig_mapping(backend: str, options: dict, float_layers=()):
    import torch
    from torch.ao.quantization import QConfig, get_default_qconfig_mapping
    from torch.ao.quantization import observer as obs

    mapping = get_default_qconfig_mapping(backend)
    activation = obs.MinMaxObserver if options["observer"] == "minmax" else obs.HistogramObserver
    weight = (obs.PerChannelMinMaxObserver.with_args(dtype=torch.qint8,
                                                      qscheme=torch.per_channel_symmetric)
              if options["per_channel"] else
              obs.MinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric))
    mapping.set_global(QConfig(activation=activation.with_args(
        reduce_range=options["reduce_range"]), weight=weight))
    for name in float_layers:
        mapping.set_module_name(name, None)
    return mapping


def _fx_int8(model, backend: str, example, calibration: list | None, options: dict,
             float_layers=()):
    """prepare_fx, observe ``calibration`` (none when rebuilding to load a state_dict), convert_fx."""
    import copy

    import torch
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    torch.backends.quantized.engine = backend
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notices
        prepared = prepare_fx(copy.deepcopy(model).eval(),
                              _qconfig_mapping(backend, options, float_layers), (example,))
        with torch.inference_mode():
            for batch in calibration or []:
                prepared(batch)
        return convert_fx(prepared)


def _dynamic_int8(model):
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(model.eval(), {torch.nn.Linear},
                                                      dtype=torch.qint8)


def torch_layer_groups(model) -> dict[str, list[str]]:
    """Each Conv/Linear module with the BatchNorm, activation and pooling modules registered
    after it: FX fuses them and quantizes the group's output at its last member, so they must
    stay float together for the layer's output to stay float."""
    from torch import nn

    followers = (nn.BatchNorm1d, nn.BatchNorm2d, nn.ReLU, nn.ReLU6, nn.GELU, nn.MaxPool2d,
                 nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.Flatten, nn.Dropout, nn.Identity)
    groups: dict[str, list[str]] = {}
    current = None
    for name, module in model.named_modules():
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            current = name
            groups[name] = [name]
        elif current is not None and isinstance(module, followers):
            groups[current].append(name)
        elif list(module.children()) == [] and name:
            current = None
    return groups


def load_torch_model(run: Run, name: str):
    """Rebuild a PyTorch variant (float or int8) from its verified, weights-only file."""
    import torch

    data = load_checkpoint(run.verified_path(name))
    if not isinstance(data, dict) or "state_dict" not in data or "model_spec" not in data:
        raise PipelineError(f"{name}: {run.verified_path(name)} is not a pipeline model file")
    spec = data["model_spec"]
    model = build_from_spec(spec).eval()
    kind = data.get("quantization")
    if kind is not None:
        torch.backends.quantized.engine = data["backend"]
    if kind == "fx-static-int8":
        example = torch.zeros(2, spec["in_channels"], spec["image_size"], spec["image_size"])
        model = _fx_int8(model, data["backend"], example, None, data["options"],
                         data.get("float_modules", ()))
    elif kind == "dynamic-int8":
        model = _dynamic_int8(model)
    elif kind is not None:
        raise PipelineError(f"{name}: unknown quantization {kind!r} in {run.verified_path(name)}")
    model.load_state_dict(data["state_dict"])
    return model.eval()


def _save_torch_variant(ctx: QuantContext, name: str, model, info: dict) -> dict:
    """Save a quantized module as state_dict + rebuild info, reload it, compare predictions."""
    import torch

    path = ctx.folder / f"{name}.pt"
    before = predict(model, ctx.check_images())
    info = info | {"op_counts": opstats.torch_op_counts(model),
                   "parity_vs_amp": export.compare_logits(predict(ctx.float_model(),
                                                                  ctx.check_images()), before)}
    atomic_torch_save({"model_spec": ctx.spec, "state_dict": model.state_dict(), **info}, path)
    ctx.run.register(name, path, kind="model", stage="quantize", parent=SOURCE,
                     config=asdict(ctx.config), format="pytorch", model_spec=ctx.spec,
                     quantization=info)
    after = predict(load_torch_model(ctx.run, name), ctx.check_images())
    if not torch.equal(before, after):
        raise PipelineError(f"{name}: the model reloaded from {path} does not reproduce its "
                            "predictions; please report this with --debug output")
    return info


@register_method("torch-dynamic")
def torch_dynamic(ctx: QuantContext) -> dict:
    import torch

    backend = pytorch_quant_backend()
    torch.backends.quantized.engine = backend
    model = _dynamic_int8(ctx.float_model())
    return _save_torch_variant(ctx, "torch-dynamic", model, {
        "quantization": "dynamic-int8", "backend": backend, "modules": ["Linear"]})


def _torch_static_backend(ctx: QuantContext, backend: str, groups: dict[str, list[str]]) -> dict:
    calibration = ctx.calibration()
    float_model = ctx.float_model()

    def build(options: dict, float_layers):
        members = [m for layer in float_layers for m in groups[layer]]
        return _fx_int8(float_model, backend, calibration[0], calibration, options, members)

    return {
        "build": build,
        "predict": lambda model, images: predict(model, images),
        "latency": lambda model: ctx.latency_ms(lambda batch: bench.torch_call(model, batch)),
        "layers": lambda: list(groups),
    }


@register_method("torch-static")
def torch_static(ctx: QuantContext) -> dict:
    backend = pytorch_quant_backend()
    config = ctx.config
    # Unless asked otherwise: the x86 engine's defaults, histogram observer and per-channel.
    observer = "minmax" if config.calibration_method == "minmax" else "histogram"
    per_channel = True if config.per_channel is None else config.per_channel
    candidates = ([torch_static_options(o, pc) for o in ("histogram", "minmax")
                   for pc in (True, False)] if config.auto
                  else [torch_static_options(observer, per_channel)])
    reference = ctx.reference(lambda images: predict(ctx.float_model(), images))
    say("torch-static: scoring on the validation slice", quiet=config.quiet)
    groups = torch_layer_groups(ctx.float_model())
    trial, record = tuning.tune(_torch_static_backend(ctx, backend, groups), candidates, reference,
                                config.max_accuracy_drop, timed=config.auto,
                                say=lambda m: say(m, quiet=config.quiet))
    return _save_torch_variant(ctx, "torch-static", trial.model, {
        "quantization": "fx-static-int8", "backend": backend, "options": trial.options,
        "float_layers": list(trial.float_layers),
        "float_modules": [m for layer in trial.float_layers for m in groups[layer]],
        "tuning": record,
        "calibration_samples": int(sum(len(b) for b in ctx.calibration())),
        "calibration_split": "train"})


# ---------------------------------------------------------------- ONNX and ONNX Runtime


def _register_onnx(ctx: QuantContext, name: str, path: Path, parent: str, info: dict) -> None:
    info = info | {"op_counts": opstats.onnx_op_counts(path)}
    ctx.run.register(name, path, kind="model", stage="quantize", parent=parent,
                     config=asdict(ctx.config), format="onnx", model_spec=ctx.spec,
                     shipped_bytes=export.onnx_size_bytes(path), quantization=info)


@register_method("onnx")
def onnx_fp32(ctx: QuantContext) -> dict:
    model = ctx.float_model()
    images = ctx.check_images()
    path = ctx.folder / "model.onnx"
    export.export_onnx(model, images[:2], path)
    session = export.ort_session(path, threads=1)
    parity = export.compare_logits(predict(model, images), export.ort_predict(session, images))
    info = {"exporter": "torch.onnx.export(dynamo=True)", "checker": "passed",
            "parity_vs_pytorch": parity}
    _register_onnx(ctx, "onnx-fp32", path, SOURCE, info)
    if parity["top1_agreement"] < 0.99:
        say(f"warning: onnx-fp32 agrees with PyTorch on only {parity['top1_agreement']:.1%} of "
            f"training images (max logit difference {parity['max_abs_diff']:.3g})")
    return info


def _finish_ort(ctx: QuantContext, name: str, made: Path, info: dict) -> dict:
    """Move a quantized file into place, check it, compare it with onnx-fp32, register it."""
    source = ctx.run.verified_path("onnx-fp32")
    path = ctx.folder / f"{name}.onnx"
    with atomic_path(path) as tmp:
        shutil.copyfile(made, tmp)
    export.check_onnx(path)
    images = ctx.check_images()
    written = export.ort_predict(export.ort_session(path, threads=1), images)
    info["parity_vs_onnx_fp32"] = export.compare_logits(
        export.ort_predict(export.ort_session(source, threads=1), images), written)
    _register_onnx(ctx, name, path, "onnx-fp32", info)
    return info


@register_method("ort-dynamic")
def ort_dynamic(ctx: QuantContext) -> dict:
    made = ctx.scratch / "ort-dynamic.onnx"
    info = export.quantize_ort_dynamic(ctx.run.verified_path("onnx-fp32"), made)
    return _finish_ort(ctx, "ort-dynamic", made, info)


def _ort_static_backend(ctx: QuantContext, pre: Path) -> dict:
    calibration = ctx.calibration()
    threads = bench_threads()
    groups = export.layer_groups(pre)
    counter = iter(range(10**6))

    def build(options: dict, float_layers) -> Path:
        made = ctx.scratch / f"ort-static-{next(counter)}.onnx"
        excluded = [n for layer in float_layers for n in groups[layer]]
        export.quantize_ort_static(pre, made, calibration, options, excluded)
        return made

    def session(path: Path):
        return export.ort_session(path, threads)

    return {
        "build": build,
        "predict": lambda path, images: export.ort_predict(session(path), images),
        "latency": lambda path: ctx.latency_ms(lambda batch: bench.ort_call(session(path), batch)),
        "layers": lambda: list(groups),
    }


def bench_threads() -> int:
    import torch

    return torch.get_num_threads()


@register_method("ort-static")
def ort_static(ctx: QuantContext) -> dict:
    config = ctx.config
    pre = ctx.scratch / "pre-processed.onnx"
    export.pre_process(ctx.run.verified_path("onnx-fp32"), pre)
    per_channel = bool(config.per_channel)  # per-tensor measured fastest with VNNI (DESIGN.md)
    if config.auto:
        candidates = [export.ort_static_options("u8s8", pc, cal)
                      for cal in ("minmax", "percentile") for pc in (False, True)]
        candidates.append(export.ort_static_options("s8s8", False, "minmax"))
    else:
        candidates = [export.ort_static_options(config.ort_types, per_channel,
                                                config.calibration_method or "minmax",
                                                config.ort_format)]
    source = export.ort_session(pre, bench_threads())
    reference = ctx.reference(lambda images: export.ort_predict(source, images))
    say("ort-static: scoring on the validation slice", quiet=config.quiet)
    trial, record = tuning.tune(_ort_static_backend(ctx, pre), candidates, reference,
                                config.max_accuracy_drop, timed=config.auto,
                                say=lambda m: say(m, quiet=config.quiet))
    info = trial.options | {"float_layers": list(trial.float_layers), "tuning": record,
                            "calibration_samples": int(sum(len(b) for b in ctx.calibration())),
                            "calibration_split": "train", "pre_processed": True}
    return _finish_ort(ctx, "ort-static", trial.model, info)


def run(config, run: Run) -> dict[str, dict]:
    """Apply each method in config.methods to the run's `amp` model; ORT methods need `onnx`."""
    spec = run.entry(SOURCE)["model_spec"]
    splits = splits_of_run(run)
    methods = list(config.methods)
    needs_onnx = any(m.startswith("ort-") for m in methods)
    if needs_onnx and "onnx" not in methods and "onnx-fp32" not in run.artifacts():
        methods.insert(0, "onnx")
    folder = run.root / "quantize"
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".scratch-") as scratch:
        ctx = QuantContext(run, config, splits, spec, folder, Path(scratch))
        if any(m.endswith("-static") for m in methods):
            ctx.calibration()  # bad calibration data stops the stage before anything is written
        run.record_config("quantize", asdict(config))
        results = {}
        for method in methods:
            variant = VARIANT_OF_METHOD.get(method, method)
            say(f"quantize: {variant} ...", quiet=config.quiet)
            results[variant] = lookup(METHODS, method, "method")(ctx)
            entry = run.entry(variant)
            say(f"quantize: {variant} -> {run.root / entry['path']} "
                f"({entry.get('shipped_bytes', entry['bytes']) / 1e6:.1f} MB, "
                f"{opstats.summarize(entry['quantization']['op_counts'])})", quiet=config.quiet)
    return results

