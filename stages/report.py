"""Measure every variant of a run the same way and write report.md, report.json and a plot.

Same test images, same random latency inputs, same thread count for PyTorch and ONNX Runtime,
all on the CPU, so that the numbers in one report can be compared with each other.
"""
from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

from stages import bench, export
from stages.artifacts import Run, atomic_path, atomic_write_json, atomic_write_text
from stages.data import load_dataset
from stages.errors import UsageError
from stages.progress import say
from stages.quantize import load_torch_model
from stages.train import accuracy

VARIANTS = ("fp32", "amp", "torch-dynamic", "torch-static", "onnx-fp32", "ort-dynamic",
            "ort-static")
FLOAT_SOURCE = {"torch-dynamic": "amp", "torch-static": "amp", "onnx-fp32": "amp",
                "ort-dynamic": "onnx-fp32", "ort-static": "onnx-fp32"}
SLOW_CAUSE = {
    "ort-dynamic": "ONNX Runtime's dynamic quantization turns convolutions into ConvInteger, "
                   "which has no fast int8 kernel; use ort-static (QDQ) for conv nets",
    "torch-dynamic": "PyTorch dynamic quantization only touches Linear/LSTM layers, so a conv "
                     "net keeps its float convolutions; use torch-static",
}


def _predictor(run: Run, name: str, threads: int):
    """A function from a float tensor batch to logits, and a latency call factory."""
    entry = run.entry(name)
    if entry["format"] == "onnx":
        session = export.ort_session(run.verified_path(name), threads)
        return (lambda images: export.ort_predict(session, images),
                lambda batch: bench.ort_call(session, batch))
    from stages.train import predict

    model = load_torch_model(run, name)
    return (lambda images: predict(model, images), lambda batch: bench.torch_call(model, batch))


def _shipped_bytes(run: Run, name: str) -> int:
    entry = run.entry(name)
    path = run.root / entry["path"]
    return export.onnx_size_bytes(path) if entry["format"] == "onnx" else path.stat().st_size


def measure_variants(run: Run, config, threads: int) -> tuple[list[dict], str]:
    artifacts = run.artifacts()
    present = [v for v in VARIANTS if v in artifacts]
    if not present:
        raise UsageError(f"run {run.name!r} has no model to report on; run 'pipeline train' first")
    spec = artifacts[present[0]]["model_spec"]
    train_config = artifacts[present[0]]["config"]
    splits = load_dataset(train_config.get("dataset", "digits"), image_size=spec["image_size"],
                          seed=train_config.get("seed", 0))
    images, labels = splits.test.tensors
    reference = "fp32" if "fp32" in present else present[0]
    rows, predictions = [], {}
    for name in present:
        say(f"report: measuring {name} ...", quiet=config.quiet)
        predict_fn, call_for = _predictor(run, name, threads)
        logits = predict_fn(images)
        predictions[name] = logits.argmax(1)
        latency = {}
        for batch_size in config.batch_sizes:
            batch = bench.random_batch(splits.input_shape(batch_size))
            latency[str(batch_size)] = bench.measure(call_for(batch), config.warmup,
                                                     config.repeats,
                                                     config.max_seconds_per_measurement)
        entry = artifacts[name]
        rows.append({"name": name, "format": entry["format"], "path": entry["path"],
                     "size_bytes": _shipped_bytes(run, name),
                     "accuracy": accuracy(logits, labels), "latency_ms": latency,
                     "parent": entry.get("parent"), "quantization": entry.get("quantization")})
    for row in rows:
        same = predictions[row["name"]] == predictions[reference]
        row["agreement"] = float(same.float().mean())
        row["flipped_predictions"] = int((~same).sum())
        row["agreement_reference"] = reference
    return rows, reference


def training_rows(run: Run) -> dict:
    rows = {}
    for name in ("fp32", "amp"):
        if name in run.artifacts():
            entry = run.entry(name)
            rows[name] = {**entry["training"], "checkpoint_bytes": entry["checkpoint_bytes"],
                          "model_bytes": entry["bytes"]}
    return rows


