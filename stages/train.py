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
from dataclasses import asdict, dataclass
from pathlib import Path

from stages.shared import distributed, signals
from stages.shared.artifacts import (
    Run,
    atomic_torch_save,
    atomic_write,
    atomic_write_text,
    remove_stale_temporaries,
)
from stages.shared.checkpoints import (
    Checkpointer,
    best_weights,
    cpu_state_dict,
    newest_good_checkpoint,
    restore_rng,
    rng_state,
    weights_digest,
)
from stages.shared.data import DataSplits, EpochSampler, expected_shape, load_splits, make_loader
from stages.shared.errors import PipelineError
from stages.shared.evaluate import dataset_accuracy
from stages.shared.machine import isa
from stages.shared.memory import PeakMemory
from stages.shared.models import build_model, check_model_fits, model_spec
from stages.shared.precision import (
    Precision,
    auto_precision_note,
    autocast,
    cap_isa_for_bf16_training,
    grad_scaler,
    resolve_device,
    resolve_precision,
    seed_everything,
    set_deterministic,
)
from stages.shared.progress import progress, say
from stages.shared.weights import initial_weights

LOG_EVERY_CUDA = 50
MEMORY_PROBE_STEPS = 8


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


def _lr_lambda(total_steps: int, warmup_steps: int):
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        done = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, done)))

    return factor


@dataclass
class Parts:
    """What one model's training is made of; built the same way for a run and for the
    memory probe."""

    model: object
    trained: object  # the model, or its DistributedDataParallel wrapper
    optimizer: object
    scheduler: object
    scaler: object
    criterion: object
    sampler: EpochSampler
    loader: object
    notes: list[str]  # what loading --init-weights/--weights adapted


