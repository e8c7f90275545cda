"""Training: the `amp` model under autocast (+ GradScaler for float16) and the `fp32` baseline.

Both see the same seed, initial weights, data order and hyperparameters, so the only difference
between them is the precision of the forward and backward pass. Both save fp32 master weights:
AMP changes how a model trains, not what it weighs on disk. model.pt holds the weights of the
epoch with the best validation accuracy, the one every later stage starts from.

The loop keeps its running sums on the device and reads them only at check points (every step
on the CPU, where reading is free; every LOG_EVERY_CUDA steps on a GPU), so that a GPU is not
made to wait for the host after each step.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from stages.data.datasets import (
    DataSplits,
    expected_shape,
    load_splits,
    make_loader,
    record_preprocessing,
)
from stages.measure.evaluate import dataset_accuracy
from stages.measure.machine import isa
from stages.models.build import build_model, check_model_fits, model_spec
from stages.models.weights import initial_weights
from stages.run import signals
from stages.run.artifacts import (
    Run,
    atomic_torch_save,
    atomic_write,
    atomic_write_text,
    remove_stale_temporaries,
)
from stages.run.checkpoints import (
    Checkpointer,
    best_weights,
    cpu_state_dict,
    newest_good_checkpoint,
    restore_rng,
    rng_state,
    weights_digest,
)
from stages.run.errors import PipelineError
from stages.run.progress import progress, say
from stages.training import batchnorm, distributed, lr_range
from stages.training.loop import DeviceSums, Parts, build_parts, train_step
from stages.training.memory import PeakMemory
from stages.training.precision import (
    Precision,
    auto_precision_note,
    cap_isa_for_bf16_training,
    resolve_device,
    resolve_precision,
    set_deterministic,
)

LOG_EVERY_CUDA = 50
# The first step allocates gradients and SGD momentum; later ones reuse them: resnet18 on the
# digits peaked within 0.3% after 3 steps as after 8, in 6.3 to 6.6 s of probe, not 9.1 to 9.2.
MEMORY_PROBE_STEPS = 3


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
    val_accuracy: float
    best_epoch: int
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


def _stop_workers(data_iterator) -> None:
    """Shut a failed loader's workers down with SIGCHLD held back, so that the death of a
    worker cannot raise a second error while the first is being reported."""
    import signal

    with signals.deferred(signal.SIGCHLD):
        try:
            data_iterator._shutdown_workers()  # what its __del__ would do; unregisters the pids
        except Exception:  # the workers are already gone; nothing more to clean up
            pass


def _is_worker_failure(exc: BaseException) -> bool:
    if isinstance(exc, (ConnectionError, EOFError)):  # a worker killed mid-handover breaks the pipe
        return True
    return isinstance(exc, RuntimeError) and any(
        marker in str(exc) for marker in ("DataLoader worker", "DataLoader timed out"))


@contextlib.contextmanager
def _worker_failures(variant: str, epoch: int, pos: dict, folder: Path, data_iterator):
    """A DataLoader worker that dies or goes silent becomes one clear error. The death is
    reported by a SIGCHLD handler, so it can surface anywhere in the epoch, not only where the
    next batch is fetched; checkpoints already written stay as they are."""
    try:
        yield
    except (RuntimeError, ConnectionError, EOFError) as exc:
        if not _is_worker_failure(exc):
            raise
        first = str(exc) or type(exc).__name__
        # One death can arrive twice: as the broken pipe, then as its SIGCHLD, whose handler
        # raises again wherever the main thread is until the workers are shut down (here too,
        # before _stop_workers holds it back: a CI run saw it). Each worker dies once, so a
        # few tries shut them down.
        for _ in range(8):
            try:
                if hasattr(data_iterator, "_shutdown_workers"):
                    _stop_workers(data_iterator)
                break
            except RuntimeError as again:
                if not _is_worker_failure(again):
                    raise
        raise PipelineError(
            f"{variant}: a DataLoader worker died or hung at epoch {epoch} step "
            f"{pos['step_in_epoch'] + 1} ({first.splitlines()[0][:160]}); checkpoints in "
            f"{folder} are intact: fix the data or use --workers 0, then 'pipeline train "
            "--resume'") from None


def _nan_message(variant: str, precision: Precision, device, epoch: int, step: int,
                 folder: Path, baseline_finite: bool) -> str:
    """Name the likely cause: a learning rate is to blame only where fp32 did not cope."""
    where = (f"{variant}: the loss became NaN or infinite at epoch {epoch} step {step} "
             f"(checkpoints already written in {folder} are untouched)")
    if precision.name != "fp32" and baseline_finite:
        return (f"{where}; the fp32 baseline trained through the same steps with the same "
                f"learning rate, so the cause is {precision.name} arithmetic or its kernels on "
                f"this {device.type.upper()}, not --lr: use --precision fp32 (and report the CPU, "
                f"torch version and ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', '')})")
    return f"{where}; lower --lr, add --grad-clip 1, or try --precision fp32"


def _at_chance(train_accuracy: float, val_accuracy: float, chance: float, val_size: int) -> bool:
    """Learning the training split while validation stays near chance (the share of the
    largest class): a model that does not generalise, never one worth quantizing."""
    noise = 3 * math.sqrt(chance * (1 - chance) / max(val_size, 1))
    return train_accuracy >= chance + 0.3 and val_accuracy <= chance + max(noise, 0.1)


def _chance(dataset) -> float:
    """The share of the largest class: what always guessing it scores."""
    import torch

    labels = torch.cat([labels for _, labels in make_loader(dataset, 1024)])
    return float(torch.bincount(labels).max()) / len(labels) if len(labels) else 0.0


@dataclass
class Loop:
    """One model's training: what it is made of, and everything a checkpoint saves and a resume
    restores (position, running sums, totals, history)."""

    variant: str
    precision: Precision
    splits: DataSplits
    config: object
    run: Run
    device: object
    parts: Parts
    folder: Path
    spec: dict
    checkpointer: Checkpointer
    baseline_finite: bool
    pos: dict = field(default_factory=lambda: {"epoch": 1, "step_in_epoch": 0,
                                               "global_step": 0})
    sums: dict = field(default_factory=lambda: {"loss": 0.0, "correct": 0, "seen": 0})
    totals: dict = field(default_factory=lambda: {"skipped": 0, "seconds": 0.0, "samples": 0,
                                                  "best_val": -1.0, "best_epoch": 0,
                                                  "wall": 0.0, "planned_epochs": None,
                                                  "stopped": ""})
    history: list = field(default_factory=list)
    best: dict | None = None  # weights of the epoch with the best validation accuracy
    resumed_from: str | None = None
    in_a_row: object = None  # GradScaler's skips in a row, carried across epochs

    @property
    def planned_epochs(self) -> int:
        """The epochs this model trains for: --epochs, or fewer where --time cut them."""
        return self.totals["planned_epochs"] or self.config.epochs

    @property
    def quiet(self) -> bool:
        return self.config.quiet or not distributed.current().is_main

    def state(self) -> dict:
        return {"model": self.parts.model.state_dict(),
                "optimizer": self.parts.optimizer.state_dict(),
                "scheduler": self.parts.scheduler.state_dict(),
                "scaler": self.parts.scaler.state_dict(), "position": dict(self.pos),
                "sums": dict(self.sums), "totals": dict(self.totals),
                "history": list(self.history), "rng": rng_state(), "variant": self.variant,
                "precision": self.precision.name, "model_spec": self.spec,
                "config": asdict(self.config)}

    def check(self, device_sums: DeviceSums, epoch: int, epoch_start: int) -> dict:
        """Fold the device's sums into the host's; stop on a NaN loss or too many skips."""
        seen = device_sums.read()
        if seen["first_bad"] >= 0:
            raise PipelineError(_nan_message(self.variant, self.precision, self.device, epoch,
                                             seen["first_bad"] - epoch_start + 1, self.folder,
                                             self.baseline_finite))
        if seen["longest_run"] > self.config.max_skipped_steps:
            raise PipelineError(
                f"{self.variant}: GradScaler skipped {seen['longest_run']} optimizer steps in a "
                f"row (inf/NaN gradients) up to epoch {epoch} step {self.pos['step_in_epoch']}; "
                "lower --lr, add --grad-clip or use --precision bf16")
        return seen


def _start(variant: str, precision: Precision, splits: DataSplits, config, run: Run, device,
           resume: bool, baseline_finite: bool) -> Loop:
    """Build the model and its training parts; with ``resume``, restore the newest good
    checkpoint."""
    world = distributed.current()
    folder = run.root / "train" / variant
    if world.is_main:
        folder.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(folder)
    loop = Loop(variant, precision, splits, config, run, device,
                build_parts(config, splits, precision, device), folder,
                model_spec(config.model, splits.num_classes, splits.in_channels,
                           splits.image_size),
                Checkpointer(run, variant, folder, config.keep_checkpoints, asdict(config)),
                baseline_finite)
    for note in loop.parts.notes:
        say(f"{variant}: initial weights: {note}", quiet=loop.quiet)
    found = newest_good_checkpoint(run, variant) if resume else None
    if found:
        loop.resumed_from, state = found
        loop.parts.model.load_state_dict(state["model"])
        loop.parts.optimizer.load_state_dict(state["optimizer"])
        loop.parts.scheduler.load_state_dict(state["scheduler"])
        loop.parts.scaler.load_state_dict(state["scaler"])
        loop.pos, loop.sums = state["position"], state["sums"]
        loop.totals |= state["totals"]
        loop.history = state["history"]
        loop.best = best_weights(run, variant)
        restore_rng(state["rng"])
        say(f"{variant}: resuming from {loop.resumed_from} (epoch {loop.pos['epoch']}, step "
            f"{loop.pos['step_in_epoch']}/{len(loop.parts.loader)})", quiet=not world.is_main)
    return loop


def _train_epoch(loop: Loop, epoch: int) -> dict:
    """The optimizer steps of one epoch (from where a resume left off), with the checkpoints
    --checkpoint-every asks for inside it; returns the epoch's sums read from the device."""
    parts, pos, config, device = loop.parts, loop.pos, loop.config, loop.device
    steps_per_epoch = len(parts.loader)
    check_every = 1 if device.type == "cpu" else LOG_EVERY_CUDA
    parts.trained.train()
    parts.sampler.set_epoch(epoch, start=pos["step_in_epoch"] * config.batch_size)
    data_iterator = iter(parts.loader)
    bar = progress(data_iterator, desc=f"{loop.variant} {epoch}/{loop.planned_epochs}",
                   quiet=loop.quiet, total=steps_per_epoch)
    device_sums = DeviceSums(device, loop.in_a_row)
    epoch_start = pos["global_step"] - pos["step_in_epoch"]
    started = time.perf_counter()
    with _worker_failures(loop.variant, epoch, pos, loop.folder, data_iterator):
        for images, labels in bar:
            train_step(parts, loop.precision, device, config, images, labels, device_sums,
                       pos["global_step"])
            pos["step_in_epoch"] += 1
            pos["global_step"] += 1
            every = config.checkpoint_every
            checkpoint_now = (every and pos["global_step"] % every == 0
                              and pos["step_in_epoch"] < steps_per_epoch)
            if pos["step_in_epoch"] % check_every and not checkpoint_now:
                continue
            seen = loop.check(device_sums, epoch, epoch_start)
            shown = {k: loop.sums[k] + seen[k] for k in ("loss", "correct", "seen")}
            if hasattr(bar, "set_postfix") and shown["seen"]:
                bar.set_postfix(loss=f"{shown['loss'] / shown['seen']:.3f}",
                                acc=f"{shown['correct'] / shown['seen']:.3f}", refresh=False)
            if checkpoint_now:
                # A checkpoint holds host numbers: fold the device's sums in first.
                loop.totals["seconds"] += time.perf_counter() - started
                loop.totals["skipped"] += seen["skipped"]
                loop.sums = shown
                device_sums = DeviceSums(device, device_sums.in_a_row)
                distributed.sync_buffers(parts.model)
                if distributed.current().is_main:
                    loop.checkpointer.save(loop.state(), best=False)
                started = time.perf_counter()
    seen = loop.check(device_sums, epoch, epoch_start)
    loop.in_a_row = device_sums.in_a_row
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
    loop.totals["seconds"] += time.perf_counter() - started
    loop.totals["skipped"] += seen["skipped"]
    return seen


