"""Training: the `amp` model under autocast (+ GradScaler for float16) and the `fp32` baseline.

Both see the same seed, initial weights, data order and hyperparameters, so the only difference
between them is the precision of the forward and backward pass. Both save fp32 master weights:
AMP changes how a model trains, not what it weighs on disk. model.pt holds the weights of the
last epoch, or of an earlier one that was better on validation beyond noise
(training/choice.py): the model every later stage starts from.

The epochs are training/loop.py's `fit` (qat's loop too); this stage adds checkpoints and
resume, the --time plan, the --patience stop, metrics.jsonl and the errors for a NaN loss,
GradScaler's skips in a row or a dead DataLoader worker.
"""
from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path

from stages.data.datasets import DataSplits, expected_shape, load_splits, record_preprocessing
from stages.measure.evaluate import dataset_accuracy, dataset_hits
from stages.measure.machine import isa
from stages.models.build import build_model, check_model_fits, model_spec
from stages.models.weights import initial_weights
from stages.run.artifacts import Run
from stages.run.checkpoints import (
    Checkpointer,
    best_weights,
    cpu_state_dict,
    newest_good_checkpoint,
    weights_digest,
)
from stages.run.errors import PipelineError
from stages.run.files import (
    atomic_torch_save,
    atomic_write_text,
    remove_stale_temporaries,
)
from stages.run.progress import say
from stages.run.trained import list_amp_as_baseline, resumed_config
from stages.training import batchnorm, distributed, failures, lr_range, plans
from stages.training.loop import Hooks, Loop, Seen, build_parts, fit, recipe
from stages.training.memory import PeakMemory, peak_memory_in_fresh_process
from stages.training.precision import (
    Precision,
    cap_isa_for_bf16_training,
    resolve_device,
    resolve_precision,
    set_deterministic,
)
from stages.training.step_speed import choose_precision


@dataclass
class TrainResult:
    variant: str
    precision: str
    device: str
    world_size: int
    seconds: float
    samples_per_second: float
    peak_memory_bytes: int
    peak_memory_method: str
    test_accuracy: float
    val_accuracy: float  # the chosen epoch's
    chosen_epoch: int
    skipped_steps: int
    optimizer_steps: int
    final_loss: float
    epochs: int
    resumed_from: str | None
    isa: dict | None = None
    val_at_chance: bool = False
    skipped_images: int = 0
    epochs_run: int = 0
    stopped: str = ""  # why training ended: at --epochs, on a plateau, or at the --time plan
    memory_format: str = "channels_last"  # or "NCHW" where the model's forward needs it


@dataclass
class Model:
    """One model this stage trains: its loop, and beside it its run, checkpoints and data."""

    variant: str
    loop: Loop
    config: object
    run: Run
    splits: DataSplits
    folder: Path
    spec: dict
    checkpointer: Checkpointer
    baseline_epochs: int  # that the fp32 baseline ran without a NaN loss (0: no baseline)
    chance: float = 0.0
    resumed_from: str | None = None

    def state(self) -> dict:
        """What a checkpoint holds: the loop's state, and what the model is."""
        return self.loop.state() | {"variant": self.variant,
                                    "precision": self.loop.precision.name,
                                    "model_spec": self.spec, "config": asdict(self.config)}


def _start(variant: str, precision: Precision, splits: DataSplits, config, run: Run, device,
           resume: bool, baseline_epochs: int) -> Model:
    """Build the model and its parts; with ``resume``, restore the newest good checkpoint."""
    world = distributed.current()
    folder = run.root / "train" / variant
    if world.is_main:
        folder.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(folder)
    loop = Loop(variant, build_parts(config, splits, precision, device), precision, device,
                config.epochs, config.batch_size, config.grad_clip, config.checkpoint_every,
                quiet=config.quiet or not world.is_main)
    model = Model(variant, loop, config, run, splits, folder,
                  model_spec(config.model, splits.num_classes, splits.in_channels,
                             splits.image_size),
                  Checkpointer(run, variant, folder, config.keep_checkpoints, asdict(config)),
                  baseline_epochs)
    for note in loop.parts.notes:
        say(f"{variant}: initial weights: {note}", quiet=loop.quiet)
    found = newest_good_checkpoint(run, variant) if resume else None
    # Each rank reads the files for itself: one that could not read the newest would step
    # apart from the others, pairing its collectives with theirs.
    if len(set(distributed.all_gather(found and found[0]))) > 1:
        raise PipelineError(f"{variant}: the ranks found different checkpoints to resume from; "
                            "check that every rank sees the run folder alike")
    if found:
        model.resumed_from, state = found
        loop.restore(state, best_weights(run, variant, state["totals"]["best_epoch"]))
        say(f"{variant}: resuming from {model.resumed_from} (epoch {loop.pos.epoch}, step "
            f"{loop.pos.step_in_epoch}/{loop.parts.steps_per_epoch})", quiet=not world.is_main)
    model.chance = failures.chance(splits.val)
    return model


