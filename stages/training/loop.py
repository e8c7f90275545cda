"""The training loop's parts, shared by the train and qat stages: the model, optimizer, LR
schedule, GradScaler and loader built one way, one optimizer step under autocast, and running
sums kept on the device.

The sums stay on the device and are read only at check points (every step on the CPU, where
reading is free; every few dozen steps on a GPU), so that a GPU is not made to wait for the host
after each step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from stages.data.datasets import DataSplits, EpochSampler, make_loader
from stages.models.build import build_model
from stages.models.weights import initial_weights
from stages.training import distributed
from stages.training.precision import Precision, autocast, grad_scaler, seed_everything


class CosineSchedule:
    """Linear warm-up, then cosine decay to zero at ``total_steps``: LambdaLR's factor. An
    object rather than a closure, so that a time budget can re-plan ``total_steps`` after an
    epoch (train --time) and LambdaLR's state_dict saves it for a resume."""

    def __init__(self, total_steps: int, warmup_steps: int) -> None:
        self.total_steps, self.warmup_steps = total_steps, warmup_steps

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        done = (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, done)))


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
    optimizer = torch.optim.SGD(decay_groups(model, config.weight_decay), lr=config.lr,
                                momentum=0.9, nesterov=True,
                                fused=True if device.type == "cuda" else None)
    total_steps = config.epochs * len(loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, CosineSchedule(total_steps, min(len(loader), max(total_steps // 10, 1))))
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
