"""What a run's float model tells the stages after train (or import): which model they start
from (`amp`, else an imported `fp32`), and the data it was trained on, read back from its
manifest entry through a dataclass; and the configuration train --resume takes back.

The stage configs themselves stay in pipeline/config.py, where the CLI builds and validates
them: stages/ does not import pipeline/ (tests/test_layers.py), and a later stage needs only
the data fields, which every saved train and import config holds.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

from stages.run.errors import UsageError

FLOAT_MODELS = ("amp", "fp32")  # a later stage starts from the first the run has


def float_source(run) -> str:
    """The variant every quantized model is made from: `amp`, else an imported `fp32`."""
    artifacts = run.artifacts()
    for name in FLOAT_MODELS:
        if name in artifacts:
            return name
    raise UsageError(f"run {run.name!r} has no float model; run 'pipeline train' or "
                     "'pipeline import' first")


@dataclass(frozen=True)
class DataConfig:
    """The fields of a train or import config that name the data and its split: what
    load_splits takes. Defaults are TrainConfig's, for a field a run saved before it existed
    (tests/stages/run/test_trained.py holds them equal)."""

    dataset: str
    image_size: int
    seed: int
    data_dir: str = "data"
    download: bool = False
    val_fraction: float = 0.1
    in_channels: int | None = None
    skip_bad_images: bool = False

    @classmethod
    def saved(cls, config: dict) -> DataConfig:
        """The data fields of a saved config (asdict of a TrainConfig or ImportConfig); the
        rest, training's own, are not a later stage's business."""
        names = {field.name for field in fields(cls)}
        return cls(**{name: value for name, value in config.items() if name in names})


def trained_data(run) -> DataConfig:
    """The data the run's float model was trained on, from its manifest entry."""
    return DataConfig.saved(run.entry(float_source(run))["config"])


def resumed_config(config, run, world_size: int):
    """The configuration ``run`` was started with, for --resume; quiet and device are
    ``config``'s (today's). Refused in another number of processes (``world_size``) than it
    started with: checkpoints count steps and the schedule in each process's share of the
    data, so it would re-enter epochs part way and end its schedule early."""
    saved = run.recorded_config("train")
    if not saved:
        raise UsageError(f"run {run.name!r} has no saved training configuration to resume")
    if saved.get("world_size", 1) != world_size:
        raise UsageError(f"run {run.name!r} trained in {saved.get('world_size', 1)} "
                         f"process(es), and --resume here runs {world_size}: resume it with as "
                         "many (torchrun --nproc_per_node)")
    kept = {f.name for f in fields(config)} - {"quiet", "device"}
    try:
        return replace(config, **{k: v for k, v in saved.items() if k in kept})
    except ValueError as exc:  # a flag --resume refuses: the fault is in what was saved
        raise UsageError(f"run {run.name!r} cannot resume as it was started: {exc}; put it "
                         "back as it was, or train again") from None
