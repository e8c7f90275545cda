"""What a run's float model tells the stages after train (or import): which model they start
from (`amp`, else an imported `fp32`), and the data it was trained on, read back from its
manifest entry through a dataclass; the configuration train --resume takes back; and `fp32`
listed as a copy of an `amp` that trained in fp32.

The stage configs themselves stay in pipeline/config.py, where the CLI builds and validates
them: stages/ does not import pipeline/ (tests/test_layers.py), and a later stage needs only
the data fields, which every saved train and import config holds.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass, fields, replace

from stages.run.errors import UsageError
from stages.run.files import atomic_write
from stages.run.progress import say

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


def resumed_config(config, run, world_size: int, keeps: tuple[str, ...] = ()):
    """The configuration ``run`` was started with, for --resume; quiet and device are
    ``config``'s (today's), and the fields named in ``keeps``. Refused in another number of
    processes (``world_size``) than it started with: checkpoints count steps and the schedule
    in each process's share of the data, so it would re-enter epochs part way and end its
    schedule early."""
    saved = run.recorded_config("train")
    if not saved:
        raise UsageError(f"run {run.name!r} has no saved training configuration to resume")
    if saved.get("world_size", 1) != world_size:
        raise UsageError(f"run {run.name!r} trained in {saved.get('world_size', 1)} "
                         f"process(es), and --resume here runs {world_size}: resume it with as "
                         "many (torchrun --nproc_per_node)")
    kept = {f.name for f in fields(config)} - {"quiet", "device", *keeps}
    try:
        return replace(config, **{k: v for k, v in saved.items() if k in kept})
    except ValueError as exc:  # a flag --resume refuses: the fault is in what was saved
        raise UsageError(f"run {run.name!r} cannot resume as it was started: {exc}; put it "
                         "back as it was, or train again") from None


def list_amp_as_baseline(run, config: dict, quiet: bool) -> None:
    """`fp32` as a copy of an `amp` model that trained in fp32: the file the run-folder contract
    promises, listed with the amp run's figures and marked as the same run."""
    listed = run.artifacts().get("fp32")
    if listed and listed.get("training", {}).get("same_run_as") != "amp":
        return  # a baseline trained on its own before (a resumed older run): keep it
    folder = run.root / "train" / "fp32"
    folder.mkdir(parents=True, exist_ok=True)
    source = run.entry("amp")
    path = folder / "model.pt"
    with open(run.verified_path("amp"), "rb") as trained:
        atomic_write(path, lambda out: shutil.copyfileobj(trained, out))
    run.register("fp32", path, kind="model", stage="train", config=config,
                 format="pytorch", model_spec=source["model_spec"], chosen=source["chosen"],
                 initial_weights=source["initial_weights"],
                 training=source["training"] | {"variant": "fp32", "same_run_as": "amp"},
                 checkpoint_bytes=source["checkpoint_bytes"], data=source.get("data"))
    say("fp32: the same run as amp (autocast resolved to fp32), not trained twice; "
        f"copied to {path}", quiet=quiet)
