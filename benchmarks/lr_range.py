"""The learning-rate range test (`train --lr auto`) on several models, with its settings varied:
where each curve's loss was lowest, its steepest descent, the peak chosen and what it cost.

    .venv/bin/python benchmarks/lr_range.py --models resnet18,mobilenet_v2 --dataset mnist \
        --data-dir DIR [--start 1e-3] [--end 1] [--steps 150] [--smoothing 0.98]

It runs stages/training/lr_range.py's own test, in fp32 on the CPU at batch 64 and 32x32, with
the module's settings replaced by the flags given, so that a change to them can be weighed
against the peaks the families were hand-tuned to (docs/measurements.md). A curve whose loss
never fell is a row that says so.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from pipeline.config import TrainConfig
from stages.data.datasets import load_splits
from stages.run.errors import PipelineError
from stages.training import lr_range
from stages.training.precision import Precision


def one(model: str, args) -> dict:
    config = TrainConfig(model=model, dataset=args.dataset, data_dir=str(args.data_dir or "data"),
                         quiet=True, measure_memory=False)
    splits = load_splits(config)
    started = time.monotonic()
    try:
        curve = lr_range.range_test(config, splits, Precision("fp32"), torch.device("cpu"),
                                    args.steps)
    except PipelineError as exc:
        return {"model": model, "error": str(exc), "seconds": time.monotonic() - started}
    return {"model": model, "seconds": time.monotonic() - started,
            "batch_size": config.batch_size} | curve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet18")
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--data-dir", type=Path)
    parser.add_argument("--start", type=float, default=lr_range.START_LR)
    parser.add_argument("--end", type=float, default=lr_range.END_LR)
    parser.add_argument("--steps", type=int, default=lr_range.MAX_STEPS)
    parser.add_argument("--smoothing", type=float, default=lr_range.SMOOTHING)
    parser.add_argument("--out", type=Path, help="the curves as JSON")
    args = parser.parse_args()
    lr_range.START_LR, lr_range.END_LR = args.start, args.end
    lr_range.SMOOTHING = args.smoothing
    rows = []
    print("| model | lowest loss at | steepest descent | chosen (uncapped) | steps | seconds |\n"
          "|---|---|---|---|---|---|", flush=True)
    for model in args.models.split(","):
        row = one(model, args)
        rows.append(row)
        if "error" in row:
            print(f"| {model} | {row['error']} | | | | {row['seconds']:.0f} |", flush=True)
            continue
        # What train --lr auto would use: the curve's choice under the ceiling per image.
        used = min(row["chosen"], lr_range.ceiling(row["batch_size"]))
        print(f"| {model} | {row['minimum']:.3g} | {row['steepest']:.3g} | {used:.3g} "
              f"({row['chosen']:.3g}) "
              f"| {row['steps']} | {row['seconds']:.0f} |", flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
