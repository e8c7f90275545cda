"""fp32, bf16 and int8 at the size people deploy (224x224): what int8 buys over the best float a
user could serve on this CPU.

    .venv/bin/python benchmarks/deploy_size.py [--models resnet18,mobilenet_v2,efficientnet_b0]
        [--artifacts-dir artifacts-224] [--image-size 224] [--dataset digits] [--data-dir DIR]
        [--epochs 1] [--lr 0.02] [--max-accuracy-drop 100]

For each model, through the `pipeline` command as a user runs it: `train` for --epochs at
--image-size (digits upscaled by default: accuracy is not the point here, the timing is; a
fixed --lr skips the range test), `quantize` with the defaults but --max-accuracy-drop, and
`report` at batches 1 and 32. The accuracy fallback is skipped by default (every layer int8,
what the timing is about): a one-epoch model loses more than a point to int8, and with the
fallback's trials resnet18's quantize at 224x224 took 31 minutes on 2 cores (Zen 4 EPYC,
2026-12-05; mobilenet_v2's took 7 without them). Prints one row per model: the p50 at batch 1
and 32 of the fastest fp32, the fastest bf16 (openvino-bf16, amp-compiled, amp; none on a CPU
without bf16 instructions) and the fastest int8 variant, the recommended variant, its speed-up
over the fastest float and the fastest fp32 at batch 32, its test change against amp, and how
long each stage took.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

PIPELINE = [sys.executable, "-m", "pipeline"]


def pipeline(artifacts: Path, run: str, *args: str) -> float:
    """One pipeline command on ``run``; its wall time. Stops with the command's own error."""
    started = time.monotonic()
    done = subprocess.run([*PIPELINE, "--artifacts-dir", str(artifacts), "--run", run, "--quiet",
                           *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{run}: pipeline {' '.join(args)} failed:\n{done.stderr[-2000:]}")
    return time.monotonic() - started


def fastest(models: list[dict], precision: str, size: str) -> dict | None:
    rows = [m for m in models if m["precision"] == precision  # the CPU's, as the verdict
            and m.get("device", "cpu") == "cpu"]
    return min(rows, key=lambda m: m["latency_ms"][size]["p50"], default=None)


def row(report: dict, seconds: dict[str, float]) -> str:
    models, verdict = report["models"], report["verdict"]
    cells = []
    for precision in ("fp32", "bf16", "int8"):
        for size in ("1", "32"):
            best = fastest(models, precision, size)
            cells.append("-" if best is None else
                         f"{best['latency_ms'][size]['p50']:.2f} (`{best['name']}`)")
    vs_fp32 = verdict.get("speedup_vs_best_fp32")
    cells += [f"`{verdict['recommended']}`", f"{verdict['speedup_vs_best_float']:.2f}x",
              "-" if vs_fp32 is None else f"{vs_fp32:.2f}x",
              f"{verdict['accuracy_change_points']:+.2f}",
              " / ".join(f"{seconds[stage]:.0f}" for stage in ("train", "quantize", "report"))]
    return " | ".join(cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="resnet18,mobilenet_v2,efficientnet_b0")
    parser.add_argument("--artifacts-dir", type=Path, default=Path("artifacts-224"))
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--data-dir")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", default="0.02")
    parser.add_argument("--max-accuracy-drop", default="100")
    args = parser.parse_args()
    data = ["--data-dir", args.data_dir] if args.data_dir else []
    print("| model | fp32 ms @1 | fp32 ms @32 | bf16 ms @1 | bf16 ms @32 | int8 ms @1 | "
          "int8 ms @32 | recommended @32 | vs fastest float | vs fastest fp32 | test change | "
          "train / quantize / report s |")
    print("|" + "---|" * 12)
    for model in args.models.split(","):
        seconds = {"train": pipeline(
            args.artifacts_dir, model, "train", "--model", model, "--dataset", args.dataset,
            *data, "--image-size", str(args.image_size), "--epochs", str(args.epochs), "--lr",
            args.lr, "--no-baseline")}
        seconds["quantize"] = pipeline(args.artifacts_dir, model, "quantize",
                                       "--max-accuracy-drop", args.max_accuracy_drop)
        seconds["report"] = pipeline(args.artifacts_dir, model, "report", "--batch-sizes", "1,32")
        report = json.loads((args.artifacts_dir / "runs" / model / "report" /
                             "report.json").read_text())
        print(f"| {model} | {row(report, seconds)} |", flush=True)


if __name__ == "__main__":
    main()