def _hooks(model: Model, budget: float | None) -> Hooks:
    """What train adds to the loop: checkpoints, the --time plan and --patience, metrics, and
    its errors for a NaN loss, skipped steps in a row and a dead DataLoader worker."""
    return Hooks(score=lambda epoch: _score(model), check=partial(_check, model),
                 end_epoch=partial(_end_epoch, model, budget),
                 guard=lambda epoch, data_iterator: failures.worker_failures(
                     model.variant, epoch, model.loop.pos, model.folder, data_iterator),
                 checkpoint=partial(_checkpoint, model))


def _check(model: Model, seen: Seen, epoch: int, epoch_start: int) -> None:
    """Stop on a NaN loss or too many skipped steps in a row."""
    loop = model.loop
    if seen.first_bad >= 0:
        raise PipelineError(failures.nan_message(
            model.variant, loop.precision, loop.device, epoch, seen.first_bad - epoch_start + 1,
            model.folder, model.baseline_epochs))
    if seen.longest_run > model.config.max_skipped_steps:
        raise PipelineError(
            f"{model.variant}: GradScaler skipped {seen.longest_run} optimizer steps in a "
            f"row (inf/NaN gradients) up to epoch {epoch} step {loop.pos.step_in_epoch}; "
            "lower --lr, add --grad-clip or use --precision bf16")


def _checkpoint(model: Model) -> None:
    """A checkpoint inside an epoch (--checkpoint-every), every rank's buffers alike first."""
    distributed.sync_buffers(model.loop.parts.model)
    if distributed.current().is_main:
        model.checkpointer.save(model.state(), best=False)


def _score(model: Model):
    """Recompute BatchNorm statistics from training images, then score the validation split:
    its hits, image by image; rank 0's on every rank, so that ranks whose kernels round one
    image apart (CPUs of two kinds) still keep the same best epoch and cut the same plan."""
    trained, device = model.loop.parts.model, model.loop.device
    batchnorm.recompute_module(trained, model.splits.calibration, model.config.batch_size,
                               device)
    distributed.sync_buffers(trained)
    return distributed.broadcast(dataset_hits(trained, model.splits.val, device))


def _end_epoch(model: Model, budget: float | None, epoch: int, record: dict,
               improved: bool) -> None:
    """Plan the epochs left, stop on a plateau, write metrics and checkpoint, say how it went."""
    loop, config, totals = model.loop, model.config, model.loop.totals
    totals.stopped = plans.planned_end(loop, epoch, budget)
    record |= {"lr": loop.parts.scheduler.get_last_lr()[0], "seconds": totals.seconds,
               "samples_per_second": totals.samples / totals.seconds,
               "skipped_steps": totals.skipped, "skipped_images": model.splits.skipped_images}
    if not totals.stopped:
        plans.anneal_on_plateau(loop, epoch, config.patience)
    is_main = distributed.current().is_main
    if is_main:
        atomic_write_text(model.folder / "metrics.jsonl",
                          "".join(json.dumps(h) + "\n" for h in loop.history))
        model.checkpointer.save(model.state(), best=improved)
    say(f"{model.variant} epoch {epoch}/{loop.planned_epochs}: loss {record['loss']:.4f} "
        f"train acc {record['train_accuracy']:.3f} val acc {record['val_accuracy']:.3f}",
        quiet=loop.quiet)
    failures.warn_at_chance(model.variant, record, model.chance, len(model.splits.val),
                            quiet=not is_main)


def train_variant(variant: str, precision: Precision, splits: DataSplits, config, run: Run,
                  device, resume: bool = False, baseline_epochs: int = 0,
                  budget: float | None = None) -> TrainResult:
    """Train one model (or continue it), writing checkpoints, metrics.jsonl and model.pt, to
    --epochs, a --patience plateau, or the epochs that fit ``budget`` seconds at its pace."""
    model = _start(variant, precision, splits, config, run, device, resume, baseline_epochs)
    memory = PeakMemory(device) if device.type == "cuda" else contextlib.nullcontext()
    totals = model.loop.totals  # a resume keeps the share it started with (its checkpoint's)
    totals.budget = budget if totals.budget is None else totals.budget
    with memory:
        fit(model.loop, _hooks(model, totals.budget))
    return _finish(model, memory)