def _end_epoch(loop: Loop, epoch: int, seen: dict, chance: float) -> None:
    """Recompute BatchNorm statistics, score the validation split, keep the best weights,
    write the metrics and the epoch's checkpoint."""
    model, splits, config = loop.parts.model, loop.splits, loop.config
    loss_sum, correct, count = (loop.sums[k] + seen[k] for k in ("loss", "correct", "seen"))
    loop.totals["samples"] += count
    batchnorm.recompute_module(model, splits.calibration, config.batch_size, loop.device)
    distributed.sync_buffers(model)
    val_acc = dataset_accuracy(model, splits.val, loop.device)
    record = {"epoch": epoch, "loss": loss_sum / count, "train_accuracy": correct / count,
              "val_accuracy": val_acc, "lr": loop.parts.scheduler.get_last_lr()[0],
              "seconds": loop.totals["seconds"],
              "samples_per_second": loop.totals["samples"] / loop.totals["seconds"],
              "skipped_steps": loop.totals["skipped"], "skipped_images": splits.skipped_images}
    loop.history.append(record)
    improved = val_acc > loop.totals["best_val"]
    if improved:
        loop.totals.update(best_val=val_acc, best_epoch=epoch)
        loop.best = cpu_state_dict(model, clone=True)
    patience = getattr(config, "patience", None)
    if patience and not loop.totals["stopped"] and epoch - loop.totals["best_epoch"] >= patience:
        loop.totals["stopped"] = (f"plateau: validation accuracy did not improve for {patience} "
                                  f"epochs after epoch {loop.totals['best_epoch']}")
    loop.sums = {"loss": 0.0, "correct": 0, "seen": 0}
    if distributed.current().is_main:
        atomic_write_text(loop.folder / "metrics.jsonl",
                          "".join(json.dumps(h) + "\n" for h in loop.history))
        loop.checkpointer.save(loop.state(), best=improved)
    say(f"{loop.variant} epoch {epoch}/{loop.planned_epochs}: loss {record['loss']:.4f} "
        f"train acc {record['train_accuracy']:.3f} val acc {val_acc:.3f}", quiet=loop.quiet)
    if _at_chance(record["train_accuracy"], val_acc, chance, len(splits.val)):
        say(f"WARNING: {loop.variant} learns the training images "
            f"({record['train_accuracy']:.1%}) but its validation accuracy is at chance "
            f"({val_acc:.1%}): it does not generalise to held-out images; check the data "
            "(labels, a train/validation mix-up) and any layer that behaves differently in "
            "evaluation", quiet=not distributed.current().is_main)


