"""Training: the `amp` model under autocast (+ GradScaler for float16) and the `fp32` baseline.

Both see the same seed, initial weights, data order and hyperparameters, so the only difference
between them is the precision of the forward and backward pass. Both save fp32 master weights:
AMP changes how a model trains, not what it weighs on disk.
"""
from __future__ import annotations

import json
import math
import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from stages.artifacts import Run, atomic_torch_save, atomic_write_text
from stages.data import DataSplits, load_dataset, make_loader
from stages.errors import PipelineError
from stages.models import build_model, model_spec
from stages.precision import (Precision, autocast, grad_scaler, resolve_device,
                              resolve_precision, seed_everything)
from stages.progress import progress, say


@dataclass
class TrainResult:
    variant: str
    precision: str
    device: str
    seconds: float
    samples_per_second: float
    peak_memory_bytes: int
    peak_memory_method: str
    test_accuracy: float
    val_accuracy: float
    skipped_steps: int
    optimizer_steps: int
    final_loss: float
    epochs: int


# ---------------------------------------------------------------- shared with other stages


def predict(model, images, batch_size: int = 256, device=None):
    """Logits of ``model`` for a tensor of images, in eval mode and fp32, batch by batch."""
    import torch

    device = device or torch.device("cpu")
    model.eval()
    outputs = []
    with torch.inference_mode():
        for start in range(0, len(images), batch_size):
            outputs.append(model(images[start:start + batch_size].to(device)).float().cpu())
    return torch.cat(outputs) if outputs else torch.empty(0)


def accuracy(logits, labels) -> float:
    return float((logits.argmax(dim=1) == labels).float().mean()) if len(labels) else float("nan")


def load_splits(config) -> DataSplits:
    try:
        return load_dataset(config.dataset, image_size=config.image_size, seed=config.seed)
    except ValueError as exc:
        raise PipelineError(str(exc)) from None


# ---------------------------------------------------------------- memory


class _PeakMemory:
    """Peak memory of one training run: CUDA's allocator peak, or growth of resident memory on CPU.

    On CPU the process high-water mark (ru_maxrss) never goes down, so the second model trained in
    one process would inherit the first one's peak; sampling /proc/self/statm does not.
    """

    def __init__(self, device):
        self.device = device
        self.peak = 0
        self.method = "cuda max_memory_allocated" if device.type == "cuda" else "rss growth"
        self._stop = threading.Event()

    @staticmethod
    def _rss() -> int:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            return 0

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self._rss() - self._start)

    def __enter__(self):
        import torch

        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._start = self._rss()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        import torch

        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, self._rss() - self._start, 0)


# ---------------------------------------------------------------- training


def _lr_lambda(total_steps: int, warmup_steps: int):
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress_done = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress_done)))

    return factor


def _checkpoint(model, optimizer, scheduler, scaler, epoch: int, config, spec: dict,
                variant: str, precision: Precision, loader_generator) -> dict:
    import random

    import torch

    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict(),
        "epoch": epoch,
        "rng": {"torch": torch.get_rng_state(), "python": list(random.getstate()[1]),
                "loader": loader_generator.get_state()},
        "variant": variant,
        "precision": precision.name,
        "model_spec": spec,
        "config": asdict(config),
    }