def _finish(model: Model, memory) -> TrainResult:
    """With the epoch chosen on validation loaded (fit does): check that every rank holds the
    same weights, score the test split, and (rank 0) write model.pt and list it."""
    world = distributed.current()
    loop, config = model.loop, model.config
    digests = distributed.all_gather(weights_digest(loop.parts.model.state_dict()))
    if len(set(digests)) != 1:
        raise PipelineError(f"{model.variant}: ranks ended with different weights; please "
                            "report this")
    result = _result(model, memory)
    if not world.is_main:
        return result
    if loop.device.type != "cuda" and config.measure_memory:
        result.peak_memory_bytes, result.peak_memory_method = peak_memory_in_fresh_process(
            config, loop.precision)
    elif loop.device.type != "cuda":
        result.peak_memory_method = "not measured (--no-measure-memory)"
    atomic_torch_save({"model_spec": model.spec,
                       "state_dict": cpu_state_dict(loop.parts.model)},
                      model.folder / "model.pt")
    run, variant = model.run, model.variant
    run.register(f"{variant}/metrics", model.folder / "metrics.jsonl", kind="metrics",
                 stage="train", parent=variant)
    run.register(variant, model.folder / "model.pt", kind="model", stage="train",
                 config=asdict(config), format="pytorch", model_spec=model.spec,
                 chosen=loop.totals.chosen,
                 initial_weights={"file": config.init_weights, "torchvision": config.weights,
                                  "adapted": loop.parts.notes},
                 training=asdict(result) | {"weights_sha256_all_ranks": digests[0]},
                 checkpoint_bytes=run.entry(f"{variant}/checkpoint-last")["bytes"],
                 data=model.splits.identity())
    return result


def _result(model: Model, memory) -> TrainResult:
    loop, splits, totals = model.loop, model.splits, model.loop.totals
    last = loop.history[-1] if loop.history else {"loss": float("nan"), "train_accuracy": 0.0}
    chosen = next((h for h in loop.history if h["epoch"] == totals.chosen_epoch), last)
    val_accuracy = chosen.get("val_accuracy", totals.best_val)
    on_cuda = loop.device.type == "cuda"
    return TrainResult(
        variant=model.variant, precision=loop.precision.name, device=str(loop.device),
        world_size=distributed.current().world_size, seconds=totals.seconds,
        samples_per_second=totals.samples / totals.seconds if totals.seconds else 0.0,
        peak_memory_bytes=int(memory.peak) if on_cuda else 0,
        peak_memory_method=memory.method if on_cuda else "",
        test_accuracy=dataset_accuracy(loop.parts.model, splits.test, loop.device),
        val_accuracy=val_accuracy, chosen_epoch=totals.chosen_epoch,
        skipped_steps=totals.skipped,
        optimizer_steps=loop.pos.global_step - totals.skipped, final_loss=last["loss"],
        epochs=model.config.epochs, resumed_from=model.resumed_from,
        epochs_run=len(loop.history), stopped=totals.stopped,
        isa=isa() if not on_cuda else None, memory_format=loop.parts.memory_format,
        val_at_chance=failures.at_chance(chosen.get("train_accuracy", 0.0), val_accuracy,
                                         model.chance, len(splits.val)),
        skipped_images=splits.skipped_images)


def preflight(config) -> None:
    """What can be refused before a run exists: a model that does not import or cannot take
    the data at this size, and starting weights that are not weights or do not fit."""
    device = resolve_device(config.device)
    classes, channels, held = expected_shape(config)
    check_model_fits(config.model, classes, channels, config.image_size, config.batch_size,
                     device, held)
    if config.init_weights or config.weights:
        initial_weights(config, build_model(config.model, classes, channels, config.image_size))


def run(config, run: Run, resume: bool = False,
        resume_keeps: tuple[str, ...] = ()) -> list[TrainResult]:
    """Train `amp` and, unless config.baseline is off, the `fp32` baseline beside it.

    With ``resume``, the run's own configuration (resumed_config) holds: a variant whose
    model.pt is listed is done; the others continue from their newest good checkpoint, or
    start afresh where they have none. A resumed run keeps the precision it was started with,
    whatever the machine it resumes on.
    """
    import torch

    if resume:
        config = resumed_config(config, run, distributed.current().world_size, resume_keeps)
    started = time.monotonic()
    deterministic_before = torch.are_deterministic_algorithms_enabled()
    # Before the precision's timing and the range test: the rate it reads must not move.
    set_deterministic(config.deterministic or deterministic_before,
                      resolve_device(config.device))
    try:
        device, precision, splits, config = _set_up(config, run, resume)
        # Where autocast resolves to fp32, `amp` is the baseline's computation step for step
        # (same seed, data order and hyperparameters): trained once, fp32 listed as its copy.
        baseline_is_amp = config.baseline and precision.name == "fp32"
        trained_baseline = config.baseline and not baseline_is_amp
        variants = ([("fp32", Precision("fp32"))] if trained_baseline else []) + [
            ("amp", precision)]
        results = _train_each(variants, splits, config, run, device, resume,
                              spent=time.monotonic() - started)
    finally:  # later stages in the same chain may use ops with no deterministic kernel
        torch.use_deterministic_algorithms(deterministic_before)
    is_main = distributed.current().is_main
    if baseline_is_amp:  # fp32: the same run as amp, listed as its copy
        results.insert(0, TrainResult(**(asdict(results[-1]) | {"variant": "fp32"})))
        if is_main:
            list_amp_as_baseline(run, asdict(config), quiet=config.quiet)
    for result in results:
        say(f"trained {result.variant} ({result.precision}): test accuracy "
            f"{result.test_accuracy:.4f} (epoch {result.chosen_epoch}, chosen on validation; "
            f"stopped: {result.stopped or 'resumed at its end'}), "
            f"{result.samples_per_second:.0f} samples/s, {result.skipped_steps} skipped steps",
            quiet=not is_main)
    return results


