"""Int8 across model families: what post-training quantization keeps, and what --auto buys.

    .venv/bin/python benchmarks/families.py --data-dir DIR [--dataset mnist]
        [--models resnet18,mobilenet_v2,mobilenet_v3_large,efficientnet_b0,mnasnet0_5,mixer]
        [--artifacts-dir artifacts-families] [--image-size 32] [--train-time 10m]
        [--tuning-time 3m] [--modes default,auto]

For each model: trains it with the product's defaults within --train-time (or reuses a run of
that name whose train stage is complete), runs `quantize` with the defaults and a report at
batch 32, then `quantize --auto` (which may go on to QAT where no post-training configuration
meets the budget, and says so) and another report, and prints one row per static int8 variant
(and QAT variant where --auto made one) and mode: the float model's test accuracy, the int8
change on test with Newcombe's paired 95% interval, the change on held-out training images (what
--auto chose on) and the worst it may be at 95% confidence (what the accuracy budget holds), the
seconds quantize took, the speed-up against the fastest float at batch 32, and whether the report
recommends it (with a row for the recommended variant where it is not a static one).
Made for notMNIST (10 letters, 8,000 training and 2,000 test images in torchvision's MNIST
layout; `--dataset mnist --data-dir DIR`), a sample of notMNIST in MNIST format posted by its
converter with the original author's permission: on 2,000 test images one image is 0.05 points.
Everything goes through the `pipeline` command, as a user would run it.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

FAMILIES = ("resnet18", "mobilenet_v2", "mobilenet_v3_large", "efficientnet_b0", "mnasnet0_5",
            "mixer")
STATIC = ("torch-static", "ort-static", "openvino-int8")
PIPELINE = [sys.executable, "-m", "pipeline"]


def pipeline(artifacts: Path, run: str, *args: str) -> float:
    """Run one pipeline command on ``run``; its wall time in seconds. Stops the benchmark with
    the command's own error where it fails."""
    started = time.monotonic()
    done = subprocess.run([*PIPELINE, "--artifacts-dir", str(artifacts), "--run", run, "--quiet",
                           *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{run}: pipeline {' '.join(args)} failed:\n{done.stderr[-2000:]}")
    return time.monotonic() - started


def trained(artifacts: Path, run: str) -> bool:
    manifest = artifacts / "runs" / run / "manifest.json"
    return (manifest.exists() and json.loads(manifest.read_text())["stages"]
            .get("train", {}).get("status") == "complete")


def train(args, model: str) -> float:
    """The product's training defaults (--lr auto, the plan that fits --time, the plateau
    stop), with the one budget every family gets."""
    data = ["--data-dir", str(args.data_dir)] if args.data_dir else []
    return pipeline(args.artifacts_dir, model, "train", "--model", model, "--dataset",
                    args.dataset, *data, "--image-size", str(args.image_size), "--time",
                    args.train_time, "--no-baseline", "--no-measure-memory")


def quantize_and_report(args, model: str, mode: str) -> list[dict]:
    """The trained run quantized with the defaults or with --auto (which remakes the static
    variants in place), then reported at batch 32."""
    limit = ["--tuning-time", args.tuning_time] if args.tuning_time else []
    seconds = pipeline(args.artifacts_dir, model, "quantize",
                       *(["--auto", *limit] if mode == "auto" else limit))
    pipeline(args.artifacts_dir, model, "report", "--batch-sizes", "32")
    folder = args.artifacts_dir / "runs" / model
    report = json.loads((folder / "report" / "report.json").read_text())
    models = {m["name"]: m for m in report["models"]}
    reference = models[report["reference"]]
    recommended = report["verdict"]["recommended"]
    rows = []
    # Every static backend, what QAT made where --auto went on to it, and the report's choice
    # where it is another variant (the mixer's was ort-dynamic).
    fine_tuned = tuple(name for name in ("torch-qat", "ort-qat", "openvino-qat") if name in models)
    shown = STATIC + fine_tuned
    for name in shown + ((recommended,) if recommended and recommended not in shown else ()):
        row = models.get(name)
        if row is None:
            not_kept = json.loads((folder / "config.json").read_text()).get(
                "quantize", {}).get("not_kept", {}).get(name, "not made")
            rows.append({"model": model, "mode": mode, "variant": name, "not_kept": not_kept,
                         "quantize_seconds": seconds})
            continue
        change = row["test"]["change_vs_reference"]
        rows.append({
            "model": model, "mode": mode, "variant": name,
            "float_test": reference["accuracy"], "test_change": change["difference"] * 100,
            "test_change_ci95": [change["low"] * 100, change["high"] * 100],
            "heldout_change": row["validation"]["change_vs_reference"]["difference"] * 100,
            "heldout_worst": row["validation"]["change_vs_reference"]["worst"] * 100,
            "quantize_seconds": seconds,
            "speedup_vs_best_float_32": row["speedup_vs_best_float"]["32"]["ratio"],
            "recommended": recommended == name,
            "configuration": (row.get("quantization") or {}).get("tuning", {}).get(
                "chosen", {}) or {},
        })
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| model | quantize | variant | float test | int8 change on test (95% CI) | "
             "change held-out (at worst, 95%) | quantize s | vs fastest float @32 | recommended |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "not_kept" in r:
            lines.append(f"| {r['model']} | {r['mode']} | {r['variant']} | - | {r['not_kept']} "
                         f"| - | {r['quantize_seconds']:.0f} | - | - |")
            continue
        low, high = r["test_change_ci95"]
        lines.append(f"| {r['model']} | {r['mode']} | {r['variant']} | {r['float_test']:.2%} | "
                     f"{r['test_change']:+.2f} ({low:+.2f} to {high:+.2f}) | "
                     f"{r['heldout_change']:+.2f} ({r['heldout_worst']:+.2f}) | "
                     f"{r['quantize_seconds']:.0f} | "
                     f"{r['speedup_vs_best_float_32']:.2f}x | "
                     f"{'yes' if r['recommended'] else ''} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, help="where the data set is (not for digits)")
    parser.add_argument("--dataset", default="mnist")
    parser.add_argument("--models", default=",".join(FAMILIES))
    parser.add_argument("--artifacts-dir", type=Path, default=Path("artifacts-families"))
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--train-time", default="10m", help="train's --time for each family "
                                                             "(default: 10m)")
    parser.add_argument("--tuning-time", help="passed to quantize (90s, 5m): each static "
                                              "backend's search; default: no limit")
    parser.add_argument("--modes", default="default,auto",
                        help="quantize with the defaults, with --auto, or both (default)")
    args = parser.parse_args()
    modes = list(dict.fromkeys(args.modes.split(",")))  # each mode once, in the order given
    if not modes or set(modes) - {"default", "auto"}:
        parser.error(f"--modes takes default, auto or both, not {args.modes!r}")
    started = time.monotonic()
    rows = []
    for model in args.models.split(","):
        if not trained(args.artifacts_dir, model):
            print(f"{model}: training ({train(args, model):.0f} s)", flush=True)
        for mode in modes:
            rows += quantize_and_report(args, model, mode)
            print(f"{model}: quantize {mode} done", flush=True)
    print(table(rows))
    out = args.artifacts_dir / "families.json"
    out.write_text(json.dumps(rows, indent=1))
    print(f"{len(rows)} rows in {out}; {(time.monotonic() - started) / 60:.1f} min in all")


if __name__ == "__main__":
    main()