def _finish(loop: Loop, memory, chance: float) -> TrainResult:
    """Restore the epoch chosen on validation, check that every rank holds the same weights,
    score the test split, and (rank 0) write model.pt and list it."""
    world = distributed.current()
    model, splits, config, totals = loop.parts.model, loop.splits, loop.config, loop.totals
    if loop.best is not None:  # every later stage starts from the epoch chosen on validation
        model.load_state_dict(loop.best)
    digests = distributed.all_gather(weights_digest(model.state_dict()))
    if len(set(digests)) != 1:
        raise PipelineError(f"{loop.variant}: ranks ended with different weights; please "
                            "report this")
    last = loop.history[-1] if loop.history else {"loss": float("nan"), "train_accuracy": 0.0}
    best_record = next((h for h in loop.history if h["epoch"] == totals["best_epoch"]), last)
    on_cuda = loop.device.type == "cuda"
    result = TrainResult(
        variant=loop.variant, precision=loop.precision.name, device=str(loop.device),
        world_size=world.world_size, seconds=totals["seconds"],
        samples_per_second=totals["samples"] / totals["seconds"] if totals["seconds"] else 0.0,
        peak_memory_bytes=int(memory.peak) if on_cuda else 0,
        peak_memory_method=memory.method if on_cuda else "",
        test_accuracy=dataset_accuracy(model, splits.test, loop.device),
        val_accuracy=totals["best_val"], best_epoch=totals["best_epoch"],
        skipped_steps=totals["skipped"],
        optimizer_steps=loop.pos["global_step"] - totals["skipped"], final_loss=last["loss"],
        epochs=config.epochs, resumed_from=loop.resumed_from,
        epochs_run=len(loop.history), stopped=totals["stopped"],
        isa=isa() if not on_cuda else None,
        val_at_chance=_at_chance(best_record.get("train_accuracy", 0.0), totals["best_val"],
                                 chance, len(splits.val)),
        skipped_images=splits.skipped_images)
    if not world.is_main:
        return result
    if not on_cuda and getattr(config, "measure_memory", True):
        result.peak_memory_bytes, result.peak_memory_method = peak_memory_in_fresh_process(
            config, loop.precision)
    elif not on_cuda:
        result.peak_memory_method = "not measured (--no-measure-memory)"
    atomic_torch_save({"model_spec": loop.spec, "state_dict": cpu_state_dict(model)},
                      loop.folder / "model.pt")
    run = loop.run
    run.register(f"{loop.variant}/metrics", loop.folder / "metrics.jsonl", kind="metrics",
                 stage="train", parent=loop.variant)
    run.register(loop.variant, loop.folder / "model.pt", kind="model", stage="train",
                 config=asdict(config), format="pytorch", model_spec=loop.spec,
                 chosen=f"epoch {totals['best_epoch']}, best validation accuracy",
                 initial_weights={"file": getattr(config, "init_weights", None),
                                  "torchvision": getattr(config, "weights", None),
                                  "adapted": loop.parts.notes},
                 training=asdict(result) | {"weights_sha256_all_ranks": digests[0]},
                 checkpoint_bytes=run.entry(f"{loop.variant}/checkpoint-last")["bytes"])
    return result


