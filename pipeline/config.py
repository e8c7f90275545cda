"""One dataclass per stage, validated on creation; TOML files fill in what flags leave out.

Precedence: dataclass defaults < config file < command line. This module imports no torch, so
that `pipeline --help` stays instant; the one check that needs torchvision (model names) imports
it only when a config is built for a real run.
"""
from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stages.runtimes import made_by_quantize

DATASET_NAMES = ("digits", "mnist", "fashion-mnist", "cifar10", "cifar100", "imagefolder")
PRECISIONS = ("auto", "fp16", "bf16", "fp32")
DEVICES = ("auto", "cpu", "cuda")
# The variants quantize makes, in the order it makes them (the registry imports no torch).
QUANT_METHODS = tuple(made_by_quantize())
CALIBRATION_METHODS = ("minmax", "entropy", "percentile")
ORT_TYPES = ("u8s8", "s8s8")
ORT_FORMATS = ("qdq", "qoperator")
# What cross-layer equalization is applied before (a transform of the float model they export).
EQUALIZED_METHODS = ("torch-static", "ort-static")


TYPE_NAMES = {"bool": "true or false", "int": "a whole number", "float": "a number",
              "str": "a string", "tuple[str, ...]": "a list of strings or a comma list",
              "tuple[int, ...]": "a list of whole numbers or a comma list"}


def _fits(value: Any, kind: str) -> bool:
    """Whether ``value`` has the type a dataclass field declares (declared as a string)."""
    if kind.endswith(" | None"):
        return value is None or _fits(value, kind[: -len(" | None")])
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "str":
        return isinstance(value, str)
    if kind.startswith("tuple["):
        element = kind[len("tuple["):].split(",")[0]
        return isinstance(value, str) or (isinstance(value, (list, tuple)) and all(
            _fits(item, element) for item in value))
    return True


def type_error(cls, values: dict[str, Any]) -> str | None:
    """The first value whose type its field does not allow, as 'name: expected, got value'."""
    kinds = {f.name: f.type for f in dataclasses.fields(cls)}
    for name, value in values.items():
        kind = kinds.get(name)
        if kind is not None and not _fits(value, kind):
            wanted = TYPE_NAMES.get(kind.removesuffix(" | None"), kind)
            return f"must be {wanted}, got {value!r}"
    return None


def _check_types(config) -> None:
    """Flags arrive typed by Click; other callers (a TOML file, Python code) may not."""
    for field in dataclasses.fields(config):
        problem = type_error(type(config), {field.name: getattr(config, field.name)})
        if problem:
            raise ValueError(f"--{field.name.replace('_', '-')} {problem}")


def _expanded(flag: str, text: str) -> Path:
    """The path with ~ expanded: '~name' of a user this machine does not have is a usage error
    (pathlib raises RuntimeError), not a traceback."""
    try:
        return Path(text).expanduser()
    except RuntimeError:
        raise ValueError(f"{flag} {text!r}: '~' names no user or home directory here; give the "
                         "path in full") from None


