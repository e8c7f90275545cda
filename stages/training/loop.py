"""The one training loop, which the train and qat stages both drive: its parts (the model,
optimizer, LR schedule, GradScaler and loader built one way), one optimizer step under
autocast, running sums kept on the device, and `fit`: the epochs from where a model stands to
its last, keeping the last epoch's weights unless an earlier one was better on validation
beyond noise (stages/training/choice.py).

What differs between the stages comes in as Hooks: train adds checkpoints, resume, its --time
plan and --patience; qat its freezes of BatchNorm statistics and observers, its --tuning-time
plan and its divergence check.

The sums stay on the device, read only at check points (every step on the CPU, where reading
is free; every LOG_EVERY_CUDA steps on a GPU), so that a GPU does not wait for the host.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, ContextManager

from stages.data.datasets import DataSplits
from stages.data.loaders import EpochSampler, make_loader
from stages.measure.evaluate import hit_share
from stages.models.build import build_model
from stages.models.weights import initial_weights, starting_weights
from stages.run.checkpoints import cpu_state_dict, restore_rng, rng_state
from stages.run.progress import progress
from stages.training import choice, distributed
from stages.training.layout import layout_that_runs
from stages.training.precision import Precision, autocast, grad_scaler, seed_everything
from stages.training.schedule import WARMUP_EPOCHS, CosineSchedule

LOG_EVERY_CUDA = 50


def decay_groups(model, weight_decay: float) -> list[dict]:
    """Parameter groups with weight decay on weight matrices and kernels alone: decaying
    BatchNorm's scales and shifts and the biases pulls them toward zero for no regularising
    gain, which depthwise stacks (a BatchNorm after every convolution) feel most."""
    decayed, exempt = [], []
    for parameter in model.parameters():
        if parameter.requires_grad:
            (exempt if parameter.ndim <= 1 else decayed).append(parameter)
    return [{"params": decayed, "weight_decay": weight_decay},
            {"params": exempt, "weight_decay": 0.0}]


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
    memory_format: str = "NCHW"  # the batches' layout, the model's: training/layout.py

    @property
    def steps_per_epoch(self) -> int:  # whole: len(loader) is what a resumed epoch has left
        return -(-self.sampler.epoch_size // self.loader.batch_size)


def build_parts(config, splits: DataSplits, precision: Precision, device) -> Parts:
    import torch

    world = distributed.current()
    seed_everything(config.seed)
    model = build_model(config.model, splits.num_classes, splits.in_channels, splits.image_size)
    notes = initial_weights(config, model)
    model = model.to(device)
    memory_format = layout_that_runs(model, splits, device)
    trained = model
    if world.active:
        trained = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    sampler = EpochSampler(len(splits.train), config.seed, world.rank, world.world_size,
                           config.batch_size)
    loader = make_loader(splits.train, config.batch_size, sampler, config.workers,
                         pin_memory=device.type == "cuda",
                         timeout=config.loader_timeout if config.workers else 0)
    # Fused SGD lets GradScaler skip a step on the GPU without asking the host first.
    optimizer = torch.optim.SGD(decay_groups(model, config.weight_decay), lr=config.lr,
                                momentum=0.9, nesterov=True,
                                fused=True if device.type == "cuda" else None)
    total_steps = config.epochs * len(loader)
    warmup = min(WARMUP_EPOCHS * len(loader), max(total_steps // 10, 1))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, CosineSchedule(total_steps, warmup))
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=config.label_smoothing)
    return Parts(model, trained, optimizer, scheduler, grad_scaler(precision, device), criterion,
                 sampler, loader, notes, memory_format)


def recipe(config, splits: DataSplits) -> dict:
    """How build_parts trains: config.json's `recipe`, shown in the report's training section."""
    return {"optimizer": "SGD with Nesterov momentum 0.9", "batch_size": config.batch_size,
            "weight_decay": config.weight_decay,
            "weight_decay_on": "weights and kernels (not BatchNorm or biases)",
            "schedule": f"linear warm-up over a tenth of the steps (at most {WARMUP_EPOCHS} "
                        "epochs), then a cosine to zero",
            "label_smoothing": config.label_smoothing, "augmentation": splits.augmentation,
            "weight_averaging": "none", "initialisation": starting_weights(config, splits)}


@dataclass
class Seen:
    """The steps since the sums were last read, as the host sees them, summed over ranks."""

    loss: float  # summed over the images (a non-finite loss counts 0)
    correct: int
    seen: int  # images
    skipped: int  # optimizer steps GradScaler skipped
    longest_run: int  # of skipped steps in a row, a run carried over from earlier reads
    first_bad: int  # the first global step whose loss was not finite; -1: none


@dataclass
class Position:
    """Where a model's training stands; a checkpoint saves it and a resume starts from it."""

    epoch: int = 1
    step_in_epoch: int = 0
    global_step: int = 0


