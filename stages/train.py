"""Training: the `amp` model under autocast (+ GradScaler for float16) and the `fp32` baseline.

Both see the same seed, initial weights, data order and hyperparameters, so the only difference
between them is the precision of the forward and backward pass. Both save fp32 master weights:
AMP changes how a model trains, not what it weighs on disk.

A checkpoint holds everything the loop needs to continue exactly where it stopped (weights,
optimizer, LR schedule, scaler, RNG states, epoch and position in the epoch, the epoch's running
sums), so a resumed run on CPU ends bit-identical to one that was never interrupted.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from stages import distributed
from stages.artifacts import (Run, atomic_torch_save, atomic_write_text, load_checkpoint,
                              remove_stale_temporaries)
from stages.data import DataSplits, EpochSampler, batches, load_dataset, make_loader
from stages.errors import PipelineError
from stages.memory import PeakMemory
from stages.models import build_model, model_spec
from stages.precision import (Precision, autocast, grad_scaler, resolve_device,
                              resolve_precision, seed_everything)
from stages.progress import progress, say


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
    skipped_steps: int
    optimizer_steps: int
    final_loss: float
    epochs: int
    resumed_from: str | None
    skipped_images: int = 0


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


def predict_dataset(predict_batch, dataset, batch_size: int = 256):
    """(logits, labels) of a whole data set through ``predict_batch`` (a model or ORT session)."""
    import torch

    logits, labels = [], []
    for images, targets in batches(dataset, batch_size):
        logits.append(predict_batch(images))
        labels.append(targets)
    return torch.cat(logits), torch.cat(labels)


def accuracy(logits, labels) -> float:
    return float((logits.argmax(dim=1) == labels).float().mean()) if len(labels) else float("nan")


def dataset_accuracy(model, dataset, device) -> float:
    return accuracy(*predict_dataset(lambda images: predict(model, images, device=device), dataset))


def load_splits(config) -> DataSplits:
    """The splits a training config names (a saved config from an older run may lack keys)."""
    option = lambda name, default: getattr(config, name, default)  # noqa: E731
    try:
        return load_dataset(config.dataset, image_size=config.image_size, seed=config.seed,
                            data_dir=option("data_dir", "data"), download=option("download", False),
                            val_fraction=option("val_fraction", 0.1),
                            in_channels=option("in_channels", None),
                            skip_bad_images=option("skip_bad_images", False))
    except ValueError as exc:
        raise PipelineError(str(exc)) from None


def splits_of_run(run: Run) -> DataSplits:
    """The data a run was trained on, rebuilt from the training config in its manifest."""
    from types import SimpleNamespace

    artifacts = run.artifacts()
    trained = next((artifacts[n] for n in ("amp", "fp32") if n in artifacts), None)
    if trained is None:
        raise PipelineError(f"run {run.name!r} has no trained model; run 'pipeline train' first")
    return load_splits(SimpleNamespace(**trained["config"]))


# ---------------------------------------------------------------- checkpoints


def _lr_lambda(total_steps: int, warmup_steps: int):
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        done = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, done)))

    return factor


def _rng_state() -> dict:
    import torch

    state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_rng(state: dict) -> None:
    import torch

    torch.set_rng_state(state["torch"])
    random.setstate((3, tuple(state["python"]), None))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _checkpoints_of(run: Run, variant: str) -> list[tuple[int, str]]:
    """(global step, manifest name) of a variant's numbered checkpoints, newest first."""
    found = [(entry["step"], name) for name, entry in run.artifacts().items()
             if entry["kind"] == "checkpoint" and entry.get("parent") == variant
             and "step" in entry]
    return sorted(found, reverse=True)


def newest_good_checkpoint(run: Run, variant: str) -> tuple[str, dict] | None:
    """The newest checkpoint that matches its sha256 and loads; older ones are the fallback."""
    for _, name in _checkpoints_of(run, variant):
        try:
            path = run.verified_path(name)
        except PipelineError as exc:  # truncated or bit-flipped: the previous one will do
            say(f"resume: skipping {exc}")
            continue
        # A file that matches the manifest but will not load as weights was written by someone
        # else, manifest and all: refuse it rather than fall back silently.
        return name, load_checkpoint(path)
    return None