def train_variant(variant: str, precision: Precision, splits: DataSplits, config, run: Run,
                  device, resume: bool = False, baseline_finite: bool = False,
                  budget: float | None = None) -> TrainResult:
    """Train one model (or continue it) and write checkpoints, metrics.jsonl and model.pt.
    It ends at --epochs, once validation accuracy has not improved for --patience epochs, or
    at the epochs that fit ``budget`` seconds at the pace measured so far."""
    loop = _start(variant, precision, splits, config, run, device, resume, baseline_finite)
    chance = _chance(splits.val)
    steps_per_epoch = len(loop.parts.loader)
    memory = PeakMemory(device) if device.type == "cuda" else contextlib.nullcontext()
    with memory:
        while loop.pos["epoch"] <= loop.planned_epochs and not loop.totals["stopped"]:
            epoch = loop.pos["epoch"]
            started = time.perf_counter()
            if loop.pos["step_in_epoch"] < steps_per_epoch:  # not resumed at its very end
                seen = _train_epoch(loop, epoch)
                loop.totals["wall"] += time.perf_counter() - started
                loop.totals["stopped"] = planned_end(loop, epoch, budget)
                started = time.perf_counter()
                _end_epoch(loop, epoch, seen, chance)
                loop.totals["wall"] += time.perf_counter() - started  # scoring, checkpoints
            loop.pos.update(epoch=epoch + 1, step_in_epoch=0)
    return _finish(loop, memory, chance)