def warnings_for(rows: list[dict], reference: str, budget_points: float, batch: str) -> list[str]:
    """Results that defeat their purpose: int8 slower than its float source, or less accurate
    than the budget allows."""
    by_name = {row["name"]: row for row in rows}
    found = []
    for row in rows:
        source = by_name.get(FLOAT_SOURCE.get(row["name"], ""))
        if source and row["name"] != "onnx-fp32":
            mine, theirs = row["latency_ms"][batch]["p50"], source["latency_ms"][batch]["p50"]
            if mine > theirs:
                cause = SLOW_CAUSE.get(row["name"], "the int8 graph falls back to slow kernels")
                found.append(f"{row['name']} is slower than its float source {source['name']} at "
                             f"batch {batch} ({mine:.2f} ms against {theirs:.2f} ms): {cause}.")
        drop = (by_name[reference]["accuracy"] - row["accuracy"]) * 100
        if drop > budget_points:
            found.append(f"{row['name']} loses {drop:.2f} points of accuracy against {reference}, "
                         f"more than the budget of {budget_points:g}.")
    return found


def verdict(rows: list[dict], reference: str, budget_points: float, batch: str) -> dict:
    """The fastest variant at the largest batch size whose accuracy is within the budget."""
    by_name = {row["name"]: row for row in rows}
    ref = by_name[reference]
    within = [r for r in rows if (ref["accuracy"] - r["accuracy"]) * 100 <= budget_points + 1e-9]
    best = min(within, key=lambda r: r["latency_ms"][batch]["p50"])
    return {"recommended": best["name"], "batch_size": int(batch),
            "speedup": ref["latency_ms"][batch]["p50"] / best["latency_ms"][batch]["p50"],
            "size_ratio": best["size_bytes"] / ref["size_bytes"],
            "accuracy_change_points": (best["accuracy"] - ref["accuracy"]) * 100,
            "max_accuracy_drop_points": budget_points, "reference": reference}


def amp_sentence(training: dict, rows: list[dict]) -> str:
    if "fp32" not in training or "amp" not in training:
        return "Train with the fp32 baseline to compare AMP training against fp32."
    fp32, amp = training["fp32"], training["amp"]
    ratio = amp["model_bytes"] / fp32["model_bytes"]
    smallest = min(rows, key=lambda r: r["size_bytes"])
    return (f"AMP training ({amp['precision']}) saved a model of {amp['model_bytes'] / 1e6:.2f} MB "
            f"against fp32's {fp32['model_bytes'] / 1e6:.2f} MB (ratio {ratio:.3f}): its master "
            f"weights are fp32, so mixed precision does not shrink the saved model; quantization "
            f"does ({smallest['name']}: {smallest['size_bytes'] / fp32['model_bytes']:.2f}x).")


def plot_latency_vs_size(rows: list[dict], batch: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    for row in rows:
        x, y = row["size_bytes"] / 1e6, row["latency_ms"][batch]["p50"]
        ax.scatter(x, y, s=60)
        ax.annotate(f"{row['name']} ({row['accuracy']:.1%})", (x, y), textcoords="offset points",
                    xytext=(6, 4), fontsize=8)
    ax.set_xlabel("shipped size (MB)")
    ax.set_ylabel(f"p50 latency at batch {batch} (ms, log)")
    ax.set_yscale("log")
    ax.set_title("Latency against size (label: test accuracy)")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)