class _Checkpointer:
    """Writes numbered checkpoints, keeps the newest ``keep`` and the best, on rank 0 only."""

    def __init__(self, run: Run, variant: str, folder: Path, keep: int, config_dict: dict):
        self.run, self.variant, self.folder, self.keep = run, variant, folder, keep
        self.config_dict = config_dict

    def save(self, state: dict, best: bool) -> None:
        step = state["position"]["global_step"]
        name = f"{self.variant}/checkpoint-step{step:07d}"
        path = self.folder / f"checkpoint-step{step:07d}.pt"
        atomic_torch_save(state, path)
        self.run.register(name, path, kind="checkpoint", stage="train", parent=self.variant,
                          config=self.config_dict, step=step, epoch=state["position"]["epoch"])
        self.run.register_alias(f"{self.variant}/checkpoint-last", of=name)
        if best:
            atomic_torch_save(state, self.folder / "checkpoint-best.pt")
            self.run.register(f"{self.variant}/checkpoint-best", self.folder / "checkpoint-best.pt",
                              kind="checkpoint-best", stage="train", parent=self.variant)
        for _, old in _checkpoints_of(self.run, self.variant)[self.keep:]:
            self.run.unregister(old)


# ---------------------------------------------------------------- the loop


def _weights_digest(model) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _stop_workers(data_iterator) -> None:
    """Shut a failed loader's workers down with SIGCHLD held back, so that the death of a
    worker cannot raise a second error while the first is being reported."""
    import signal

    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    try:
        data_iterator._shutdown_workers()  # what its __del__ would do; unregisters the pids
    except Exception:  # the workers are already gone; nothing more to clean up
        pass
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


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


