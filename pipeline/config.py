"""One dataclass per stage, validated on creation; TOML files fill in what flags leave out.

Precedence: dataclass defaults < config file < command line. No torch here, so that `pipeline
--help` stays instant; the model-name check imports torchvision only for a real run.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from pipeline.checks import (
    at_least,
    at_most,
    check_types,
    choice,
    duration_field,
    expanded,
    greater_than,
    learning_rate,
    no_choices_under_auto,
    parse_int_list,
    seed_field,
    within,
)
from stages.data.datasets import DATASETS, SHAPES
from stages.runtimes import VARIANTS, made_by_quantize

DATASET_NAMES = tuple(DATASETS)  # the registry (stages/data), which imports no torch
PRECISIONS = ("auto", "fp16", "bf16", "fp32")
DEVICES = ("auto", "cpu", "cuda")
SERVABLE = ("recommended", *VARIANTS)  # what predict, export and pipeline.load take
MAX_THREADS = 256  # --threads 100000 went to every runtime's thread pool as it was
# The variants quantize makes, in the order it makes them (the registry imports no torch).
QUANT_METHODS = tuple(made_by_quantize())
QAT_METHODS = tuple(name for name, v in VARIANTS.items() if v.stage == "qat")
CALIBRATION_METHODS = ("minmax", "entropy", "percentile")
ORT_TYPES = ("u8s8", "s8s8")
ORT_FORMATS = ("qdq", "qoperator")
# What cross-layer equalization is applied before (a transform of the float model they export).
EQUALIZED_METHODS = ("torch-static", "ort-static")


def _check_data_flags(config) -> None:
    """The flags train and import share: the data, its split and size, and the model's name."""
    choice("--dataset", config.dataset, DATASET_NAMES)
    expanded("--data-dir", config.data_dir)  # saved as given; the run records where it read
    if not 0.0 < config.val_fraction < 1.0:
        raise ValueError(f"--val-fraction must be between 0 and 1, got {config.val_fraction}")
    if config.in_channels is not None:
        choice("--in-channels", config.in_channels, (1, 3))
        colours = SHAPES[config.dataset][1]
        if config.in_channels < colours:  # grey is widened; colour is not made grey
            raise ValueError(f"--in-channels {config.in_channels}: --dataset {config.dataset} "
                             f"has {colours} colour channels, which are not made grey; give "
                             f"--in-channels {colours} or leave it out")
    at_least("--image-size", config.image_size, 8)
    from stages.models.build import check_model_name

    check_model_name(config.model)


# Without --time, 5 epochs: the default chain's resnet18 on the digits at --lr 0.02 scored 97.78%
# on test after 5 epochs and 98.06% after 15, one image of 360 apart (measurements.md's git
# history). Under --time, what fits the budget at the measured pace (training/plans.py).
DEFAULT_EPOCHS = 5
EPOCHS_UNDER_TIME = 200


@dataclass
class TrainConfig:
    model: str = "resnet18"
    dataset: str = "digits"
    data_dir: str = "data"
    download: bool = False
    val_fraction: float = 0.1
    image_size: int = 32
    in_channels: int | None = None  # None: the data's own (1 for grey, 3 for colour)
    epochs: int | None = None  # at most; None: DEFAULT_EPOCHS, or under --time what fits
    time: float | None = None  # seconds for the stage, the range test's included; None: no limit
    patience: int = 5  # epochs without a better val accuracy: plans.anneal_on_plateau's rule
    batch_size: int = 64
    lr: float | str = "auto"  # the schedule's peak, found by a range test (lr_range.py)
    weight_decay: float = 5e-4
    label_smoothing: float = 0.0
    grad_clip: float = 0.0
    precision: str = "auto"
    baseline: bool = True
    workers: int = 0
    loader_timeout: float = 300.0
    skip_bad_images: bool = False
    checkpoint_every: int = 0  # steps; 0: at the end of every epoch only
    keep_checkpoints: int = 2
    max_skipped_steps: int = 25
    deterministic: bool = False
    measure_memory: bool = True  # each model's training memory, in a fresh process
    init_weights: str | None = None  # a state_dict or checkpoint file to start from
    weights: str | None = None  # torchvision's pretrained weights by name, from the local cache
    seed: int = 0
    device: str = "auto"
    quiet: bool = False

    def __post_init__(self) -> None:
        duration_field(self, "time")  # '10m' as seconds, before the types are checked
        check_types(self)
        seed_field(self)
        if self.epochs is None:
            self.epochs = DEFAULT_EPOCHS if self.time is None else EPOCHS_UNDER_TIME
        _check_data_flags(self)
        if self.init_weights and self.weights:
            raise ValueError("--init-weights and --weights both name starting weights; give one")
        if self.init_weights and not expanded("--init-weights", self.init_weights).is_file():
            raise ValueError(f"--init-weights {self.init_weights!r} is not a file")
        at_least("--workers", self.workers, 0)
        greater_than("--loader-timeout", self.loader_timeout, 0)
        at_most("--loader-timeout", self.loader_timeout, 86_400,  # poll() fails past ~2.1e6
                " seconds (a day: a worker silent longer has hung)")
        at_least("--checkpoint-every", self.checkpoint_every, 0)
        at_least("--keep-checkpoints", self.keep_checkpoints, 1)
        at_least("--max-skipped-steps", self.max_skipped_steps, 1)
        choice("--precision", self.precision, PRECISIONS)
        choice("--device", self.device, DEVICES)
        at_least("--epochs", self.epochs, 1)
        at_least("--patience", self.patience, 1)
        at_least("--batch-size", self.batch_size, 1)
        self.lr = learning_rate(self.lr)
        at_least("--weight-decay", self.weight_decay, 0.0)
        at_least("--grad-clip", self.grad_clip, 0.0)
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"--label-smoothing must be in [0, 1), got {self.label_smoothing}")