@dataclass
class EpochSums:
    """The epoch's sums already on the host: a checkpoint inside an epoch folds them in."""

    loss: float = 0.0
    correct: int = 0
    seen: int = 0


@dataclass
class Totals:
    """What one model's training has come to so far."""
    skipped: int = 0  # optimizer steps GradScaler skipped
    seconds: float = 0.0  # in optimizer steps
    samples: int = 0  # images trained on
    best_val: float = -1.0  # the best validation accuracy, and its epoch
    best_epoch: int = 0
    chosen_epoch: int = 0  # the epoch whose weights the model keeps (choice.keep_best)
    chosen: str = ""  # why that epoch, in words
    wall: float = 0.0  # steps, scoring and checkpoints: the pace a time plan reads
    planned_epochs: int | None = None  # where a time plan cut the epochs
    stopped: str = ""  # why training ended (epochs, time, plateau); "": it goes on
    plateau: str = ""  # where a plateau cut the schedule short (plans.anneal_on_plateau)
    budget: float | None = None  # --time seconds given when it started: a resume keeps them


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

    def read(self) -> Seen:
        """The host's view, once: one transfer of a few numbers, summed over ranks."""
        import torch

        values = torch.stack([self.loss, self.correct.double(), self.seen.double(),
                              self.skipped.double(), self.longest_run.double(),
                              self.first_bad.double()])
        loss, correct, seen, skipped, longest, first_bad = distributed.reduce_health(values)
        return Seen(loss, int(correct), int(seen), int(skipped), int(longest), int(first_bad))


def train_step(parts: Parts, precision: Precision, device, grad_clip: float, images, labels,
               sums, global_step: int) -> None:
    import torch

    images = images.to(device, non_blocking=True)
    labels = labels.to(device, non_blocking=True)
    if parts.memory_format == "channels_last":
        images = images.contiguous(memory_format=torch.channels_last)
    with autocast(precision, device):
        logits = parts.trained(images)
    loss = parts.criterion(logits.float(), labels)
    parts.optimizer.zero_grad(set_to_none=True)
    scaler = parts.scaler
    scaler.scale(loss).backward()
    if grad_clip:
        scaler.unscale_(parts.optimizer)  # clip the true gradients, not the scaled ones
        torch.nn.utils.clip_grad_norm_(parts.model.parameters(), grad_clip)
    # The scale as a device tensor (no host sync, unlike get_scale()): it backs off exactly
    # when GradScaler found inf/NaN gradients and skipped the step.
    before = scaler._get_scale_async().clone() if scaler.is_enabled() else None
    scaler.step(parts.optimizer)
    scaler.update()
    skipped = None if before is None else (scaler._get_scale_async() < before).long()
    parts.scheduler.step()
    sums.add(loss, logits, labels, global_step, skipped)


@dataclass
class Hooks:
    """What the stage driving the loop adds to it, called in this order each epoch: start_epoch
    (the model just put in training mode), guard around the steps, check at each read of the
    sums, checkpoint where --checkpoint-every falls in the epoch, score, end_epoch last."""

    # The model's hits on the validation images after an epoch (a bool tensor, one per image).
    score: Callable[[int], object]
    # The steps read, the epoch and the global step it began at: raise where they went wrong.
    check: Callable[[Seen, int, int], None]
    # The epoch, its record (already in the history), whether it improved: add the stage's
    # fields to the record, plan the epochs left, write, say.
    end_epoch: Callable[[int, dict, bool], None]
    start_epoch: Callable[[int], None] = lambda epoch: None
    # The epoch and the loader's iterator -> a context manager around the epoch's steps.
    guard: Callable[[int, object], ContextManager] = (
        lambda epoch, data_iterator: contextlib.nullcontext())
    checkpoint: Callable[[], None] = lambda: None