def planned_end(loop: Loop, epoch: int, budget: float | None) -> str:
    """After ``epoch``'s steps (before its checkpoint, which then holds the plan): why
    training ends with this epoch, or "" to go on. Under a budget the epochs that fit at the
    pace so far (steps, scoring and checkpoints) are planned again, and the schedule's cosine
    is cut to end with them: never past --epochs, never before the epochs done, never longer
    than planned before (a schedule stretched again would raise the learning rate)."""
    config, totals = loop.config, loop.totals
    planned = loop.planned_epochs
    if budget is not None:
        fits = max(epoch, min(config.epochs, int(budget * epoch / max(totals["wall"], 1e-9))))
        fits = distributed.broadcast(fits)  # ranks timed apart must still stop together
        if fits < planned:
            planned = totals["planned_epochs"] = fits
            loop.parts.scheduler.lr_lambdas[0].total_steps = fits * len(loop.parts.loader)
            say(f"{loop.variant}: --time {budget:.0f}s for this model fits {fits} of "
                f"{config.epochs} epochs at {totals['wall'] / epoch:.1f} s each; the "
                "learning-rate schedule ends with them", quiet=loop.quiet)
    if epoch < planned:
        return ""
    if planned < config.epochs:
        return (f"time: {planned} epoch{'s' * (planned != 1)} fit --time ({budget:.0f} s for "
                "this model)")
    return f"epochs: all {config.epochs} of --epochs ran"


