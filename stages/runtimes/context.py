"""What a stage that makes variants (quantize, qat) hands each runtime's make function: the
run, its float model, training images to calibrate on, held-out training images to score on,
where to write, and how to register what was made."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

from stages import runtimes
from stages.data.datasets import DataSplits, splits_of_run
from stages.data.subsets import (
    calibration_batches,
    check_calibration,
    default_calibration_samples,
    spread_images,
    tuning_images,
)
from stages.measure.evaluate import accuracy
from stages.measure.machine import inference_threads
from stages.run import signals
from stages.run.artifacts import Run
from stages.run.errors import PipelineError, UsageError
from stages.run.files import fsync_folder, remove_stale_temporaries
from stages.run.progress import say
from stages.run.trained import float_source

# Dynamic int8 is made where the fully connected layers hold at least this share of the weights
# or of the work (stages/models/build.py:fully_connected_share). resnet18's hold 0.05% of its
# weights and do 0.01% of its work at 32x32; at 224x224 its two dynamic variants ran at fp32's
# speed and had taken 73 of quantize's 347 s and 72 of the report's 320 (AMD EPYC Zen 4,
# 2026-12-07). smallcnn's hold 2.7% of its weights, mnasnet0_5's 1.4%, mobilenet_v3_large's 30%.
DYNAMIC_INT8_MIN_SHARE = 0.01


def source_of(run: Run, name: str) -> str | None:
    source = runtimes.VARIANTS[name].source
    return float_source(run) if source == runtimes.FLOAT else source


def sources(run: Run, name: str) -> list[str]:
    """``name`` and what it is made from, to the float model."""
    chain = [name]
    while (source := source_of(run, chain[-1])) is not None:
        chain.append(source)
    return chain


# What a child making variants tells its parent before each one (run/isolated.py's Doing), so
# that a native crash costs that variant: quantize.run_as_deployed, qat._made_apart.
MAKING = "making "


@dataclass
class QuantContext:
    """What every runtime's make function gets: the run, the float model, training images
    for calibration, held-out training images to score on, and where to write: ``folder``,
    from which register() moves each file into ``published`` (the run's quantize/)."""

    run: Run
    config: object
    splits: DataSplits
    spec: dict
    folder: Path
    scratch: Path
    source: str
    threads: int
    stage: str = "quantize"
    published: Path | None = None
    _batches: list = field(default_factory=list)
    _float: object = None
    _equalized: tuple | None = None
    _val: tuple | None = None
    _check: object = None  # check_images(), decoded once
    _references: dict = field(default_factory=dict)  # source variant -> its held-out logits
    _loaded: dict = field(default_factory=dict)
    _fully_connected: dict | None = None  # fully_connected_share of the float model
    # Checks that compile a model, kept until the stage's last torch.export: a strict export
    # resets Dynamo, which throws every compiled model of the process away (each took 3 to
    # 15 s to compile, and the report in the same chain would compile them all again).
    deferred: dict = field(default_factory=dict)
    refused: dict = field(default_factory=dict)  # variant -> why a search kept nothing
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

    def equalized_model(self) -> tuple[object, dict]:
        """The float model after cross-layer equalization (stages/quantization/equalization), made
        once, and its record: what was folded and scaled, and the largest logit change."""
        if self._equalized is None:
            from stages.quantization.equalization import equalize

            self._equalized = equalize(self.float_model(), self.check_images()[:32])
            record = self._equalized[1]
            self.say(f"{self.stage}: cross-layer equalization: {record['why']}")
        return self._equalized

    def source_model(self, options: dict):
        """What a candidate quantizes: the float model, or its equalized copy."""
        return self.equalized_model()[0] if options.get("equalize") else self.float_model()

    def equalizes(self, per_tensor_weights: bool) -> bool:
        """Whether a static backend's default candidates are equalized: --equalize or
        --no-equalize where given, else where weights are per-tensor (one scale for channels
        whose ranges differ a hundredfold) and the model has a pair to equalize."""
        wanted = self.config.equalize  # a QuantizeConfig's: only quantize's makers ask
        if wanted is None:
            wanted = per_tensor_weights
        return bool(wanted) and self.equalized_model()[1]["applied"]

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

    def reference(self, predict_fn, of: str) -> dict:
        """What a variant's candidates are scored against: the held-out images and the logits
        ``predict_fn`` gives them, once per stage for each float variant ``of`` (at 224x224 a
        pass took 11 to 15 s on 2 cores, and three PyTorch variants share one float model)."""
        if of not in self._references:
            images, labels = self.validation()
            logits = predict_fn(images)
            self._references[of] = {"images": images, "labels": labels, "logits": logits,
                                    "accuracy": accuracy(logits, labels)}
        return self._references[of]

    def check_images(self):
        """A fixed draw of training images, across the classes, to compare a model before and
        after saving and against the runtime it is served by."""
        if self._check is None:
            self._check = spread_images(self.splits.calibration, 128, self.config.seed)
        return self._check

    def logits_of(self, name: str, images):
        """Logits of an already written variant, loaded once through its runtime."""
        if name not in self._loaded:
            self._loaded[name] = runtimes.load(self.run, name, threads=1)
        return self._loaded[name].predict(images)

    def not_kept(self, name: str, record: dict) -> dict:
        """A search that found nothing within the budget keeps nothing (see refuse)."""
        why = (f"not kept: nothing stayed within {record['budget_points']:g} point(s) of the "
               f"float model on {record['images']} held-out training images ({record['why']})")
        return self.refuse(name, why) | {"tuning": record}

    def refuse(self, name: str, why: str) -> dict:
        """A variant not made says why in one line, drops what an earlier quantize made under
        this name (it would be reported as if this run had made it), and the stage's record in
        config.json says why, for the report."""
        self.say(f"{name}: {why}")
        self.run.unregister(name)
        self.refused[name] = why
        return {"not_kept": why}

    def pointless_dynamic_int8(self, name: str, static: str) -> dict | None:
        """Refuse ``name``, a dynamic int8 variant, where the model's fully connected layers
        (what dynamic int8 quantizes) hold under 1% of its weights and do under 1% of its work:
        it could change neither its size nor its speed by 1%. None where it may pay."""
        if self._fully_connected is None:
            from stages.models.build import fully_connected_share

            self._fully_connected = fully_connected_share(self.float_model(),
                                                          self.check_images()[:1])
        share = self._fully_connected
        if max(share.values()) >= DYNAMIC_INT8_MIN_SHARE:
            return None
        weights, work = (f"{share[part] * 100:.2g}%" for part in ("weights", "work"))
        return self.refuse(name, f"not made: the fully connected layers, all that dynamic int8 "
                                 f"quantizes, hold {weights} of the model's weights and do "
                                 f"{work} of its work, so it could change neither size nor speed "
                                 f"by 1%; {static} quantizes the rest")

    def score_without_search(self, name: str, predict_fn, reference_fn, reference_of: str,
                             options: dict) -> dict:
        """Score a variant made with no choice to search (dynamic int8) on the held-out images,
        as the searches score theirs: the record says whether it kept within the budget, and
        one that did not is refused like a search that found nothing (on notMNIST,
        mobilenet_v2's ort-dynamic scored 16.7% on the test split, near chance, and was
        written)."""
        from stages.quantization import tuning

        # Nothing to build or keep float: the one model made is what every trial predicts.
        backend = tuning.Backend(build=lambda options, float_layers: None,
                                 predict=lambda _, images: predict_fn(images))
        self.say(f"{name}: scoring on the validation slice")
        _, record = tuning.tune(backend, [options], self.reference(reference_fn, reference_of),
                                self.config.max_accuracy_drop, say=self.say)
        return record

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
        # A variant made again replaces its listed file here: an interrupt before the manifest
        # lists the new one (it hashes the file first) had left a mismatch that made
        # the report refuse the run. The files are moved weights first (an .xml never points
        # at a missing .bin), the folder synced, then listed, with SIGINT and SIGTERM held.
        with signals.deferred(signal.SIGINT, signal.SIGTERM):
            companions = tuple(self._publish(c) for c in companions)
            path = self._publish(path)
            if self.published is not None:
                fsync_folder(self.published, files=False)
            self.run.register(name, path, kind="model", stage=self.stage,
                              parent=source_of(self.run, name), config=asdict(self.config),
                              format=fmt, model_spec=self.spec, companions=companions,
                              quantization=info | {"op_counts": op_counts})

    def _publish(self, path: Path) -> Path:
        """A file written in ``folder``, moved under its name into quantize/ as it is listed.
        Written there directly, a variant made again would have replaced the listed file
        minutes before its entry (torch-static's waits for every export): an interrupt or a
        failure in between left a run whose report refused the mismatched file. A listed file
        registered again (openvino-bf16 lists openvino-fp32's IR) stays where it is."""
        if self.published is None or path.parent != self.folder:
            return path
        os.replace(path, self.published / path.name)
        return self.published / path.name


@contextlib.contextmanager
def context(run: Run, config, stage: str, record: bool = True,
            **options) -> Iterator[QuantContext]:
    """The QuantContext a stage that makes variants works in (quantize, qat): the run's float
    source and data, the quantize/ folder, and a scratch folder removed afterwards with what
    was written there and never listed. Records the stage's configuration with the source it
    was made from (unless ``record`` is off: a child making the stage's variants)."""
    import torch

    source = float_source(run)
    if source == "fp32" and run.entry("fp32")["stage"] == "train":  # not an imported model
        raise UsageError(f"run {run.name!r} has train's fp32 baseline but not its amp model, "
                         f"which {stage} starts from (train failed or was stopped); finish it "
                         f"with 'pipeline --run {run.name} train --resume', or train again")
    folder = run.root / "quantize"
    folder.mkdir(parents=True, exist_ok=True)
    remove_leftovers(folder)
    splits = splits_of_run(run)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".scratch-") as scratch:
        spec = run.entry(source)["model_spec"]
        if getattr(config, "calibration_samples", 0) is None:  # (qat's config has no such field)
            config = dataclasses.replace(config, calibration_samples=default_calibration_samples(
                spec["image_size"]))
        staging = Path(scratch) / "made"
        staging.mkdir()
        # The report's thread count (one per usable CPU, at most 8): --auto's search times its
        # candidates and ranks them as the report will time them. torch's own default (its
        # count of physical cores) had timed at 1 thread what the report timed at 2.
        threads, before = inference_threads(), torch.get_num_threads()
        # qat fine-tunes in its caller's process, with its threads; its child checks ort-qat and
        # openvino-qat at one thread each, as the makers ask their runtimes for.
        if stage == "quantize":
            torch.set_num_threads(threads)
        try:
            ctx = QuantContext(run, config, splits, spec, staging, Path(scratch), source,
                               threads, stage=stage, published=folder, **options)
            if stage == "quantize":  # bad calibration data stops it before anything is written
                ctx.calibration()
            if record:
                run.record_config(stage, asdict(config) | {"source": source, "onednn_max_cpu_isa":
                                                           os.environ.get("ONEDNN_MAX_CPU_ISA",
                                                                          "not capped")})
            yield ctx
        finally:
            torch.set_num_threads(before)


def remove_leftovers(folder: Path) -> None:
    """What a process killed mid-stage left in quantize/ (a quantize or qat child that a
    runtime crashed, a SIGKILL): temporary files and scratch folders, never a file under a real
    name. One process holds the run's lock, so none of them is in use."""
    remove_stale_temporaries(folder)
    for scratch in folder.glob(".scratch-*"):
        shutil.rmtree(scratch, ignore_errors=True)