def _choice(flag: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{flag} {value!r} is not one of: {', '.join(map(str, allowed))}")


def _at_least(flag: str, value: float, low: float) -> None:
    if not value >= low:  # also refuses NaN
        raise ValueError(f"{flag} must be at least {low}, got {value}")


def _check_data_flags(config) -> None:
    """The flags train and import share: the data, its split and size, and the model's name."""
    _choice("--dataset", config.dataset, DATASET_NAMES)
    _expanded("--data-dir", config.data_dir)
    if not 0.0 < config.val_fraction < 1.0:
        raise ValueError(f"--val-fraction must be between 0 and 1, got {config.val_fraction}")
    if config.in_channels is not None:
        _choice("--in-channels", config.in_channels, (1, 3))
    _at_least("--image-size", config.image_size, 8)
    from stages.models.build import check_model_name

    check_model_name(config.model)


@dataclass
class TrainConfig:
    model: str = "resnet18"
    dataset: str = "digits"
    data_dir: str = "data"
    download: bool = False
    val_fraction: float = 0.1
    image_size: int = 32
    in_channels: int | None = None  # None: the data's own (1 for grey, 3 for colour)
    epochs: int = 5  # at most; --time and --patience may stop sooner
    time: float | None = None  # seconds of training, shared by the models trained; None: no limit
    patience: int = 5  # epochs without a better validation accuracy before training stops
    batch_size: int = 64
    lr: float | str = 0.02  # the schedule's peak, or "auto": found by a range test (lr_range.py)
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
        _tuning_time(self, "time")  # '10m' as seconds, before the types are checked
        _check_types(self)
        _check_data_flags(self)
        if self.init_weights and self.weights:
            raise ValueError("--init-weights and --weights both name starting weights; give one")
        if self.init_weights and not _expanded("--init-weights", self.init_weights).is_file():
            raise ValueError(f"--init-weights {self.init_weights!r} is not a file")
        _at_least("--workers", self.workers, 0)
        if not self.loader_timeout > 0:
            raise ValueError(f"--loader-timeout must be greater than 0, got {self.loader_timeout}")
        _at_least("--checkpoint-every", self.checkpoint_every, 0)
        _at_least("--keep-checkpoints", self.keep_checkpoints, 1)
        _at_least("--max-skipped-steps", self.max_skipped_steps, 1)
        _choice("--precision", self.precision, PRECISIONS)
        _choice("--device", self.device, DEVICES)
        _at_least("--epochs", self.epochs, 1)
        _at_least("--patience", self.patience, 1)
        _at_least("--batch-size", self.batch_size, 1)
        self.lr = _learning_rate(self.lr)
        _at_least("--weight-decay", self.weight_decay, 0.0)
        _at_least("--grad-clip", self.grad_clip, 0.0)
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"--label-smoothing must be in [0, 1), got {self.label_smoothing}")


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
        _check_types(self)
        if not self.weights:
            raise ValueError("--weights is required: the file (or torchvision weights name) to "
                             "import")
        _expanded("--weights", self.weights)
        _check_data_flags(self)