def _markdown(report: dict) -> str:
    ref = report["reference"]
    rows = report["models"]
    by_name = {r["name"]: r for r in rows}
    batches = [str(b) for b in report["config"]["batch_sizes"]]
    big = batches[-1]
    v = report["verdict"]
    lines = [f"# Report for run `{report['run']}`", "",
             f"**Ship `{v['recommended']}`.** Of the variants within {v['max_accuracy_drop_points']:g}"
             f" point(s) of `{ref}`'s test accuracy, it has the lowest p50 latency at batch "
             f"{v['batch_size']}: {v['speedup']:.2f}x faster than `{ref}` and {v['size_ratio']:.2f}x"
             f" its size, with an accuracy change of {v['accuracy_change_points']:+.2f} points. "
             + report["amp_vs_quantization"], ""]
    if report["warnings"]:
        lines += ["## Warnings", ""] + [f"- {w}" for w in report["warnings"]] + [""]
    head = ["variant", "format", "size (MB)", "size vs fp32"]
    head += [f"p50 / p90 ms (batch {b})" for b in batches]
    head += [f"speed-up (batch {big})", "accuracy", "change (points)", f"agreement with {ref}"]
    lines += ["## Models", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [f"`{r['name']}`", r["format"], f"{r['size_bytes'] / 1e6:.2f}",
                 f"{r['size_bytes'] / by_name[ref]['size_bytes']:.2f}x"]
        cells += [f"{r['latency_ms'][b]['p50']:.2f} / {r['latency_ms'][b]['p90']:.2f}"
                  for b in batches]
        cells += [f"{by_name[ref]['latency_ms'][big]['p50'] / r['latency_ms'][big]['p50']:.2f}x",
                  f"{r['accuracy']:.2%}", f"{(r['accuracy'] - by_name[ref]['accuracy']) * 100:+.2f}",
                  f"{r['agreement']:.2%} ({r['flipped_predictions']} flipped)"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"![latency against size](latency-vs-size.png)", ""]
    if report["training"]:
        lines += ["## Training", "", "| model | precision | device | seconds | samples/s | "
                  "peak memory (MB) | checkpoint (MB) | model.pt (MB) | test accuracy | "
                  "skipped steps |", "|" + "---|" * 10]
        for name, t in report["training"].items():
            lines.append(f"| `{name}` | {t['precision']} | {t['device']} | {t['seconds']:.1f} | "
                         f"{t['samples_per_second']:.0f} | {t['peak_memory_bytes'] / 1e6:.0f} | "
                         f"{t['checkpoint_bytes'] / 1e6:.2f} | {t['model_bytes'] / 1e6:.2f} | "
                         f"{t['test_accuracy']:.2%} | {t['skipped_steps']} |")
        method = next(iter(report["training"].values()))["peak_memory_method"]
        lines += ["", f"Peak memory is {method}. {report['amp_vs_quantization']}", ""]
    env = report["environment"]
    lines += ["## Environment", "",
              f"CPU {env['cpu']['model']} ({', '.join(env['cpu']['flags']) or 'no int8/bf16 flags'})"
              f", {env['threads']} threads for PyTorch and ONNX Runtime alike; "
              + ", ".join(f"{k} {v}" for k, v in env["versions"].items()) + ".",
              "Latency: p50/p90 of repeated calls on random inputs of the real shape after warm-up;"
              " accuracy on the test split, which calibration never sees.", ""]
    return "\n".join(lines)


def run(config, run: Run) -> dict:
    import torch

    threads = config.threads or min(os.cpu_count() or 1, 8)
    torch.set_num_threads(threads)
    rows, reference = measure_variants(run, config, threads)
    batch = str(config.batch_sizes[-1])
    training = training_rows(run)
    report = {
        "run": run.name, "reference": reference, "config": asdict(config) | {"threads": threads},
        "models": rows, "training": training,
        "verdict": verdict(rows, reference, config.max_accuracy_drop, batch),
        "warnings": warnings_for(rows, reference, config.max_accuracy_drop, batch),
        "amp_vs_quantization": amp_sentence(training, rows),
        "environment": bench.environment(threads),
    }
    folder = run.root / "report"
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_json(folder / "report.json", report)
    plot_latency_vs_size(rows, batch, folder / "latency-vs-size.png")
    atomic_write_text(folder / "report.md", _markdown(report))
    for name in ("report.json", "report.md", "latency-vs-size.png"):
        run.register(f"report/{name}", folder / name, kind="report", stage="report")
    run.record_config("report", asdict(config))
    return report


def summary_table(report: dict) -> str:
    """The few numbers printed at the end of `pipeline report`."""
    batches = [str(b) for b in report["config"]["batch_sizes"]]
    ref = {r["name"]: r for r in report["models"]}[report["reference"]]
    header = f"{'variant':<14}{'MB':>8}{'acc':>8}" + "".join(f"{'ms@' + b:>10}" for b in batches)
    header += f"{'x faster':>10}"
    lines = [header]
    for r in report["models"]:
        line = f"{r['name']:<14}{r['size_bytes'] / 1e6:>8.2f}{r['accuracy']:>8.2%}"
        line += "".join(f"{r['latency_ms'][b]['p50']:>10.2f}" for b in batches)
        line += f"{ref['latency_ms'][batches[-1]]['p50'] / r['latency_ms'][batches[-1]]['p50']:>9.2f}x"
        lines.append(line)
    lines.append(f"recommended: {report['verdict']['recommended']}")
    return "\n".join(lines)