def preflight(config) -> None:
    """What can be refused before a run exists: a model that does not import or cannot take
    the data at this size, and starting weights that are not weights or do not fit."""
    device = resolve_device(config.device)
    classes, channels, held = expected_shape(config)
    check_model_fits(config.model, classes, channels, config.image_size, config.batch_size,
                     device, held)
    if config.init_weights or config.weights:
        initial_weights(config, build_model(config.model, classes, channels, config.image_size))


def run(config, run: Run, resume: bool = False) -> list[TrainResult]:
    """Train `amp` and, unless config.baseline is off, the `fp32` baseline beside it.

    With ``resume``, a variant whose model.pt is listed is done; the others continue from their
    newest good checkpoint, or start afresh where they have none. A resumed run keeps the
    precision it was started with, whatever the machine it resumes on.
    """
    import torch

    device = resolve_device(config.device)
    world = distributed.current()
    if world.active and device.type == "cuda":
        device = torch.device("cuda", world.local_rank)
    saved = run.recorded_config("train") if resume else {}
    precision = Precision(saved["resolved_precision"]) if "resolved_precision" in saved \
        else resolve_precision(config.precision, device)
    cap_isa_for_bf16_training(precision.name, device.type)
    note = auto_precision_note(precision, config.precision, device)
    if note:
        say(note, quiet=config.quiet or not world.is_main)
    classes, channels, held = expected_shape(config)
    check_model_fits(config.model, classes, channels, config.image_size, config.batch_size,
                     device, held)
    splits = load_splits(config)
    asked = config
    config = replace(config, lr=_peak_lr(config, splits, precision, device, run, saved))
    if world.is_main:
        run.record_config("train", asdict(asked) | {"resolved_precision": precision.name,
                                                    "resolved_device": str(device),
                                                    "world_size": world.world_size,
                                                    "resolved_lr": config.lr})
        record_preprocessing(run, splits, config.dataset, "train")
    # Where autocast resolves to fp32, `amp` is the baseline's computation step for step (same
    # seed, data order and hyperparameters): it is trained once and fp32 is listed as its copy.
    baseline_is_amp = config.baseline and precision.name == "fp32"
    trained_baseline = config.baseline and not baseline_is_amp
    variants = ([("fp32", Precision("fp32"))] if trained_baseline else []) + [("amp", precision)]
    results = []
    # --time is shared by the models still to train, not spent twice.
    to_train = [name for name, _ in variants if not (resume and name in run.artifacts())]
    budget = config.time / max(1, len(to_train)) if config.time else None
    deterministic_before = torch.are_deterministic_algorithms_enabled()
    set_deterministic(config.deterministic or deterministic_before, device)
    try:
        for name, prec in variants:
            if resume and name in run.artifacts():
                saved_result = run.entry(name)["training"]
                results.append(TrainResult(**{f: saved_result.get(f)
                                              for f in TrainResult.__dataclass_fields__}))
                say(f"{name}: already finished", quiet=config.quiet)
                continue
            baseline_finite = any(r.variant == "fp32" for r in results)
            results.append(train_variant(name, prec, splits, config, run, device, resume,
                                         baseline_finite, budget))
    finally:  # later stages in the same chain may use ops with no deterministic kernel
        torch.use_deterministic_algorithms(deterministic_before)
    if baseline_is_amp:
        results.insert(0, _baseline_from_amp(results[-1], run, config, world.is_main))
    for result in results:
        say(f"trained {result.variant} ({result.precision}): test accuracy "
            f"{result.test_accuracy:.4f} (epoch {result.best_epoch}, chosen on validation; "
            f"stopped: {result.stopped or 'resumed at its end'}), "
            f"{result.samples_per_second:.0f} samples/s, {result.skipped_steps} skipped steps",
            quiet=not world.is_main)
    return results