@dataclass
class QatConfig:
    """Quantization-aware fine-tuning of the run's float model (torchao PT2E QAT)."""

    # On the digits an epoch is about 20 steps: mnasnet0_5 ended 2.2-3.6 points below fp32 on
    # test after 3 epochs, 0.3-0.8 below after 10 (docs/measurements.md).
    epochs: int = 10
    lr: float = 0.005  # a quarter of training's default peak: fine-tuning, not training again
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
        _tuning_time(self)
        _check_types(self)
        _at_least("--epochs", self.epochs, 1)
        if not self.lr > 0:
            raise ValueError(f"--lr must be greater than 0, got {self.lr}")
        _at_least("--batch-size", self.batch_size, 1)
        # Scaled with --epochs, so that a shorter or longer run still freezes partway.
        if self.freeze_bn_after is None:
            self.freeze_bn_after = max(1, self.epochs // 2)
        if self.freeze_observers_after is None:
            self.freeze_observers_after = max(1, self.epochs * 7 // 10)
        _at_least("--freeze-bn-after", self.freeze_bn_after, 0)
        # 0 would leave the observers off from the first step: ranges never measured.
        _at_least("--freeze-observers-after", self.freeze_observers_after, 1)
        _choice("--precision", self.precision, PRECISIONS)
        _choice("--device", self.device, DEVICES)


@dataclass
class QuantizeConfig:
    methods: tuple[str, ...] = QUANT_METHODS
    calibration_samples: int = 512
    calibration_batch_size: int = 32
    calibration_method: str | None = None  # None: each backend's fast default
    per_channel: bool | None = None  # None: per-channel for PyTorch, per-tensor for ORT
    ort_types: str = "u8s8"
    ort_format: str = "qdq"
    auto: bool = False
    max_accuracy_drop: float = 1.0
    tuning_time: float | None = None  # seconds each static backend's search may take
    # Cross-layer equalization before torch-static and ort-static (stages/quantization/equalization):
    # None: where weights are per-tensor (ort-static's default), and tried by --auto elsewhere.
    equalize: bool | None = None
    seed: int = 0
    quiet: bool = False

    def __post_init__(self) -> None:
        _tuning_time(self)
        _check_types(self)
        if isinstance(self.methods, str):
            self.methods = parse_methods(self.methods)
        self.methods = tuple(self.methods)
        for method in self.methods:
            _choice("--methods", method, QUANT_METHODS + ("all",))
        if not self.methods:
            raise ValueError(f"--methods is empty; choose from: all, {', '.join(QUANT_METHODS)}")
        _at_least("--calibration-samples", self.calibration_samples, 1)
        _at_least("--calibration-batch-size", self.calibration_batch_size, 1)
        if self.calibration_method is not None:
            _choice("--calibration-method", self.calibration_method, CALIBRATION_METHODS)
        _choice("--ort-types", self.ort_types, ORT_TYPES)
        _choice("--ort-format", self.ort_format, ORT_FORMATS)
        _at_least("--max-accuracy-drop", self.max_accuracy_drop, 0.0)
        if self.equalize and not set(self.methods) & set(EQUALIZED_METHODS):
            raise ValueError(
                f"--equalize applies to {' and '.join(EQUALIZED_METHODS)} only, and --methods "
                f"{','.join(self.methods)} has neither; add one of them or drop --equalize")


def _learning_rate(value: Any) -> float | str:
    """--lr: a positive number, or "auto" for a range test."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        number = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        number = math.nan
    if not number > 0 or number == math.inf:
        raise ValueError(f"--lr must be a positive number or auto, got {value!r}")
    return number


DURATION_UNITS = {"s": 1, "m": 60, "h": 3600}
DURATION_FIELDS = ("tuning_time", "time")


def _tuning_time(config, field: str = "tuning_time") -> None:
    """A duration field (--tuning-time, --time) as seconds: a duration such as '5m' parsed,
    anything else refused."""
    flag, value = f"--{field.replace('_', '-')}", getattr(config, field)
    if isinstance(value, str):
        value = parse_duration(flag, value)
        setattr(config, field, value)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return  # _check_types names the type
    if not value > 0:
        raise ValueError(f"{flag} must be a positive duration, got {value}")


def parse_duration(flag: str, text: str) -> float:
    """Seconds of '90', '90s', '5m', '1.5h'."""
    cleaned = text.strip().lower()
    unit = DURATION_UNITS.get(cleaned[-1:], None)
    number = cleaned[:-1] if unit else cleaned
    try:
        seconds = float(number) * (unit or 1)
    except ValueError:
        raise ValueError(f"{flag} {text!r} is not a duration; give one such as 90s, 5m or "
                         "1h") from None
    if not seconds > 0 or seconds != seconds or seconds == float("inf"):
        raise ValueError(f"{flag} {text!r} is not a duration; give one such as 90s, 5m or 1h")
    return seconds


def parse_methods(text: str) -> tuple[str, ...]:
    """'all' or a comma list of variants, in the order they are made (a variant's source, such
    as onnx-fp32 for ort-static, is made first where the run lacks it)."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    for name in names:
        _choice("--methods", name, QUANT_METHODS + ("all",))
    if "all" in names:
        return QUANT_METHODS
    return tuple(m for m in QUANT_METHODS if m in names)


@dataclass
class ReportConfig:
    batch_sizes: tuple[int, ...] = (1, 32)
    threads: int = 0  # 0: as many as the machine has cores, capped at 8
    warmup: int = 3
    rounds: int = 5  # at least; every variant is timed in each round, the order rotated
    max_rounds: int = 40
    repeats: int = 0  # timed calls per variant in each round; 0: as many as fill 50 ms
    # Rounds go on until every speed-up against the fastest float has high/low at most this,
    # or max_rounds or timing_budget (seconds per batch size) run out.
    target_interval: float = 1.1
    timing_budget: float = 20.0
    max_accuracy_drop: float = 1.0
    fail_under_speedup: float = 0.0  # against fp32 eager; 0: never fail
    fail_under_float_speedup: float = 0.0  # against the fastest float variant; 0: never fail
    compare: tuple[str, ...] = ()
    device: str = "auto"  # auto: GPU rows too where there is a CUDA device; cpu: none
    quiet: bool = False

    def __post_init__(self) -> None:
        _check_types(self)
        _choice("--device", self.device, DEVICES)
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
            _at_least("--batch-sizes", size, 1)
        _at_least("--threads", self.threads, 0)
        _at_least("--warmup", self.warmup, 1)  # compiled variants build their graph there
        _at_least("--rounds", self.rounds, 3)
        _at_least("--max-rounds", self.max_rounds, self.rounds)
        _at_least("--repeats", self.repeats, 0)
        if self.repeats and self.rounds * self.repeats < 20:  # a p90 needs calls to stand on
            raise ValueError(f"--rounds x --repeats must give at least 20 timed calls, got "
                             f"{self.rounds} x {self.repeats}")
        _at_least("--target-interval", self.target_interval, 1.0)
        if not self.timing_budget > 0:
            raise ValueError(f"--timing-budget must be greater than 0, got {self.timing_budget}")
        _at_least("--max-accuracy-drop", self.max_accuracy_drop, 0.0)
        _at_least("--fail-under-speedup", self.fail_under_speedup, 0.0)
        _at_least("--fail-under-float-speedup", self.fail_under_float_speedup, 0.0)


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
        _check_types(self)
        self.paths = tuple(self.paths)
        if not self.paths:
            raise ValueError("predict needs image files or folders: pipeline predict PATH...")
        for path in self.paths:
            if not _expanded("PATH", path).exists():
                raise ValueError(f"{path} does not exist; give image files or folders")
        _at_least("--top-k", self.top_k, 1)
        _at_least("--batch-size", self.batch_size, 1)
        _at_least("--threads", self.threads, 0)


@dataclass
class ExportConfig:
    """Write a variant as a folder that runs without this project (`pipeline export`)."""

    out_dir: str = ""
    variant: str = "recommended"
    quiet: bool = False

    def __post_init__(self) -> None:
        _check_types(self)
        if not self.out_dir:
            raise ValueError("export needs the folder to write: pipeline export OUT_DIR")
        _expanded("OUT_DIR", self.out_dir)


def parse_int_list(flag: str, text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"{flag} takes whole numbers separated by commas, got {text!r}") from None


STAGE_CONFIGS = {"train": TrainConfig, "import": ImportConfig, "qat": QatConfig,
                 "quantize": QuantizeConfig, "report": ReportConfig, "predict": PredictConfig,
                 "export": ExportConfig}


def read_config_file(path: Path) -> dict[str, dict]:
    """The stage tables ([train], [quantize], ...) of a TOML file, unknown keys refused."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"--config {path}: {exc}") from None
    for stage, table in data.items():
        if stage not in STAGE_CONFIGS:
            raise ValueError(f"--config {path}: unknown table [{stage}]; known: "
                             f"{', '.join(STAGE_CONFIGS)}")
        if not isinstance(table, dict):
            raise ValueError(f"--config {path}: [{stage}] must be a table of settings")
        known = {f.name for f in dataclasses.fields(STAGE_CONFIGS[stage])}
        for key, value in table.items():
            if key not in known:
                raise ValueError(f"--config {path}: unknown key {key!r} in [{stage}]; known: "
                                 f"{', '.join(sorted(known))}")
            if key in DURATION_FIELDS and isinstance(value, str):
                continue  # a duration such as "5m": parsed, and refused, by its config
            problem = type_error(STAGE_CONFIGS[stage], {key: value})
            if problem:
                raise ValueError(f"--config {path}: {key} in [{stage}] {problem}")
    return data


def build_config(stage: str, file_values: dict[str, Any], flag_values: dict[str, Any]):
    """Defaults < config file < flags; a flag left at None does not override the file."""
    values = dict(file_values)
    values.update({k: v for k, v in flag_values.items() if v is not None})
    return STAGE_CONFIGS[stage](**values)