@dataclass
class Loop:
    """One model's training: its parts, and where it stands (position, running sums, totals,
    history, the best epoch's weights): what a checkpoint saves and a resume restores."""

    name: str  # in progress bars: the variant, or qat
    parts: Parts
    precision: Precision
    device: object
    epochs: int  # as asked; a time plan may cut them (totals.planned_epochs)
    batch_size: int
    grad_clip: float = 0.0
    checkpoint_every: int = 0  # steps; 0: at epoch ends only
    quiet: bool = False
    pos: Position = field(default_factory=Position)
    sums: EpochSums = field(default_factory=EpochSums)
    totals: Totals = field(default_factory=Totals)
    history: list = field(default_factory=list)
    best: dict | None = None  # weights of the epoch with the best validation accuracy
    best_hits: object = None  # its hits on the validation images (a bool tensor)
    last_hits: object = None  # the last scored epoch's
    in_a_row: object = None  # GradScaler's skips in a row, carried across epochs

    @property
    def planned_epochs(self) -> int:
        """The epochs this model trains for: as asked, or fewer where a time plan cut them."""
        return self.totals.planned_epochs or self.epochs

    def state(self) -> dict:
        return {"model": cpu_state_dict(self.parts.model),  # contiguous, as model.pt's
                "optimizer": self.parts.optimizer.state_dict(),
                "scheduler": self.parts.scheduler.state_dict(),
                "scaler": self.parts.scaler.state_dict(), "position": asdict(self.pos),
                "sums": asdict(self.sums), "totals": asdict(self.totals),
                "history": list(self.history), "rng": rng_state(),
                "val_hits": {"best": self.best_hits, "last": self.last_hits},
                "skipped_in_a_row": 0 if self.in_a_row is None else int(self.in_a_row)}

    def restore(self, state: dict, best: dict | None) -> None:
        import torch

        for part in ("model", "optimizer", "scheduler", "scaler"):
            getattr(self.parts, part).load_state_dict(state[part])
        # Plain dicts in the file (weights-only loading takes no classes of ours).
        self.pos, self.sums = Position(**state["position"]), EpochSums(**state["sums"])
        known = {name: value for name, value in state["totals"].items()
                 if name in Totals.__dataclass_fields__}  # older checkpoints held in_a_row
        self.totals = Totals(**asdict(self.totals) | known)
        self.history, self.best = state["history"], best
        hits = state.get("val_hits") or {}
        self.best_hits, self.last_hits = hits.get("best"), hits.get("last")
        # A run of GradScaler's skips goes on across a resume as it does across epochs.
        self.in_a_row = torch.tensor(state.get("skipped_in_a_row", state["totals"].get(
            "in_a_row", 0)), device=self.device)
        restore_rng(state["rng"])


def fit(loop: Loop, hooks: Hooks) -> None:
    """Train from where ``loop`` stands until its planned epochs are done or end_epoch set
    totals.stopped, then keep the last epoch's weights or load the best's (choice.keep_best)."""
    steps_per_epoch = loop.parts.steps_per_epoch
    while loop.pos.epoch <= loop.planned_epochs and not loop.totals.stopped:
        epoch = loop.pos.epoch
        if loop.pos.step_in_epoch < steps_per_epoch:  # not resumed at its very end
            # Each adds to totals.wall before a checkpoint holds it (a resume keeps the pace).
            seen = _steps(loop, hooks, epoch)
            _end_epoch(loop, hooks, epoch, seen)
        loop.pos.epoch, loop.pos.step_in_epoch = epoch + 1, 0
    if choice.keep_best(loop.totals, loop.history, loop.best_hits, loop.last_hits,
                        have_best=loop.best is not None):
        loop.parts.model.load_state_dict(loop.best)