def _peak_lr(config, splits: DataSplits, precision: Precision, device, run: Run,
             saved: dict) -> float:
    """--lr as given, or found by a range test (stages/training/lr_range.py) under the
    precision and batch size training will use, once per run: a resume reads the value back.
    The curve is kept in the run (train/lr-range.json) for the report."""
    if config.lr != "auto":
        return config.lr
    if "resolved_lr" in saved:
        return saved["resolved_lr"]
    say(f"--lr auto: a learning-rate range test of up to {lr_range.MAX_STEPS} steps "
        f"({lr_range.START_LR:g} to {lr_range.END_LR:g}) ...", quiet=config.quiet)
    curve = lr_range.range_test(config, splits, precision, device)
    if distributed.current().is_main:
        path = run.root / "train" / "lr-range.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(curve) + "\n")
        run.register("lr-range", path, kind="metrics", stage="train")
    say(f"--lr auto: {curve['chosen']:.3g} (steepest descent at {curve['steepest']:.3g}, "
        f"lowest loss at {curve['minimum']:.3g}, {curve['steps']} steps)", quiet=config.quiet)
    return curve["chosen"]


def _baseline_from_amp(amp: TrainResult, run: Run, config, is_main: bool) -> TrainResult:
    """`fp32` as a copy of an `amp` model that trained in fp32: the file the run-folder contract
    promises, listed with the amp run's figures and marked as the same run."""
    result = TrainResult(**(asdict(amp) | {"variant": "fp32"}))
    if not is_main:
        return result
    listed = run.artifacts().get("fp32")
    if listed and listed.get("training", {}).get("same_run_as") != "amp":
        return result  # a baseline trained on its own before (a resumed older run): keep it
    folder = run.root / "train" / "fp32"
    folder.mkdir(parents=True, exist_ok=True)
    source = run.entry("amp")
    path = folder / "model.pt"
    with open(run.verified_path("amp"), "rb") as trained:
        atomic_write(path, lambda out: shutil.copyfileobj(trained, out))
    run.register("fp32", path, kind="model", stage="train", config=asdict(config),
                 format="pytorch", model_spec=source["model_spec"], chosen=source["chosen"],
                 initial_weights=source["initial_weights"],
                 training=source["training"] | {"variant": "fp32", "same_run_as": "amp"},
                 checkpoint_bytes=source["checkpoint_bytes"])
    say("fp32: the same run as amp (autocast resolved to fp32), not trained twice; "
        f"copied to {path}", quiet=config.quiet)
    return result


# ---------------------------------------------------------------- memory, in a fresh process


def peak_memory_in_fresh_process(config, precision: Precision) -> tuple[int, str]:
    """Peak growth of resident memory over a few training steps, each model in a process of
    its own: measured inside one process, the second model would inherit the first one's
    warm heap and look smaller than it is."""
    probe = json.dumps({"config": asdict(config), "precision": precision.name})
    # glibc raises its mmap threshold as a process frees large blocks, after which freed
    # activations stay in the heap and count as resident: two probes of one model differed by
    # up to 25%. A fixed threshold returns every large block on free, so RSS follows the live
    # tensors and repeated probes mostly agreed within 0.1% on the AMD EPYC (once 14% apart, in a
    # CI run).
    env = os.environ | {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
    proc = subprocess.run([sys.executable, "-m", "stages.train", "--memory-probe", probe],
                          capture_output=True, text=True, timeout=900, env=env)
    if proc.returncode != 0:
        say(f"warning: the memory probe failed ({proc.stderr.strip()[-300:]}); no memory figure")
        return 0, "not measured (the probe failed)"
    peak = json.loads(proc.stdout.strip().splitlines()[-1])["peak"]
    return peak, (f"peak growth of resident memory (RSS) over {MEMORY_PROBE_STEPS} training "
                  "steps, measured in a fresh process for each model with glibc's mmap "
                  "threshold fixed, so that freed tensors leave resident memory")


def _memory_probe(argument: str) -> None:
    from types import SimpleNamespace

    import torch

    probe = json.loads(argument)
    config = SimpleNamespace(**probe["config"])
    precision = Precision(probe["precision"])
    device = torch.device("cpu")
    splits = load_splits(config)
    parts = build_parts(config, splits, precision, device)
    parts.trained.train()
    parts.sampler.set_epoch(1)
    batches = iter(parts.loader)
    sums = DeviceSums(device)
    with PeakMemory(device) as memory:
        for step, (images, labels) in zip(range(MEMORY_PROBE_STEPS), batches):
            train_step(parts, precision, device, config, images, labels, sums, step)
    print(json.dumps({"peak": int(memory.peak)}))


if __name__ == "__main__" and sys.argv[1:2] == ["--memory-probe"]:
    _memory_probe(sys.argv[2])