def _set_up(config, run: Run, resume: bool) -> tuple:
    """The device, the precision (a resume's own), the data, and the config with its learning
    rate resolved; rank 0 records them in the run."""
    import torch

    device = resolve_device(config.device)
    world = distributed.current()
    if world.active and device.type == "cuda":
        device = torch.device("cuda", world.local_rank)
    # Rank 0's reading: a rank that read the file apart could see another record.
    saved = distributed.broadcast(run.recorded_config("train")) if resume else {}
    found_at = saved.get("data", {}).get("data_dir")  # where it read its data, whatever cwd
    config = replace(config, data_dir=found_at) if found_at and Path(found_at).is_dir() else config
    # Rank 0's answer: ranks on CPUs of two kinds would otherwise train different variants.
    precision = Precision(saved["resolved_precision"]) if "resolved_precision" in saved \
        else Precision(distributed.broadcast(resolve_precision(config.precision, device).name))
    cap_isa_for_bf16_training(precision.name, device.type)
    classes, channels, held = expected_shape(config)
    check_model_fits(config.model, classes, channels, config.image_size, config.batch_size,
                     device, held)
    # --download under torchrun: every rank writing the same archive at once corrupted it.
    splits = distributed.main_first(lambda first: load_splits(replace(
        config, download=config.download and first), saved.get("data")), only_if=config.download)
    # Recorded as each part is settled, so that a run stopped while the precision is timed or
    # the range test runs can be resumed (--resume reads its flags back from here), redoing
    # only what had not been recorded.
    recorded = saved | asdict(config) | {"resolved_device": str(device), "world_size":
                                         world.world_size, "data": splits.identity(),
                                         "recipe": recipe(config, splits)}

    def record(settled: dict) -> None:  # each write holds all the ones before it
        recorded.update(settled)
        if world.is_main:
            run.record_config("train", recorded)

    record({})
    chosen_by = saved.get("precision_chosen_by", "")
    if "resolved_precision" not in saved:  # a resume keeps its precision, and why
        precision, chosen_by = choose_precision(config, splits, precision, device)
    record({"resolved_precision": precision.name, "precision_chosen_by": chosen_by})
    lr, found_by = lr_range.peak_lr(config, splits, precision, device, run, saved)
    record({"resolved_lr": lr, "lr_found_by": found_by})
    if world.is_main:
        record_preprocessing(run, splits, config.dataset, "train")
    return device, precision, splits, replace(config, lr=lr)


def _train_each(variants: list, splits: DataSplits, config, run: Run, device,
                resume: bool, spent: float) -> list[TrainResult]:
    """Each variant trained in turn; with ``resume``, one already listed is read back."""
    results = []
    # --time holds for the stage (loading the data and the range test ``spent`` some) and is
    # shared by the models, not spent twice. These shares are for models starting afresh: one
    # resumed from a checkpoint keeps the share it started with (Totals.budget, train_variant),
    # its time before the resume counted (its restored wall clock).
    each = max(0.0, config.time - spent) / len(variants) if config.time else None
    # What a model takes past its share (scoring the test split, the memory probe: outside
    # its epochs' plan) comes off the later models', so that the stage keeps to --time.
    started = time.monotonic()
    for name, precision in variants:
        if resume and name in run.artifacts():
            saved_result = run.entry(name)["training"]
            results.append(TrainResult(**{f: saved_result.get(f)
                                          for f in TrainResult.__dataclass_fields__}))
            say(f"{name}: already finished", quiet=config.quiet)
            continue
        baseline_epochs = max([r.epochs_run or 0 for r in results if r.variant == "fp32"] + [0])
        left = config.time - spent - (time.monotonic() - started) if config.time else None
        budget = min(each, max(0.0, left)) if config.time else None
        results.append(train_variant(name, precision, splits, config, run, device, resume,
                                     baseline_epochs, budget))
    return results