def train_variant(variant: str, precision: Precision, splits: DataSplits, config, run: Run,
                  device, resume: bool = False) -> TrainResult:
    """Train one model (or continue it) and write checkpoints, metrics.jsonl and model.pt."""
    import torch

    world = distributed.current()
    folder = run.root / "train" / variant
    if world.is_main:
        folder.mkdir(parents=True, exist_ok=True)
    seed_everything(config.seed)
    spec = model_spec(config.model, splits.num_classes, splits.in_channels, splits.image_size)
    model = build_model(config.model, splits.num_classes, splits.in_channels).to(device)
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
    if world.is_main:
        remove_stale_temporaries(folder)
    steps_per_epoch = len(loader)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=0.9, nesterov=True,
                                weight_decay=config.weight_decay)
    total_steps = config.epochs * steps_per_epoch
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, _lr_lambda(total_steps, min(steps_per_epoch, max(total_steps // 10, 1))))
    scaler = grad_scaler(precision, device)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=config.label_smoothing)
    checkpointer = _Checkpointer(run, variant, folder, config.keep_checkpoints, asdict(config))

    # Everything below is saved in each checkpoint and restored on resume.
    pos = {"epoch": 1, "step_in_epoch": 0, "global_step": 0}
    sums = {"loss": 0.0, "correct": 0, "seen": 0}
    totals = {"skipped": 0, "in_a_row": 0, "seconds": 0.0, "samples": 0, "best_val": -1.0}
    history: list[dict] = []
    resumed_from = None
    if resume:
        found = newest_good_checkpoint(run, variant)
        if found:
            resumed_from, state = found
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            scaler.load_state_dict(state["scaler"])
            pos, sums, totals = state["position"], state["sums"], state["totals"]
            history = state["history"]
            _restore_rng(state["rng"])
            say(f"{variant}: resuming from {resumed_from} (epoch {pos['epoch']}, step "
                f"{pos['step_in_epoch']}/{steps_per_epoch})", quiet=not world.is_main)

    def state_now() -> dict:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                "position": dict(pos), "sums": dict(sums), "totals": dict(totals),
                "history": list(history), "rng": _rng_state(), "variant": variant,
                "precision": precision.name, "model_spec": spec, "config": asdict(config)}

    with PeakMemory(device) as memory:
        while pos["epoch"] <= config.epochs:
            epoch = pos["epoch"]
            if pos["step_in_epoch"] >= steps_per_epoch:  # resumed at an epoch boundary
                pos.update(epoch=epoch + 1, step_in_epoch=0)
                continue
            trained.train()
            sampler.set_epoch(epoch, start=pos["step_in_epoch"] * config.batch_size)
            data_iterator = iter(loader)
            bar = progress(data_iterator, desc=f"{variant} {epoch}/{config.epochs}",
                           quiet=config.quiet or not world.is_main, total=len(loader))
            started = tick = time.perf_counter()
            with _worker_failures(variant, epoch, pos, folder, data_iterator):
                for images, labels in bar:
                    images = images.to(device, non_blocking=True)
                    labels = labels.to(device, non_blocking=True)
                    if device.type == "cuda":
                        images = images.contiguous(memory_format=torch.channels_last)
                    with autocast(precision, device):
                        logits = trained(images)
                    loss = criterion(logits.float(), labels)
                    loss_value = float(loss.detach())
                    finite = distributed.sum_over_ranks([float(math.isfinite(loss_value))], device)
                    step = pos["step_in_epoch"] + 1
                    if finite[0] < world.world_size:
                        raise PipelineError(
                            f"{variant}: loss became {loss_value} at epoch {epoch} step {step}; "
                            "lower --lr or change --precision (checkpoints already written in "
                            f"{folder} are untouched)")
                    optimizer.zero_grad(set_to_none=True)
                    scaler.scale(loss).backward()
                    if config.grad_clip:
                        scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
                        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
                    scale_before = scaler.get_scale() if scaler.is_enabled() else None
                    scaler.step(optimizer)
                    scaler.update()
                    if scale_before is not None and scaler.get_scale() < scale_before:
                        totals["skipped"] += 1  # GradScaler found inf/NaN gradients: no step
                        totals["in_a_row"] += 1
                        if totals["in_a_row"] > config.max_skipped_steps:
                            raise PipelineError(
                                f"{variant}: GradScaler skipped {totals['in_a_row']} optimizer "
                                f"steps in a row (inf/NaN gradients) up to epoch {epoch} step "
                                f"{step}; lower --lr, add --grad-clip or use --precision bf16")
                    else:
                        totals["in_a_row"] = 0
                    scheduler.step()
                    pos["step_in_epoch"] = step
                    pos["global_step"] += 1
                    sums["loss"] += loss_value * len(labels)
                    sums["correct"] += int((logits.argmax(1) == labels).sum())
                    sums["seen"] += len(labels)
                    if hasattr(bar, "set_postfix"):
                        elapsed = max(time.perf_counter() - tick, 1e-9)
                        rate = len(labels) * world.world_size / elapsed
                        bar.set_postfix(loss=f"{sums['loss'] / sums['seen']:.3f}",
                                        acc=f"{sums['correct'] / sums['seen']:.3f}",
                                        samples_per_s=f"{rate:.0f}", refresh=False)
                    tick = time.perf_counter()
                    every = config.checkpoint_every
                    if every and pos["global_step"] % every == 0 and step < steps_per_epoch:
                        totals["seconds"] += time.perf_counter() - started
                        distributed.sync_buffers(model)
                        if world.is_main:
                            checkpointer.save(state_now(), best=False)
                        started = time.perf_counter()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            totals["seconds"] += time.perf_counter() - started
            loss_sum, correct, seen = distributed.sum_over_ranks(
                [sums["loss"], sums["correct"], sums["seen"]], device)
            totals["samples"] += int(seen)
            distributed.sync_buffers(model)
            val_acc = dataset_accuracy(model, splits.val, device)
            record = {"epoch": epoch, "loss": loss_sum / seen, "train_accuracy": correct / seen,
                      "val_accuracy": val_acc, "lr": scheduler.get_last_lr()[0],
                      "seconds": totals["seconds"], "samples_per_second":
                      totals["samples"] / totals["seconds"], "skipped_steps": totals["skipped"],
                      "skipped_images": splits.skipped_images}
            history.append(record)
            best = val_acc > totals["best_val"]
            totals["best_val"] = max(totals["best_val"], val_acc)
            sums = {"loss": 0.0, "correct": 0, "seen": 0}
            if world.is_main:
                atomic_write_text(folder / "metrics.jsonl",
                                  "".join(json.dumps(h) + "\n" for h in history))
                checkpointer.save(state_now(), best=best)
            say(f"{variant} epoch {epoch}/{config.epochs}: loss {record['loss']:.4f} "
                f"train acc {record['train_accuracy']:.3f} val acc {val_acc:.3f}",
                quiet=config.quiet or not world.is_main)
            pos.update(epoch=epoch + 1, step_in_epoch=0)

    digests = distributed.all_gather(_weights_digest(model))
    if len(set(digests)) != 1:
        raise PipelineError(f"{variant}: ranks ended with different weights; please report this")
    test_acc = dataset_accuracy(model, splits.test, device)
    last = history[-1] if history else {"loss": float("nan"), "val_accuracy": float("nan")}
    result = TrainResult(
        variant=variant, precision=precision.name, device=str(device),
        world_size=world.world_size, seconds=totals["seconds"],
        samples_per_second=totals["samples"] / totals["seconds"] if totals["seconds"] else 0.0,
        peak_memory_bytes=int(memory.peak), peak_memory_method=memory.method,
        test_accuracy=test_acc, val_accuracy=last["val_accuracy"],
        skipped_steps=totals["skipped"],
        optimizer_steps=pos["global_step"] - totals["skipped"], final_loss=last["loss"],
        epochs=config.epochs, resumed_from=resumed_from, skipped_images=splits.skipped_images)
    if world.is_main:
        weights = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        atomic_torch_save({"model_spec": spec, "state_dict": weights}, folder / "model.pt")
        run.register(f"{variant}/metrics", folder / "metrics.jsonl", kind="metrics",
                     stage="train", parent=variant)
        run.register(variant, folder / "model.pt", kind="model", stage="train",
                     config=asdict(config), format="pytorch", model_spec=spec,
                     training=asdict(result) | {"weights_sha256_all_ranks": digests[0]},
                     checkpoint_bytes=run.entry(f"{variant}/checkpoint-last")["bytes"])
    return result


def run(config, run: Run, resume: bool = False) -> list[TrainResult]:
    """Train `amp` and, unless config.baseline is off, the `fp32` baseline beside it.

    With ``resume``, a variant whose model.pt is listed is done; the others continue from their
    newest good checkpoint, or start afresh where they have none.
    """
    import torch

    device = resolve_device(config.device)
    world = distributed.current()
    if world.active and device.type == "cuda":
        device = torch.device("cuda", world.local_rank)
    precision = resolve_precision(config.precision, device)
    splits = load_splits(config)
    if world.is_main:
        run.record_config("train", asdict(config) | {"resolved_precision": precision.name,
                                                     "resolved_device": str(device),
                                                     "world_size": world.world_size})
    variants = ([("fp32", Precision("fp32"))] if config.baseline else []) + [("amp", precision)]
    results = []
    deterministic_before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(config.deterministic or deterministic_before)
    try:
        for name, prec in variants:
            if resume and name in run.artifacts():
                saved = run.entry(name)["training"]
                results.append(TrainResult(**{f: saved.get(f)
                                              for f in TrainResult.__dataclass_fields__}))
                say(f"{name}: already finished", quiet=config.quiet)
                continue
            results.append(train_variant(name, prec, splits, config, run, device, resume))
    finally:  # later stages in the same chain may use ops with no deterministic kernel
        torch.use_deterministic_algorithms(deterministic_before)
    for result in results:
        say(f"trained {result.variant} ({result.precision}): test accuracy "
            f"{result.test_accuracy:.4f}, {result.samples_per_second:.0f} samples/s, "
            f"{result.skipped_steps} skipped steps", quiet=not world.is_main)
    return results
