"""Quantize: make the deployable variants of a run's float model, runtime by runtime.

The float model is `amp` (or `fp32` where a run has no `amp`, as after `pipeline import`).
Calibration uses training images only; every choice (--auto, the accuracy budget, layers kept
float) is scored on held-out training images, never on the test split. Every variant is written
atomically, reloaded from disk, checked against what it predicted before it was written, and
registered in the manifest with what it contains.
"""
from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from stages import runtimes
from stages.shared.artifacts import Run
from stages.shared.data import (
    DataSplits,
    calibration_batches,
    check_calibration,
    first_images,
    splits_of_run,
    tuning_images,
)
from stages.shared.errors import PipelineError, UsageError
from stages.shared.evaluate import accuracy
from stages.shared.progress import say


def float_source(run: Run) -> str:
    """The variant every quantized model is made from: `amp`, else an imported `fp32`."""
    artifacts = run.artifacts()
    for name in ("amp", "fp32"):
        if name in artifacts:
            return name
    raise UsageError(f"run {run.name!r} has no float model; run 'pipeline train' or "
                     "'pipeline import' first")


def source_of(run: Run, name: str) -> str | None:
    source = runtimes.VARIANTS[name].source
    return float_source(run) if source == runtimes.FLOAT else source


@dataclass
class QuantContext:
    """What every runtime's make function gets: the run, the float model, training images
    for calibration, held-out training images to score on, and where to write."""

    run: Run
    config: object
    splits: DataSplits
    spec: dict
    folder: Path
    scratch: Path
    source: str
    threads: int
    stage: str = "quantize"
    _batches: list = field(default_factory=list)
    _float: object = None
    _val: tuple | None = None
    _loaded: dict = field(default_factory=dict)
    # Checks that compile a model, kept until the stage's last torch.export: a strict export
    # resets Dynamo, which throws every compiled model of the process away (each took 3 to
    # 15 s to compile, and the report in the same chain would compile them all again).
    deferred: dict = field(default_factory=dict)
    defer_compiles: bool = False

    def after_exports(self, name: str, check) -> None:
        if self.defer_compiles:
            self.deferred[name] = check
        else:
            check()

    def say(self, message: str) -> None:
        say(message, quiet=self.config.quiet)

    def float_model(self):
        """The float source as an eager fp32 module, loaded and verified once; no make
        function mutates it."""
        if self._float is None:
            from stages.runtimes.pytorch import load_float_module

            self._float = load_float_module(self.run, self.source)
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
                "accuracy": accuracy(logits, labels)}

    def check_images(self):
        """A fixed slice of training images to compare a model before and after saving."""
        return first_images(self.splits.calibration, 128)

    def logits_of(self, name: str, images):
        """Logits of an already written variant, loaded once through its runtime."""
        if name not in self._loaded:
            self._loaded[name] = runtimes.load(self.run, name, threads=1)
        return self._loaded[name].predict(images)

    def register(self, name: str, path: Path, info: dict, fmt: str, op_counts: dict,
                 companions: tuple[Path, ...] = ()) -> None:
        """List a variant with what really runs in it (``op_counts``, measured by its runtime
        on the model as written). An int8 variant in which nothing runs in int8 is a silent
        float fallback: an error, not a result."""
        if runtimes.VARIANTS[name].int8 and not any(c["int8"] for c in op_counts.values()):
            raise PipelineError(f"{name}: nothing in the model runs in int8 "
                                f"({runtimes.summarize_ops(op_counts)}), so it was not kept; "
                                "please report this with --debug output")
        self._loaded.pop(name, None)
        self.run.register(name, path, kind="model", stage=self.stage,
                          parent=source_of(self.run, name), config=asdict(self.config),
                          format=fmt, model_spec=self.spec, companions=companions,
                          quantization=info | {"op_counts": op_counts})


def plan(run: Run, methods: tuple[str, ...]) -> list[str]:
    """The variants to make, in registry order, with the sources they need and the run lacks
    (ort-static needs onnx-fp32, openvino-int8 needs openvino-fp32)."""
    wanted = set(methods)
    for name in list(wanted):
        source = source_of(run, name)
        while source and source not in wanted and source not in run.artifacts():
            wanted.add(source)
            source = source_of(run, source)
    unmade = [n for n in wanted if runtimes.VARIANTS[n].make is None
              and n not in run.artifacts()]
    if unmade:
        raise UsageError(f"{', '.join(unmade)} cannot be made by quantize; "
                         "torch-qat and ort-qat come from 'pipeline qat'")
    return [name for name in runtimes.VARIANTS if name in wanted and
            runtimes.VARIANTS[name].make is not None]


def run(config, run: Run) -> dict[str, dict]:
    """Make each variant config.methods asks for (all by default) from the run's float model."""
    import torch

    source = float_source(run)
    spec = run.entry(source)["model_spec"]
    splits = splits_of_run(run)
    names = plan(run, config.methods)
    folder = run.root / "quantize"
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".scratch-") as scratch:
        ctx = QuantContext(run, config, splits, spec, folder, Path(scratch), source,
                           torch.get_num_threads(), defer_compiles=True)
        ctx.calibration()  # bad calibration data stops the stage before anything is written
        run.record_config("quantize", asdict(config) | {"source": source})
        results = {}
        for name in names:
            say(f"quantize: {name} ...", quiet=config.quiet)
            results[name] = runtimes.VARIANTS[name].make(ctx)
            if name not in ctx.deferred:
                _made(run, name, config.quiet)
        for name, check in ctx.deferred.items():
            say(f"quantize: {name}: compiling and checking ...", quiet=config.quiet)
            check()
            _made(run, name, config.quiet)
    return {name: results[name] for name in names}


def _made(run: Run, name: str, quiet: bool) -> None:
    entry = run.entry(name)
    say(f"quantize: {name} -> {run.root / entry['path']} ({run.shipped_bytes(name) / 1e6:.1f} "
        f"MB, {runtimes.summarize_ops(entry['quantization']['op_counts'])})", quiet=quiet)


def post_training_verdict(run: Run, names: list[str], budget_points: float) -> tuple[bool, str]:
    """Whether some static int8 variant made by post-training quantization kept within the
    accuracy budget on the validation images, and a sentence saying which (or that none did):
    --auto goes on to quantization-aware training only when none did."""
    drops = {}
    for name in names:
        tuning = run.entry(name).get("quantization", {}).get("tuning")
        if tuning:
            drops[name] = tuning["chosen"]["drop_points"]
    within = sorted(n for n, drop in drops.items() if drop <= budget_points + 1e-9)
    if within:
        return True, (f"{', '.join(within)} kept within {budget_points:g} point(s) of the float "
                       "model after post-training quantization, so no quantization-aware "
                       "training is needed")
    if not drops:
        return True, "no static int8 variant was made, so there is nothing for QAT to rescue"
    losses = ", ".join(f"{n} {-d:+.2f}" for n, d in sorted(drops.items()))
    return False, (f"no post-training configuration kept within {budget_points:g} point(s) of "
                   f"the float model on the validation images ({losses} points)")
