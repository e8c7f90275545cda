"""Post-training quantization of the `amp` model: PyTorch dynamic and static int8, ONNX and ORT.

Every method writes its file atomically, loads it back from disk, checks that the reloaded model
gives the predictions the in-memory one gave, and registers it in the manifest. A quantized
PyTorch model is stored as a state_dict plus what rebuilds it, never as a pickled module.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from stages import export
from stages.artifacts import Run, atomic_torch_save, load_checkpoint
from stages.data import DataSplits, calibration_batches, check_calibration, first_images
from stages.errors import PipelineError
from stages.models import build_from_spec
from stages.progress import say
from stages.registry import lookup, register
from stages.train import predict, splits_of_run

SOURCE = "amp"  # the variant every quantized model is made from
METHODS: dict[str, Callable[["QuantContext"], dict]] = {}
VARIANT_OF_METHOD = {"onnx": "onnx-fp32"}  # every other method's variant has its own name


def register_method(name: str):
    return register(METHODS, name)


@dataclass
class QuantContext:
    run: Run
    config: object
    splits: DataSplits
    spec: dict
    folder: Path
    _batches: list = field(default_factory=list)
    _float: object = None

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
            check_calibration(self._batches, (self.spec["in_channels"], self.spec["image_size"],
                                              self.spec["image_size"]))
        return self._batches

    def check_images(self):
        """A fixed slice of training images to compare a model before and after saving."""
        return first_images(self.splits.calibration, 128)


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


def _fx_int8(model, backend: str, example, calibration: list | None):
    """prepare_fx, observe ``calibration`` (none when rebuilding to load a state_dict), convert_fx."""
    import torch
    import warnings
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    torch.backends.quantized.engine = backend
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notice
        prepared = prepare_fx(model.eval(), get_default_qconfig_mapping(backend), (example,))
        with torch.inference_mode():
            for batch in calibration or []:
                prepared(batch)
        return convert_fx(prepared)


def _dynamic_int8(model):
    import torch
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(model.eval(), {torch.nn.Linear},
                                                      dtype=torch.qint8)


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
        model = _fx_int8(model, data["backend"], example, calibration=None)
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
    backend = pytorch_quant_backend()
    import torch

    torch.backends.quantized.engine = backend
    model = _dynamic_int8(ctx.float_model())
    return _save_torch_variant(ctx, "torch-dynamic", model, {
        "quantization": "dynamic-int8", "backend": backend, "modules": ["Linear"]})


@register_method("torch-static")
def torch_static(ctx: QuantContext) -> dict:
    backend = pytorch_quant_backend()
    calibration = ctx.calibration()
    model = _fx_int8(ctx.float_model(), backend, calibration[0], calibration)
    return _save_torch_variant(ctx, "torch-static", model, {
        "quantization": "fx-static-int8", "backend": backend,
        "qconfig": f"get_default_qconfig_mapping('{backend}')",
        "calibration_samples": int(sum(len(b) for b in calibration)),
        "calibration_split": "train"})


# ---------------------------------------------------------------- ONNX and ONNX Runtime


def _register_onnx(ctx: QuantContext, name: str, path: Path, parent: str, info: dict) -> None:
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


def _ort_quantized(ctx: QuantContext, name: str, quantize: Callable[[Path, Path], dict]) -> dict:
    source = ctx.run.verified_path("onnx-fp32")
    path = ctx.folder / f"{name}.onnx"
    info = quantize(source, path)
    export.check_onnx(path)
    images = ctx.check_images()
    written = export.ort_predict(export.ort_session(path, threads=1), images)
    info["parity_vs_onnx_fp32"] = export.compare_logits(
        export.ort_predict(export.ort_session(source, threads=1), images), written)
    _register_onnx(ctx, name, path, "onnx-fp32", info)
    return info


@register_method("ort-dynamic")
def ort_dynamic(ctx: QuantContext) -> dict:
    return _ort_quantized(ctx, "ort-dynamic", export.quantize_ort_dynamic)


@register_method("ort-static")
def ort_static(ctx: QuantContext) -> dict:
    calibration = ctx.calibration()
    return _ort_quantized(ctx, "ort-static", lambda src, dst: export.quantize_ort_static(
        src, dst, calibration, ctx.config.calibration_method, ctx.config.per_channel))


def run(config, run: Run) -> dict[str, dict]:
    """Apply each method in config.methods to the run's `amp` model; ORT methods need `onnx`."""
    spec = run.entry(SOURCE)["model_spec"]
    splits = splits_of_run(run)
    ctx = QuantContext(run, config, splits, spec, run.root / "quantize")
    ctx.folder.mkdir(parents=True, exist_ok=True)
    run.record_config("quantize", asdict(config))
    methods = list(config.methods)
    if any(m.endswith("-static") for m in methods):
        ctx.calibration()  # bad calibration data stops the stage before anything is written
    needs_onnx = any(m.startswith("ort-") for m in methods)
    if needs_onnx and "onnx" not in methods and "onnx-fp32" not in run.artifacts():
        methods.insert(0, "onnx")
    results = {}
    for method in methods:
        variant = VARIANT_OF_METHOD.get(method, method)
        say(f"quantize: {variant} ...", quiet=config.quiet)
        results[variant] = lookup(METHODS, method, "method")(ctx)
        entry = run.entry(variant)
        say(f"quantize: {variant} -> {run.root / entry['path']} "
            f"({entry.get('shipped_bytes', entry['bytes']) / 1e6:.1f} MB)", quiet=config.quiet)
    return results