def train_variant(variant: str, precision: Precision, splits: DataSplits, config, run: Run,
                  device) -> TrainResult:
    """Train one model and write its checkpoints, metrics.jsonl and weights-only model.pt."""
    import torch

    folder = run.root / "train" / variant
    folder.mkdir(parents=True, exist_ok=True)
    seed_everything(config.seed)
    spec = model_spec(config.model, splits.num_classes, splits.in_channels, splits.image_size)
    model = build_model(config.model, splits.num_classes, splits.in_channels).to(device)
    loader = make_loader(splits.train, config.batch_size, shuffle=True, seed=config.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=0.9, nesterov=True,
                                weight_decay=config.weight_decay)
    total_steps = config.epochs * len(loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, _lr_lambda(total_steps, min(len(loader), max(total_steps // 10, 1))))
    scaler = grad_scaler(precision, device)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=config.label_smoothing)

    metrics_lines: list[str] = []
    best_val, skipped, steps, seconds, samples = -1.0, 0, 0, 0.0, 0
    loss_value = float("nan")
    with _PeakMemory(device) as memory:
        for epoch in range(1, config.epochs + 1):
            model.train()
            epoch_loss, epoch_correct, epoch_seen = 0.0, 0, 0
            bar = progress(loader, desc=f"{variant} {epoch}/{config.epochs}", quiet=config.quiet)
            started = time.perf_counter()
            for step, (images, labels) in enumerate(bar, start=1):
                images, labels = images.to(device), labels.to(device)
                with autocast(precision, device):
                    logits = model(images)
                loss = criterion(logits.float(), labels)
                loss_value = float(loss.detach())
                if not math.isfinite(loss_value):
                    raise PipelineError(
                        f"{variant}: loss became {loss_value} at epoch {epoch} step {step}; "
                        f"lower --lr or change --precision (the last good checkpoint in {folder} "
                        "is untouched)")
                optimizer.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                if config.grad_clip:
                    scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
                    torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
                scale_before = scaler.get_scale() if scaler.is_enabled() else None
                scaler.step(optimizer)
                scaler.update()
                if scale_before is not None and scaler.get_scale() < scale_before:
                    skipped += 1  # GradScaler found inf/NaN gradients and skipped this step
                scheduler.step()
                steps += 1
                epoch_loss += loss_value * len(labels)
                epoch_correct += int((logits.argmax(1) == labels).sum())
                epoch_seen += len(labels)
                if hasattr(bar, "set_postfix"):
                    bar.set_postfix(loss=f"{epoch_loss / epoch_seen:.3f}",
                                    acc=f"{epoch_correct / epoch_seen:.3f}", refresh=False)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            epoch_seconds = time.perf_counter() - started
            seconds += epoch_seconds
            samples += epoch_seen
            val_acc = accuracy(predict(model, splits.val.tensors[0], device=device),
                              splits.val.tensors[1])
            record = {"epoch": epoch, "loss": epoch_loss / epoch_seen,
                      "train_accuracy": epoch_correct / epoch_seen, "val_accuracy": val_acc,
                      "lr": scheduler.get_last_lr()[0], "seconds": epoch_seconds,
                      "samples_per_second": epoch_seen / epoch_seconds, "skipped_steps": skipped}
            metrics_lines.append(json.dumps(record))
            atomic_write_text(folder / "metrics.jsonl", "\n".join(metrics_lines) + "\n")
            checkpoint = _checkpoint(model, optimizer, scheduler, scaler, epoch, config, spec,
                                     variant, precision, loader.generator)
            atomic_torch_save(checkpoint, folder / "checkpoint-last.pt")
            if val_acc > best_val:
                best_val = val_acc
                atomic_torch_save(checkpoint, folder / "checkpoint-best.pt")
            say(f"{variant} epoch {epoch}/{config.epochs}: loss {record['loss']:.4f} "
                f"train acc {record['train_accuracy']:.3f} val acc {val_acc:.3f} "
                f"({record['samples_per_second']:.0f} samples/s)", quiet=config.quiet)

    test_acc = accuracy(predict(model, splits.test.tensors[0], device=device),
                        splits.test.tensors[1])
    weights = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    atomic_torch_save({"model_spec": spec, "state_dict": weights}, folder / "model.pt")
    result = TrainResult(
        variant=variant, precision=precision.name, device=str(device), seconds=seconds,
        samples_per_second=samples / seconds if seconds else 0.0,
        peak_memory_bytes=int(memory.peak), peak_memory_method=memory.method,
        test_accuracy=test_acc, val_accuracy=val_acc, skipped_steps=skipped,
        optimizer_steps=steps - skipped, final_loss=record["loss"], epochs=config.epochs)

    cfg = asdict(config)
    for name in ("checkpoint-last", "checkpoint-best"):
        run.register(f"{variant}/{name}", folder / f"{name}.pt", kind="checkpoint", stage="train",
                     parent=variant, config=cfg)
    run.register(f"{variant}/metrics", folder / "metrics.jsonl", kind="metrics", stage="train",
                 parent=variant)
    run.register(variant, folder / "model.pt", kind="model", stage="train", config=cfg,
                 format="pytorch", model_spec=spec, training=asdict(result),
                 checkpoint_bytes=(folder / "checkpoint-last.pt").stat().st_size)
    return result


def run(config, run: Run) -> list[TrainResult]:
    """Train `amp` and, unless config.baseline is off, the `fp32` baseline beside it."""
    device = resolve_device(config.device)
    precision = resolve_precision(config.precision, device)
    splits = load_splits(config)
    run.record_config("train", asdict(config) | {"resolved_precision": precision.name,
                                                 "resolved_device": str(device)})
    variants = ([("fp32", Precision("fp32"))] if config.baseline else []) + [("amp", precision)]
    results = [train_variant(name, prec, splits, config, run, device) for name, prec in variants]
    for result in results:
        say(f"trained {result.variant} ({result.precision}): test accuracy "
            f"{result.test_accuracy:.4f}, {result.samples_per_second:.0f} samples/s, "
            f"{result.skipped_steps} skipped steps", quiet=False)
    return results