def _steps(loop: Loop, hooks: Hooks, epoch: int) -> Seen:
    """The optimizer steps of one epoch (from where a resume left off), with the checkpoints
    --checkpoint-every asks for inside it; returns the epoch's sums read from the device."""
    parts, pos, device = loop.parts, loop.pos, loop.device
    steps_per_epoch = parts.steps_per_epoch
    check_every = 1 if device.type == "cpu" else LOG_EVERY_CUDA
    parts.trained.train()
    hooks.start_epoch(epoch)
    parts.sampler.set_epoch(epoch, start=pos.step_in_epoch * loop.batch_size)
    data_iterator = iter(parts.loader)
    bar = progress(data_iterator, desc=f"{loop.name} {epoch}/{loop.planned_epochs}",
                   quiet=loop.quiet, total=steps_per_epoch)
    device_sums = DeviceSums(device, loop.in_a_row)
    epoch_start = pos.global_step - pos.step_in_epoch
    started = wall_from = time.perf_counter()
    with hooks.guard(epoch, data_iterator):
        for images, labels in bar:
            train_step(parts, loop.precision, device, loop.grad_clip, images, labels,
                       device_sums, pos.global_step)
            pos.step_in_epoch += 1
            pos.global_step += 1
            every = loop.checkpoint_every
            checkpoint_now = (every and pos.global_step % every == 0
                              and pos.step_in_epoch < steps_per_epoch)
            if pos.step_in_epoch % check_every and not checkpoint_now:
                continue
            seen = device_sums.read()
            hooks.check(seen, epoch, epoch_start)
            shown = _with(loop.sums, seen)
            if hasattr(bar, "set_postfix") and shown.seen:
                bar.set_postfix(loss=f"{shown.loss / shown.seen:.3f}",
                                acc=f"{shown.correct / shown.seen:.3f}", refresh=False)
            if checkpoint_now:  # a checkpoint holds host numbers: the device's sums go in first
                _fold(loop, seen, started)
                loop.totals.wall, wall_from = (loop.totals.wall + time.perf_counter() - wall_from,
                                               time.perf_counter())
                loop.sums, loop.in_a_row = shown, device_sums.in_a_row  # the checkpoint's
                device_sums = DeviceSums(device, device_sums.in_a_row)
                hooks.checkpoint()
                started = time.perf_counter()
    seen = device_sums.read()
    hooks.check(seen, epoch, epoch_start)
    loop.in_a_row = device_sums.in_a_row
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
    _fold(loop, seen, started)
    loop.totals.wall += time.perf_counter() - wall_from
    return seen


def _with(sums: EpochSums, seen: Seen) -> EpochSums:
    return EpochSums(sums.loss + seen.loss, sums.correct + seen.correct, sums.seen + seen.seen)


def _fold(loop: Loop, seen: Seen, started: float) -> None:
    loop.totals.seconds += time.perf_counter() - started
    loop.totals.skipped += seen.skipped


def _end_epoch(loop: Loop, hooks: Hooks, epoch: int, seen: Seen) -> None:
    """Score the validation split, keep the best weights, and record the epoch."""
    epoch_sums = _with(loop.sums, seen)
    loop.totals.samples += epoch_sums.seen
    started = time.perf_counter()
    hits = hooks.score(epoch)
    val_acc = hit_share(hits)
    record = {"epoch": epoch, "loss": epoch_sums.loss / epoch_sums.seen,
              "train_accuracy": epoch_sums.correct / epoch_sums.seen, "val_accuracy": val_acc}
    improved = val_acc > loop.totals.best_val
    if improved:
        loop.totals.best_val, loop.totals.best_epoch = val_acc, epoch
        loop.best = cpu_state_dict(loop.parts.model, clone=True)
        loop.best_hits = hits
    loop.last_hits = hits
    loop.history.append(record)
    loop.sums = EpochSums()
    loop.totals.wall += (scored := time.perf_counter()) - started  # in plan and checkpoint
    hooks.end_epoch(epoch, record, improved)
    loop.totals.wall += time.perf_counter() - scored  # the checkpoint: in the next one's