def build_parts(config, splits: DataSplits, precision: Precision, device) -> Parts:
    import torch

    world = distributed.current()
    seed_everything(config.seed)
    model = build_model(config.model, splits.num_classes, splits.in_channels, splits.image_size)
    notes = initial_weights(config, model)
    model = model.to(device)
    if device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    trained = model
    if world.active:
        trained = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    sampler = EpochSampler(len(splits.train), config.seed, world.rank, world.world_size)
    loader = make_loader(splits.train, config.batch_size, sampler, config.workers,
                         pin_memory=device.type == "cuda",
                         timeout=getattr(config, "loader_timeout", 0) if config.workers else 0)
    # Fused SGD lets GradScaler skip a step on the GPU without asking the host first.
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=0.9, nesterov=True,
                                weight_decay=config.weight_decay,
                                fused=True if device.type == "cuda" else None)
    total_steps = config.epochs * len(loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, _lr_lambda(total_steps, min(len(loader), max(total_steps // 10, 1))))
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=config.label_smoothing)
    return Parts(model, trained, optimizer, scheduler, grad_scaler(precision, device), criterion,
                 sampler, loader, notes)


class DeviceSums:
    """Running sums of one epoch and the health of the steps, kept as tensors on the device."""

    def __init__(self, device, in_a_row=None) -> None:
        import torch

        zero = lambda dtype=torch.float64: torch.zeros((), dtype=dtype, device=device)  # noqa
        self.loss, self.correct, self.seen = zero(), zero(torch.int64), zero(torch.int64)
        # Skips in a row carry over from the previous sums: a run of them may span a check.
        self.skipped = zero(torch.int64)
        self.in_a_row = zero(torch.int64) if in_a_row is None else in_a_row
        self.longest_run = self.in_a_row.clone()
        self.first_bad = torch.full((), -1, dtype=torch.int64, device=device)

    def add(self, loss, logits, labels, global_step: int, skipped) -> None:
        import torch

        loss = loss.detach()
        bad = ~torch.isfinite(loss)
        self.first_bad = torch.where(bad & (self.first_bad < 0), global_step, self.first_bad)
        self.loss += torch.where(bad, 0.0, loss.double()) * len(labels)
        self.correct += (logits.detach().argmax(1) == labels).sum()
        self.seen += len(labels)
        if skipped is not None:
            self.skipped += skipped
            self.in_a_row = (self.in_a_row + 1) * skipped
            self.longest_run = torch.maximum(self.longest_run, self.in_a_row)

    def read(self) -> dict:
        """The host's view, once: one transfer of a few numbers, summed over ranks."""
        import torch

        values = torch.stack([self.loss, self.correct.double(), self.seen.double(),
                              self.skipped.double(), self.longest_run.double(),
                              self.first_bad.double()])
        loss, correct, seen, skipped, longest, first_bad = distributed.reduce_health(values)
        return {"loss": loss, "correct": int(correct), "seen": int(seen),
                "skipped": int(skipped), "longest_run": int(longest), "first_bad": int(first_bad)}


def train_step(parts: Parts, precision: Precision, device, config, images, labels, sums,
               global_step: int) -> None:
    import torch

    images = images.to(device, non_blocking=True)
    labels = labels.to(device, non_blocking=True)
    if device.type == "cuda":
        images = images.contiguous(memory_format=torch.channels_last)
    with autocast(precision, device):
        logits = parts.trained(images)
    loss = parts.criterion(logits.float(), labels)
    parts.optimizer.zero_grad(set_to_none=True)
    scaler = parts.scaler
    scaler.scale(loss).backward()
    if config.grad_clip:
        scaler.unscale_(parts.optimizer)  # clip the true gradients, not the scaled ones
        torch.nn.utils.clip_grad_norm_(parts.model.parameters(), config.grad_clip)
    # The scale as a device tensor (no host sync, unlike get_scale()): it backs off exactly
    # when GradScaler found inf/NaN gradients and skipped the step.
    before = scaler._get_scale_async().clone() if scaler.is_enabled() else None
    scaler.step(parts.optimizer)
    scaler.update()
    skipped = None if before is None else (scaler._get_scale_async() < before).long()
    parts.scheduler.step()
    sums.add(loss, logits, labels, global_step, skipped)


def _stop_workers(data_iterator) -> None:
    """Shut a failed loader's workers down with SIGCHLD held back, so that the death of a
    worker cannot raise a second error while the first is being reported."""
    import signal

    with signals.deferred(signal.SIGCHLD):
        try:
            data_iterator._shutdown_workers()  # what its __del__ would do; unregisters the pids
        except Exception:  # the workers are already gone; nothing more to clean up
            pass


@contextlib.contextmanager
def _worker_failures(variant: str, epoch: int, pos: dict, folder: Path, data_iterator):
    """A DataLoader worker that dies or goes silent becomes one clear error. The death is
    reported by a SIGCHLD handler, so it can surface anywhere in the epoch, not only where the
    next batch is fetched; checkpoints already written stay as they are."""
    try:
        yield
    except (RuntimeError, ConnectionError, EOFError) as exc:
        # A worker killed while it hands over a batch breaks the pipe instead (ConnectionError).
        text = str(exc) or type(exc).__name__
        if isinstance(exc, RuntimeError) and not any(
                marker in text for marker in ("DataLoader worker", "DataLoader timed out")):
            raise
        if hasattr(data_iterator, "_shutdown_workers"):
            _stop_workers(data_iterator)
        raise PipelineError(
            f"{variant}: a DataLoader worker died or hung at epoch {epoch} step "
            f"{pos['step_in_epoch'] + 1} ({text.splitlines()[0][:160]}); checkpoints in "
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


BATCHNORM_BATCHES = 100  # at most this many training batches recompute BatchNorm statistics


def recompute_batchnorm(model, dataset, batch_size: int, device) -> None:
    """Set every BatchNorm's running statistics to the plain average over (up to 100 batches
    of) the unaugmented training images, before the model is evaluated.

    Running averages with a small momentum need many steps to forget their initial values:
    torchvision's MobileNetV3 uses 0.01, and after 210 steps (10 epochs of the digits) 12% of
    the initial variance of 1 was left against true variances of 1e-4 to 0.04, so evaluation
    collapsed to one class (9.72% validation accuracy) while training reached 99%. Only the
    BatchNorm layers change mode: dropout stays off and draws no random numbers, so a resumed
    run stays bit-identical."""
    import torch
    from torch import nn

    layers = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
              and m.track_running_stats]
    if not layers:
        return
    was_training = model.training
    model.eval()
    momenta = [layer.momentum for layer in layers]
    for layer in layers:
        layer.reset_running_stats()
        layer.momentum = None  # a cumulative average over the batches below
        layer.train()
    with torch.no_grad():
        for i, (images, _) in enumerate(make_loader(dataset, batch_size)):
            if i == BATCHNORM_BATCHES:
                break
            model(images.to(device))
    for layer, momentum in zip(layers, momenta):
        layer.momentum = momentum
    model.train(was_training)


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


def train_variant(variant: str, precision: Precision, splits: DataSplits, config, run: Run,
                  device, resume: bool = False, baseline_finite: bool = False) -> TrainResult:
    """Train one model (or continue it) and write checkpoints, metrics.jsonl and model.pt."""
    import torch

    world = distributed.current()
    folder = run.root / "train" / variant
    if world.is_main:
        folder.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(folder)
    spec = model_spec(config.model, splits.num_classes, splits.in_channels, splits.image_size)
    parts = build_parts(config, splits, precision, device)
    model, loader = parts.model, parts.loader
    for note in parts.notes:
        say(f"{variant}: initial weights: {note}", quiet=config.quiet or not world.is_main)
    steps_per_epoch = len(loader)
    checkpointer = Checkpointer(run, variant, folder, config.keep_checkpoints, asdict(config))
    chance = _chance(splits.val)
    check_every = 1 if device.type == "cpu" else LOG_EVERY_CUDA

    # Everything below is saved in each checkpoint and restored on resume.
    pos = {"epoch": 1, "step_in_epoch": 0, "global_step": 0}
    sums = {"loss": 0.0, "correct": 0, "seen": 0}
    totals = {"skipped": 0, "seconds": 0.0, "samples": 0, "best_val": -1.0, "best_epoch": 0}
    history: list[dict] = []
    resumed_from, best = None, None
    if resume:
        found = newest_good_checkpoint(run, variant)
        if found:
            resumed_from, state = found
            model.load_state_dict(state["model"])
            parts.optimizer.load_state_dict(state["optimizer"])
            parts.scheduler.load_state_dict(state["scheduler"])
            parts.scaler.load_state_dict(state["scaler"])
            pos, sums, totals = state["position"], state["sums"], totals | state["totals"]
            history = state["history"]
            best = best_weights(run, variant)
            restore_rng(state["rng"])
            say(f"{variant}: resuming from {resumed_from} (epoch {pos['epoch']}, step "
                f"{pos['step_in_epoch']}/{steps_per_epoch})", quiet=not world.is_main)

    def state_now() -> dict:
        return {"model": model.state_dict(), "optimizer": parts.optimizer.state_dict(),
                "scheduler": parts.scheduler.state_dict(), "scaler": parts.scaler.state_dict(),
                "position": dict(pos), "sums": dict(sums), "totals": dict(totals),
                "history": list(history), "rng": rng_state(), "variant": variant,
                "precision": precision.name, "model_spec": spec, "config": asdict(config)}

    def check(device_sums: DeviceSums, epoch: int, epoch_start: int) -> dict:
        """Fold the device's sums into the host's; stop on a NaN loss or too many skips."""
        seen = device_sums.read()
        if seen["first_bad"] >= 0:
            raise PipelineError(_nan_message(variant, precision, device, epoch,
                                             seen["first_bad"] - epoch_start + 1, folder,
                                             baseline_finite))
        if seen["longest_run"] > config.max_skipped_steps:
            raise PipelineError(
                f"{variant}: GradScaler skipped {seen['longest_run']} optimizer steps in a row "
                f"(inf/NaN gradients) up to epoch {epoch} step {pos['step_in_epoch']}; lower "
                "--lr, add --grad-clip or use --precision bf16")
        return seen

    in_a_row = None
    memory = PeakMemory(device) if device.type == "cuda" else contextlib.nullcontext()
    with memory:
        while pos["epoch"] <= config.epochs:
            epoch = pos["epoch"]
            if pos["step_in_epoch"] >= steps_per_epoch:  # resumed at an epoch boundary
                pos.update(epoch=epoch + 1, step_in_epoch=0)
                continue
            parts.trained.train()
            parts.sampler.set_epoch(epoch, start=pos["step_in_epoch"] * config.batch_size)
            data_iterator = iter(loader)
            bar = progress(data_iterator, desc=f"{variant} {epoch}/{config.epochs}",
                           quiet=config.quiet or not world.is_main, total=len(loader))
            device_sums = DeviceSums(device, in_a_row)
            epoch_start = pos["global_step"] - pos["step_in_epoch"]
            started = time.perf_counter()
            with _worker_failures(variant, epoch, pos, folder, data_iterator):
                for images, labels in bar:
                    train_step(parts, precision, device, config, images, labels, device_sums,
                               pos["global_step"])
                    pos["step_in_epoch"] += 1
                    pos["global_step"] += 1
                    every = config.checkpoint_every
                    checkpoint_now = (every and pos["global_step"] % every == 0
                                      and pos["step_in_epoch"] < steps_per_epoch)
                    if pos["step_in_epoch"] % check_every and not checkpoint_now:
                        continue
                    seen = check(device_sums, epoch, epoch_start)
                    shown = {k: sums[k] + seen[k] for k in ("loss", "correct", "seen")}
                    if hasattr(bar, "set_postfix") and shown["seen"]:
                        bar.set_postfix(loss=f"{shown['loss'] / shown['seen']:.3f}",
                                        acc=f"{shown['correct'] / shown['seen']:.3f}",
                                        refresh=False)
                    if checkpoint_now:
                        # A checkpoint holds host numbers: fold the device's sums in first.
                        totals["seconds"] += time.perf_counter() - started
                        totals["skipped"] += seen["skipped"]
                        sums = shown
                        device_sums = DeviceSums(device, device_sums.in_a_row)
                        distributed.sync_buffers(model)
                        if world.is_main:
                            checkpointer.save(state_now(), best=False)
                        started = time.perf_counter()
            seen = check(device_sums, epoch, epoch_start)
            in_a_row = device_sums.in_a_row
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            totals["seconds"] += time.perf_counter() - started
            totals["skipped"] += seen["skipped"]
            loss_sum, correct, count = (sums[k] + seen[k] for k in ("loss", "correct", "seen"))
            totals["samples"] += count
            recompute_batchnorm(model, splits.calibration, config.batch_size, device)
            distributed.sync_buffers(model)
            val_acc = dataset_accuracy(model, splits.val, device)
            record = {"epoch": epoch, "loss": loss_sum / count, "train_accuracy": correct / count,
                      "val_accuracy": val_acc, "lr": parts.scheduler.get_last_lr()[0],
                      "seconds": totals["seconds"], "samples_per_second":
                      totals["samples"] / totals["seconds"], "skipped_steps": totals["skipped"],
                      "skipped_images": splits.skipped_images}
            history.append(record)
            improved = val_acc > totals["best_val"]
            if improved:
                totals.update(best_val=val_acc, best_epoch=epoch)
                best = cpu_state_dict(model, clone=True)
            sums = {"loss": 0.0, "correct": 0, "seen": 0}
            if world.is_main:
                atomic_write_text(folder / "metrics.jsonl",
                                  "".join(json.dumps(h) + "\n" for h in history))
                checkpointer.save(state_now(), best=improved)
            say(f"{variant} epoch {epoch}/{config.epochs}: loss {record['loss']:.4f} "
                f"train acc {record['train_accuracy']:.3f} val acc {val_acc:.3f}",
                quiet=config.quiet or not world.is_main)
            if _at_chance(record["train_accuracy"], val_acc, chance, len(splits.val)):
                say(f"WARNING: {variant} learns the training images "
                    f"({record['train_accuracy']:.1%}) but its validation accuracy is at chance "
                    f"({val_acc:.1%}): it does not generalise to held-out images; check the "
                    "data (labels, a train/validation mix-up) and any layer that behaves "
                    "differently in evaluation", quiet=not world.is_main)
            pos.update(epoch=epoch + 1, step_in_epoch=0)

    if best is not None:  # every later stage starts from the epoch chosen on validation
        model.load_state_dict(best)
    digests = distributed.all_gather(weights_digest(model.state_dict()))
    if len(set(digests)) != 1:
        raise PipelineError(f"{variant}: ranks ended with different weights; please report this")
    test_acc = dataset_accuracy(model, splits.test, device)
    last = history[-1] if history else {"loss": float("nan"), "train_accuracy": 0.0}
    best_record = next((h for h in history if h["epoch"] == totals["best_epoch"]), last)
    result = TrainResult(
        variant=variant, precision=precision.name, device=str(device),
        world_size=world.world_size, seconds=totals["seconds"],
        samples_per_second=totals["samples"] / totals["seconds"] if totals["seconds"] else 0.0,
        peak_memory_bytes=int(memory.peak) if device.type == "cuda" else 0,
        peak_memory_method=memory.method if device.type == "cuda" else "",
        test_accuracy=test_acc, val_accuracy=totals["best_val"], best_epoch=totals["best_epoch"],
        skipped_steps=totals["skipped"], optimizer_steps=pos["global_step"] - totals["skipped"],
        final_loss=last["loss"], epochs=config.epochs, resumed_from=resumed_from,
        isa=isa() if device.type == "cpu" else None,
        val_at_chance=_at_chance(best_record.get("train_accuracy", 0.0), totals["best_val"],
                                 chance, len(splits.val)),
        skipped_images=splits.skipped_images)
    if world.is_main:
        if device.type == "cpu" and getattr(config, "measure_memory", True):
            result.peak_memory_bytes, result.peak_memory_method = peak_memory_in_fresh_process(
                config, precision)
        elif device.type == "cpu":
            result.peak_memory_method = "not measured (--no-measure-memory)"
        atomic_torch_save({"model_spec": spec, "state_dict": cpu_state_dict(model)},
                          folder / "model.pt")
        run.register(f"{variant}/metrics", folder / "metrics.jsonl", kind="metrics",
                     stage="train", parent=variant)
        run.register(variant, folder / "model.pt", kind="model", stage="train",
                     config=asdict(config), format="pytorch", model_spec=spec,
                     chosen=f"epoch {totals['best_epoch']}, best validation accuracy",
                     initial_weights={"file": getattr(config, "init_weights", None),
                                      "torchvision": getattr(config, "weights", None),
                                      "adapted": parts.notes},
                     training=asdict(result) | {"weights_sha256_all_ranks": digests[0]},
                     checkpoint_bytes=run.entry(f"{variant}/checkpoint-last")["bytes"])
    return result


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
    if world.is_main:
        run.record_config("train", asdict(config) | {"resolved_precision": precision.name,
                                                     "resolved_device": str(device),
                                                     "world_size": world.world_size})
    # Where autocast resolves to fp32, `amp` is the baseline's computation step for step (same
    # seed, data order and hyperparameters): it is trained once and fp32 is listed as its copy.
    baseline_is_amp = config.baseline and precision.name == "fp32"
    trained_baseline = config.baseline and not baseline_is_amp
    variants = ([("fp32", Precision("fp32"))] if trained_baseline else []) + [("amp", precision)]
    results = []
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
                                         baseline_finite))
    finally:  # later stages in the same chain may use ops with no deterministic kernel
        torch.use_deterministic_algorithms(deterministic_before)
    if baseline_is_amp:
        results.insert(0, _baseline_from_amp(results[-1], run, config, world.is_main))
    for result in results:
        say(f"trained {result.variant} ({result.precision}): test accuracy "
            f"{result.test_accuracy:.4f} (epoch {result.best_epoch}, chosen on validation), "
            f"{result.samples_per_second:.0f} samples/s, {result.skipped_steps} skipped steps",
            quiet=not world.is_main)
    return results


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
    # tensors and repeated probes agreed within 0.1% on the AMD EPYC.
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