# torchvision's names of weights (DEFAULT, IMAGENET1K_V1): anything else --weights names is a
# file, and a missing one is a path mistyped, not an unknown name.
WEIGHTS_NAME = re.compile(r"[A-Z][A-Z0-9_]*")


@dataclass
class ImportConfig:
    """A model trained elsewhere, and the data it is to be measured on."""

    model: str = "resnet18"
    weights: str = ""  # a state_dict/checkpoint file, or torchvision's weights name (cached)
    dataset: str = "digits"
    data_dir: str = "data"
    download: bool = False
    val_fraction: float = 0.1
    image_size: int = 32
    in_channels: int | None = None
    skip_bad_images: bool = False
    seed: int = 0
    quiet: bool = False

    def __post_init__(self) -> None:
        check_types(self)
        seed_field(self)
        if not self.weights:
            raise ValueError("--weights is required: the file (or torchvision weights) to import")
        if not (expanded("--weights", self.weights).is_file()
                or WEIGHTS_NAME.fullmatch(self.weights)):
            raise ValueError(f"--weights {self.weights!r} is not a file, nor a name of "
                             "torchvision's weights such as DEFAULT; check the path")
        _check_data_flags(self)


@dataclass
class QatConfig:
    """Quantization-aware fine-tuning of the run's float model (torchao PT2E QAT)."""

    # On the digits an epoch is about 20 steps: mnasnet0_5 ended 2.2-3.6 points below fp32 on
    # test after 3 epochs, 0.3-0.8 below after 10 (docs/measurements.md's git history).
    epochs: int = 10
    # From trained weights: a tenth to a third of the peaks found for the families on notMNIST
    # (0.014-0.05), where every QAT variant ended +0.05 to +0.50 points from amp (measurements.md).
    lr: float = 0.005
    batch_size: int = 64
    # Epochs; then BatchNorm uses its running statistics. None: half the epochs (at least 1).
    freeze_bn_after: int | None = None
    # Epochs; then the quantization ranges stay fixed. None: 70% of the epochs (at least 1).
    freeze_observers_after: int | None = None
    precision: str = "auto"  # autocast of the fine-tuning; auto: fp32 (stages/qat.py says why)
    # Seconds the fine-tuning may take: once an epoch is timed, the epochs (and the freezes with
    # them) are cut to what fits. quantize --auto passes its own --tuning-time on.
    tuning_time: float | None = None
    seed: int = 0
    device: str = "auto"
    quiet: bool = False

    def __post_init__(self) -> None:
        duration_field(self)
        check_types(self)
        seed_field(self)
        at_least("--epochs", self.epochs, 1)
        greater_than("--lr", self.lr, 0)
        at_least("--batch-size", self.batch_size, 1)
        # Scaled with --epochs, so that a shorter or longer run still freezes partway.
        if self.freeze_bn_after is None:
            self.freeze_bn_after = max(1, self.epochs // 2)
        if self.freeze_observers_after is None:
            self.freeze_observers_after = max(1, self.epochs * 7 // 10)
        at_least("--freeze-bn-after", self.freeze_bn_after, 0)
        # 0 would leave the observers off from the first step: ranges never measured.
        at_least("--freeze-observers-after", self.freeze_observers_after, 1)
        choice("--precision", self.precision, PRECISIONS)
        choice("--device", self.device, DEVICES)

    @property
    def fine_tunes_in(self) -> str:
        """The precision --precision gives: auto is fp32 (stages/qat.py:_precision says why)."""
        return "fp32" if self.precision == "auto" else self.precision


@dataclass
class QuantizeConfig:
    methods: tuple[str, ...] = QUANT_METHODS
    calibration_samples: int | None = None  # None: by image size (default_calibration_samples)
    calibration_batch_size: int = 32
    calibration_method: str | None = None  # None: each backend's fast default
    per_channel: bool | None = None  # None: per-channel for PyTorch, per-tensor for ORT
    # None: u8s8 and QDQ, or --auto's (a value given beside --auto, the default's too, is refused)
    ort_types: str | None = None
    ort_format: str | None = None
    auto: bool = False
    max_accuracy_drop: float = 1.0
    tuning_time: float | None = None  # seconds each static backend's search may take
    # Cross-layer equalization before torch-static and ort-static; None: with per-tensor
    # weights (ort-static's default), tried by --auto elsewhere.
    equalize: bool | None = None
    seed: int = 0
    quiet: bool = False

    def __post_init__(self) -> None:
        duration_field(self)
        check_types(self)
        seed_field(self)
        # A config file may give a list (["all"], or names in any order): parsed as a comma
        # list is, into the order variants are made.
        self.methods = parse_methods(self.methods if isinstance(self.methods, str)
                                     else ",".join(self.methods))
        if not self.methods:
            raise ValueError(f"--methods is empty; choose from: all, {', '.join(QUANT_METHODS)}")
        if self.calibration_samples is not None:
            at_least("--calibration-samples", self.calibration_samples, 1)
        at_least("--calibration-batch-size", self.calibration_batch_size, 1)
        choice("--calibration-method", self.calibration_method, CALIBRATION_METHODS, optional=True)
        choice("--ort-types", self.ort_types, ORT_TYPES, optional=True)
        choice("--ort-format", self.ort_format, ORT_FORMATS, optional=True)
        at_least("--max-accuracy-drop", self.max_accuracy_drop, 0.0)
        if self.auto:
            no_choices_under_auto(self)
        if self.equalize and not set(self.methods) & set(EQUALIZED_METHODS):
            raise ValueError(
                f"--equalize applies to {' and '.join(EQUALIZED_METHODS)} only, and --methods "
                f"{','.join(self.methods)} has neither; add one of them or drop --equalize")


def _method(name: str) -> None:
    if name in QAT_METHODS:
        raise ValueError(f"--methods {name!r} is made by quantization-aware training, not by "
                         "quantize: run 'pipeline qat' (or quantize --auto, which goes on to it)")
    choice("--methods", name, QUANT_METHODS + ("all",))


def parse_methods(text: str) -> tuple[str, ...]:
    """'all' or a comma list of variants, in the order they are made (a variant's source, such
    as onnx-fp32 for ort-static, is made first where the run lacks it)."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    for name in names:
        _method(name)
    if "all" in names:
        return QUANT_METHODS
    return tuple(m for m in QUANT_METHODS if m in names)


@dataclass
class ReportConfig:
    batch_sizes: tuple[int, ...] = (1, 32)
    threads: int = 0  # 0: one per CPU this process may use, at most 8
    warmup: int = 3
    rounds: int = 5  # at least; every variant is timed in each round, the order rotated
    max_rounds: int = 40
    repeats: int = 0  # timed calls per variant in each round; 0: as many as fill 50 ms
    # Rounds go on until every speed-up against the fastest float has high/low at most this,
    # or max_rounds or timing_budget (seconds per batch size) run out.
    target_interval: float = 1.1
    timing_budget: float = 20.0
    max_accuracy_drop: float = 1.0
    fail_under_speedup: float = 0.0  # against the reference (amp); 0: never fail
    fail_under_float_speedup: float = 0.0  # against the fastest float variant; 0: never fail
    compare: tuple[str, ...] = ()
    device: str = "auto"  # auto: GPU rows too where there is a CUDA device; cpu: none
    # On an AMX CPU, time the int8 and bf16 variants that run oneDNN again with it capped below
    # AMX (stages/report/worker.py), where AMX can lose.
    time_below_amx: bool = True
    quiet: bool = False

    def __post_init__(self) -> None:
        check_types(self)
        choice("--device", self.device, DEVICES)
        if isinstance(self.compare, str):
            self.compare = (self.compare,)
        self.compare = tuple(name.strip() for item in self.compare for name in item.split(",")
                             if name.strip())
        if isinstance(self.batch_sizes, str):
            self.batch_sizes = parse_int_list("--batch-sizes", self.batch_sizes)
        self.batch_sizes = tuple(sorted(set(self.batch_sizes)))
        if not self.batch_sizes:
            raise ValueError("--batch-sizes is empty; give numbers such as 1,32")
        for size in self.batch_sizes:
            at_least("--batch-sizes", size, 1)
        within("--threads", self.threads, 0, MAX_THREADS, " (0: one per core, up to 8)")
        at_least("--warmup", self.warmup, 1)  # compiled variants build their graph there
        at_least("--rounds", self.rounds, 3)
        if not self.max_rounds >= self.rounds:  # name both: either may be the one to change
            raise ValueError(f"--max-rounds must be at least --rounds ({self.rounds}), got "
                             f"{self.max_rounds}")
        at_least("--repeats", self.repeats, 0)
        if self.repeats and self.rounds * self.repeats < 20:  # a p90 needs calls to stand on
            raise ValueError(f"--rounds x --repeats must give at least 20 timed calls, got "
                             f"{self.rounds} x {self.repeats}")
        at_least("--target-interval", self.target_interval, 1.0)
        greater_than("--timing-budget", self.timing_budget, 0)
        at_least("--max-accuracy-drop", self.max_accuracy_drop, 0.0)
        at_least("--fail-under-speedup", self.fail_under_speedup, 0.0)
        at_least("--fail-under-float-speedup", self.fail_under_float_speedup, 0.0)


@dataclass
class PredictConfig:
    """Predict image files with a variant of a run (`pipeline predict`)."""

    paths: tuple[str, ...] = ()
    variant: str = "recommended"
    top_k: int = 1
    batch_size: int = 64
    json: bool = False
    threads: int = 0

    def __post_init__(self) -> None:
        check_types(self)
        # '~' expanded where the shell left it (a quoted "~/My Photos"): checked and read alike.
        self.paths = tuple(str(expanded("PATH", path)) for path in self.paths)
        if not self.paths:
            raise ValueError("predict needs image files or folders: pipeline predict PATH...")
        for path in self.paths:
            try:
                os.stat(path)
            except FileNotFoundError:
                raise ValueError(f"{path} does not exist; give image files or folders") from None
            except OSError as exc:  # too long a name, a folder this user cannot enter
                raise ValueError(f"{path}: {exc.strerror}; give image files or folders") from None
        at_least("--top-k", self.top_k, 1)
        at_least("--batch-size", self.batch_size, 1)
        within("--threads", self.threads, 0, MAX_THREADS, " (0: one per core, up to 8)")
        choice("--variant", self.variant, SERVABLE)


@dataclass
class ExportConfig:
    """Write a variant as a folder that runs without this project (`pipeline export`)."""

    out_dir: str = ""
    variant: str = "recommended"
    quiet: bool = False

    def __post_init__(self) -> None:
        check_types(self)
        if not self.out_dir:
            raise ValueError("export needs the folder to write: pipeline export OUT_DIR")
        expanded("OUT_DIR", self.out_dir)
        choice("--variant", self.variant, SERVABLE)


STAGE_CONFIGS = {"train": TrainConfig, "import": ImportConfig, "qat": QatConfig,
                 "quantize": QuantizeConfig, "report": ReportConfig, "predict": PredictConfig,
                 "export": ExportConfig}


def build_config(stage: str, file_values: dict[str, Any], flag_values: dict[str, Any]):
    """Defaults < config file < flags; a flag left at None does not override the file."""
    values = dict(file_values)
    values.update({k: v for k, v in flag_values.items() if v is not None})
    return STAGE_CONFIGS[stage](**values)


def qat_config_for_auto(quantize: QuantizeConfig, file_values: dict[str, dict],
                        **given: Any) -> QatConfig | None:
    """What quantize --auto fine-tunes with where post-training int8 misses the budget: the
    qat stage's defaults and [qat] table, in quantize's --tuning-time unless [qat] sets its
    own; None without --auto. Built beside quantize's config, so that a bad [qat] table stops
    the command before any work starts."""
    if not quantize.auto:
        return None
    table = file_values.get("qat", {})
    inherited = {} if "tuning_time" in table else {"tuning_time": quantize.tuning_time}
    return build_config("qat", table, given | inherited)
