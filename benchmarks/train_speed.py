"""Samples per second of `pipeline train` beside a bare PyTorch loop, same model, data, batch.

    .venv/bin/python benchmarks/train_speed.py [--model resnet18] [--epochs 3] [--precision bf16]
        [--lr 0.02]

Both loops run in this one process, one after the other, on the digits training split with the
same seed, batch size, optimizer, learning rate (a fixed one: the range test is not what is
timed) and autocast type. The pipeline's figure is its own in-loop rate
(checkpoints and validation excluded, as it reports it) and, beside it, the wall-clock rate of
the whole call with those included. Target: the in-loop rate within 10% of the bare loop.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from pipeline.config import TrainConfig
from stages import train
from stages.data.datasets import load_splits
from stages.models.build import build_model
from stages.run import artifacts
from stages.training.precision import (
    Precision,
    autocast,
    cap_isa_for_bf16_training,
    resolve_device,
)


def bare_loop(config: TrainConfig, splits, precision: Precision, device) -> float:
    """The textbook loop: no scheduler, checkpoints, metrics or progress; samples per second."""
    torch.manual_seed(config.seed)
    model = build_model(config.model, splits.num_classes, splits.in_channels).to(device).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=0.9, nesterov=True,
                                weight_decay=config.weight_decay)
    loader = torch.utils.data.DataLoader(splits.train, batch_size=config.batch_size, shuffle=True)
    criterion = torch.nn.CrossEntropyLoss()
    seen, started = 0, time.perf_counter()
    for _ in range(config.epochs):
        for images, labels in loader:
            with autocast(precision, device):
                logits = model(images.to(device))
            loss = criterion(logits.float(), labels.to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            seen += len(labels)
    return seen / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--precision", default="bf16", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--lr", type=float, default=0.02)
    args = parser.parse_args()
    config = TrainConfig(model=args.model, epochs=args.epochs, batch_size=args.batch_size,
                         lr=args.lr, precision=args.precision, baseline=False, quiet=True)
    device = resolve_device("auto")
    # As `pipeline train` does before any kernel: on an AMX CPU bf16 training runs capped
    # below AMX, and the bare loop ran first, with AMX's bf16 kernels, uncapped.
    cap_isa_for_bf16_training(args.precision, device.type)
    splits = load_splits(config)
    bare = bare_loop(config, splits, Precision(args.precision), device)
    with tempfile.TemporaryDirectory() as folder:
        run = artifacts.create_run(Path(folder), "bench")
        started = time.perf_counter()
        (result,) = train.run(config, run)
        wall = time.perf_counter() - started
    samples = len(splits.train) * config.epochs
    print(f"model {args.model}, batch {args.batch_size}, {args.precision}, {args.epochs} epochs, "
          f"{torch.get_num_threads()} threads, device {device}")
    print(f"bare PyTorch loop          {bare:8.1f} samples/s")
    print(f"pipeline train (in loop)   {result.samples_per_second:8.1f} samples/s "
          f"({result.samples_per_second / bare:.2f}x the bare loop)")
    print(f"pipeline train (wall, incl. data, eval, checkpoints) {samples / wall:8.1f} samples/s")


if __name__ == "__main__":
    main()
