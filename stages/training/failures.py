"""How training fails, as one clear error each: a DataLoader worker that died or hung, a NaN
loss named with its likely cause; and how to tell a model that learns its training images
while validation stays at chance."""
from __future__ import annotations

import contextlib
import math
import os
import time
from pathlib import Path

from stages.data.loaders import make_loader
from stages.run import signals
from stages.run.errors import PipelineError
from stages.run.progress import say
from stages.training.loop import Position


def stop_workers(data_iterator) -> None:
    """Shut a failed loader's workers down with SIGCHLD held back, so that the death of a
    worker cannot raise a second error while the first is being reported."""
    import signal

    with signals.deferred(signal.SIGCHLD):
        try:
            data_iterator._shutdown_workers()  # what its __del__ would do; unregisters the pids
        except Exception:  # the workers are already gone; nothing more to clean up
            pass


def is_worker_failure(exc: BaseException, data_iterator=None) -> bool:
    """torch's own words for a dead or silent worker; or a broken pipe (ConnectionError,
    EOFError) where a worker of this loader has really died: a worker killed mid-handover
    breaks it. The same exceptions from a user's dataset (a network read) are theirs."""
    if isinstance(exc, (ConnectionError, EOFError)):
        workers = getattr(data_iterator, "_workers", None) or []
        deadline = time.monotonic() + 1.0  # a killed worker's pipe closes before it is reaped
        try:
            for worker in workers:
                if hasattr(worker, "join"):
                    worker.join(timeout=max(0.0, deadline - time.monotonic()))
        except RuntimeError as reaped:  # the death's SIGCHLD, raised by torch's handler (in CI)
            if is_worker_failure(reaped):
                return True
            raise
        return any(not worker.is_alive() for worker in workers)
    return isinstance(exc, RuntimeError) and any(
        marker in str(exc) for marker in ("DataLoader worker", "DataLoader timed out"))


@contextlib.contextmanager
def worker_failures(variant: str, epoch: int, pos: Position, folder: Path, data_iterator):
    """A DataLoader worker that dies or goes silent becomes one clear error. The death is
    reported by a SIGCHLD handler, so it can surface anywhere in the epoch, not only where the
    next batch is fetched; checkpoints already written stay as they are."""
    try:
        yield
    except (RuntimeError, ConnectionError, EOFError) as exc:
        if not is_worker_failure(exc, data_iterator):
            raise
        first = str(exc) or type(exc).__name__
        # One death can arrive twice: as the broken pipe, then as its SIGCHLD, whose handler
        # raises again wherever the main thread is until the workers are shut down (here too,
        # before stop_workers holds it back: a CI run saw it). Each worker dies once, so a
        # few tries shut them down.
        for _ in range(8):
            try:
                if hasattr(data_iterator, "_shutdown_workers"):
                    stop_workers(data_iterator)
                break
            except RuntimeError as again:
                if not is_worker_failure(again):
                    raise
        raise PipelineError(
            f"{variant}: a DataLoader worker died or hung at epoch {epoch} step "
            f"{pos.step_in_epoch + 1} ({first.splitlines()[0][:160]}); checkpoints in "
            f"{folder} are intact: fix the data and run 'pipeline train --resume', or run "
            "'pipeline train --resume --workers 0'") from None


def nan_message(variant: str, precision, device, epoch: int, step: int, folder: Path,
                baseline_epochs: int) -> str:
    """Name the likely cause: mixed precision only where the fp32 baseline trained past the
    same epoch (``baseline_epochs``: the epochs it ran, 0 where there was none); one that
    stopped sooner (its plateau or time budget) says nothing about the learning rate."""
    where = (f"{variant}: the loss became NaN or infinite at epoch {epoch} step {step} "
             f"(checkpoints already written in {folder} are untouched)")
    if precision.name != "fp32" and baseline_epochs >= epoch:
        return (f"{where}; the fp32 baseline trained through epoch {epoch} with the same "
                f"learning rate, so the cause is {precision.name} arithmetic or its kernels on "
                f"this {device.type.upper()}, not --lr: use --precision fp32 (and report the CPU, "
                f"torch version and ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', '')})")
    return f"{where}; lower --lr, add --grad-clip 1, or try --precision fp32"


def at_chance(train_accuracy: float, val_accuracy: float, chance: float, val_size: int) -> bool:
    """Learning the training split while validation stays near chance (the share of the
    largest class): a model that does not generalise, never one worth quantizing."""
    noise = 3 * math.sqrt(chance * (1 - chance) / max(val_size, 1))
    return train_accuracy >= chance + 0.3 and val_accuracy <= chance + max(noise, 0.1)


def chance(dataset) -> float:
    """The share of the largest class: what always guessing it scores."""
    import torch

    labels = torch.cat([labels for _, labels in make_loader(dataset, 1024)])
    return float(torch.bincount(labels).max()) / len(labels) if len(labels) else 0.0


def warn_at_chance(variant: str, record: dict, chance: float, val_size: int,
                   quiet: bool) -> None:
    """Say so where an epoch's ``record`` learns the training images but not validation's."""
    if at_chance(record["train_accuracy"], record["val_accuracy"], chance, val_size):
        say(f"WARNING: {variant} learns the training images "
            f"({record['train_accuracy']:.1%}) but its validation accuracy is at chance "
            f"({record['val_accuracy']:.1%}): it does not generalise to held-out images; check "
            "the data (labels, a train/validation mix-up) and any layer that behaves "
            "differently in evaluation", quiet=quiet)
