"""Measure every variant of a run the same way and write report.md, report.json and a plot.

Same test images, same random latency inputs, same thread count for PyTorch and ONNX Runtime,
all on the CPU, so that the numbers in one report can be compared with each other.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict

from stages import bench, export, opstats, plots, tuning
from stages.artifacts import Run, atomic_write_json, atomic_write_text, open_run
from stages.errors import PipelineError, UsageError
from stages.progress import say
from stages.quantize import load_torch_model
from stages.stats import paired_difference_interval, wilson_interval
from stages.train import predict_dataset, splits_of_run

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
QOPERATOR_CAUSE = ("a QOperator graph runs per-channel int8 convolutions on slow reference kernels;"
                   " use the QDQ format")
FIGURES = {"latency-vs-size.png": "latency against size",
           "speedup-and-size.png": "speed-up and size against fp32",
           "training-curves.png": "training curves"}


def _predictor(run: Run, name: str, threads: int):
    """A function from a float tensor batch to logits, a latency call factory, and the model's
    int8/float op counts."""
    entry = run.entry(name)
    if entry["format"] == "onnx":
        path = run.verified_path(name)
        session = export.ort_session(path, threads)
        return (lambda images: export.ort_predict(session, images),
                lambda batch: bench.ort_call(session, batch), opstats.onnx_op_counts(path))
    from stages.train import predict

    model = load_torch_model(run, name)
    return (lambda images: predict(model, images), lambda batch: bench.torch_call(model, batch),
            opstats.torch_op_counts(model))


def _shipped_bytes(run: Run, name: str) -> int:
    entry = run.entry(name)
    path = run.root / entry["path"]
    return export.onnx_size_bytes(path) if entry["format"] == "onnx" else path.stat().st_size


def measure_variants(run: Run, config, threads: int) -> tuple[list[dict], str, list[dict]]:
    artifacts = run.artifacts()
    present = [v for v in VARIANTS if v in artifacts]
    if not present:
        raise UsageError(f"run {run.name!r} has no model to report on; run 'pipeline train' first")
    splits = splits_of_run(run)
    reference = "fp32" if "fp32" in present else present[0]
    rows, predictions, hits, all_logits = [], {}, {}, {}
    for name in present:
        say(f"report: measuring {name} ...", quiet=config.quiet)
        predict_fn, call_for, op_counts = _predictor(run, name, threads)
        logits, labels = predict_dataset(predict_fn, splits.test)
        all_logits[name] = logits
        predictions[name] = logits.argmax(1)
        hits[name] = (predictions[name] == labels).tolist()
        latency = {}
        for batch_size in config.batch_sizes:
            batch = bench.random_batch(splits.input_shape(batch_size))
            latency[str(batch_size)] = bench.measure(call_for(batch), config.warmup,
                                                     config.repeats,
                                                     config.max_seconds_per_measurement)
        entry = artifacts[name]
        correct = sum(hits[name])
        row = {"name": name, "format": entry["format"], "path": entry["path"],
               "size_bytes": _shipped_bytes(run, name), "accuracy": correct / len(labels),
               "accuracy_ci95": wilson_interval(correct, len(labels)),
               "test_samples": len(labels), "latency_ms": latency,
               "parent": entry.get("parent"), "quantization": entry.get("quantization"),
               "op_counts": op_counts}
        if splits.num_classes > 5:
            top5 = logits.topk(5, dim=1).indices.eq(labels[:, None]).any(dim=1)
            row["top5_accuracy"] = float(top5.float().mean())
        rows.append(row)
    for row in rows:
        same = predictions[row["name"]] == predictions[reference]
        row["agreement"] = float(same.float().mean())
        row["flipped_predictions"] = int((~same).sum())
        row["agreement_reference"] = reference
        row["accuracy_change_vs_reference"] = paired_difference_interval(hits[reference],
                                                                         hits[row["name"]])
    return rows, reference, parity(all_logits)


# Each quantized variant against its float source, and the two backends' int8 against each other.
PARITY_PAIRS = [("amp", "torch-dynamic"), ("amp", "torch-static"), ("amp", "onnx-fp32"),
                ("onnx-fp32", "ort-dynamic"), ("onnx-fp32", "ort-static"),
                ("torch-dynamic", "ort-dynamic"), ("torch-static", "ort-static")]
PARITY_MIN_AGREEMENT = 0.98


def parity(logits: dict) -> list[dict]:
    """Max logit difference and top-1 agreement on the test images, for each pair present."""
    found = []
    for a, b in PARITY_PAIRS:
        if a in logits and b in logits:
            found.append({"a": a, "b": b, **export.compare_logits(logits[a], logits[b]),
                          "within_bounds": bool(float((logits[a].argmax(1) == logits[b].argmax(1))
                                                      .float().mean()) >= PARITY_MIN_AGREEMENT)})
    return found


def training_rows(run: Run) -> dict:
    rows = {}
    for name in ("fp32", "amp"):
        if name in run.artifacts():
            entry = run.entry(name)
            rows[name] = {**entry["training"], "checkpoint_bytes": entry["checkpoint_bytes"],
                          "model_bytes": entry["bytes"]}
    return rows


def parity_warnings(pairs: list[dict]) -> list[str]:
    return [f"{p['b']} agrees with {p['a']} on only {p['top1_agreement']:.1%} of test images "
            f"(max logit difference {p['max_abs_diff']:.3g}), below "
            f"{PARITY_MIN_AGREEMENT:.0%}." for p in pairs if not p["within_bounds"]]


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
                if (row.get("quantization") or {}).get("format") == "QOperator":
                    cause = QOPERATOR_CAUSE
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
    change = best.get("accuracy_change_vs_reference", {})
    return {"recommended": best["name"], "batch_size": int(batch),
            "speedup": ref["latency_ms"][batch]["p50"] / best["latency_ms"][batch]["p50"],
            "size_ratio": best["size_bytes"] / ref["size_bytes"],
            "accuracy_change_points": (best["accuracy"] - ref["accuracy"]) * 100,
            "accuracy_change_ci95_points": [change.get("low", 0.0) * 100,
                                            change.get("high", 0.0) * 100],
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


def _pct_interval(low: float, high: float) -> str:
    return f"{low:.1%}–{high:.1%}"


def _verdict_paragraph(report: dict) -> str:
    v, ref = report["verdict"], report["reference"]
    low, high = v["accuracy_change_ci95_points"]
    noise = ("within the noise of this test split" if low <= 0 <= high
             else "a real difference on this test split")
    return (f"**Ship `{v['recommended']}`.** Of the variants within "
            f"{v['max_accuracy_drop_points']:g} point(s) of `{ref}`'s test accuracy, it has the "
            f"lowest p50 latency at batch {v['batch_size']}: {v['speedup']:.2f}x faster than "
            f"`{ref}` and {v['size_ratio']:.2f}x its size, with an accuracy change of "
            f"{v['accuracy_change_points']:+.2f} points (95% interval {low:+.2f} to {high:+.2f}, "
            f"{noise}). " + report["amp_vs_quantization"])


def _markdown(report: dict) -> str:
    ref = report["reference"]
    rows = report["models"]
    by_name = {r["name"]: r for r in rows}
    batches = [str(b) for b in report["config"]["batch_sizes"]]
    big = batches[-1]
    lines = [f"# Report for run `{report['run']}`", "", _verdict_paragraph(report), ""]
    if report["warnings"]:
        lines += ["## Warnings", ""] + [f"- {w}" for w in report["warnings"]] + [""]
    head = ["variant", "format", "size (MB)", "size vs fp32"]
    head += [f"p50 / p90 ms (batch {b})" for b in batches]
    head += [f"speed-up (batch {big})", "accuracy (95% CI)", "top-5",
             "change in points (95% CI)", f"agreement with {ref}"]
    lines += ["## Models", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        change = r["accuracy_change_vs_reference"]
        cells = [f"`{r['name']}`", r["format"], f"{r['size_bytes'] / 1e6:.2f}",
                 f"{r['size_bytes'] / by_name[ref]['size_bytes']:.2f}x"]
        cells += [f"{r['latency_ms'][b]['p50']:.2f} / {r['latency_ms'][b]['p90']:.2f}"
                  for b in batches]
        cells += [f"{by_name[ref]['latency_ms'][big]['p50'] / r['latency_ms'][big]['p50']:.2f}x",
                  f"{r['accuracy']:.2%} ({_pct_interval(*r['accuracy_ci95'])})",
                  f"{r['top5_accuracy']:.2%}" if "top5_accuracy" in r else "-",
                  "reference" if r["name"] == ref else
                  f"{change['difference'] * 100:+.2f} ({change['low'] * 100:+.2f} to "
                  f"{change['high'] * 100:+.2f})",
                  f"{r['agreement']:.2%} ({r['flipped_predictions']} flipped)"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Accuracy on {rows[0]['test_samples']} test images; intervals: Wilson for one "
              "accuracy, Newcombe's paired method for the change against "
              f"`{ref}` on the same images.", ""]
    lines += [f"![{title}]({name})" for name, title in report["figures"].items()
              if name != "training-curves.png"] + [""]
    lines += _quantization_markdown(report)
    if report["training"]:
        lines += ["## Training", "", report["amp_vs_quantization"], "",
                  "| model | precision | device | seconds | samples/s | peak memory (MB) | "
                  "checkpoint (MB) | model.pt (MB) | test accuracy | skipped steps |",
                  "|" + "---|" * 10]
        for name, t in report["training"].items():
            lines.append(f"| `{name}` | {t['precision']} | {t['device']} | {t['seconds']:.1f} | "
                         f"{t['samples_per_second']:.0f} | {t['peak_memory_bytes'] / 1e6:.0f} | "
                         f"{t['checkpoint_bytes'] / 1e6:.2f} | {t['model_bytes'] / 1e6:.2f} | "
                         f"{t['test_accuracy']:.2%} | {t['skipped_steps']} |")
        method = next(iter(report["training"].values()))["peak_memory_method"]
        lines += ["", f"Peak memory is {method}.", ""]
        if "training-curves.png" in report["figures"]:
            lines += ["![training curves](training-curves.png)", ""]
    env = report["environment"]
    lines += ["## Environment", "",
              f"CPU {env['cpu']['model']} ({', '.join(env['cpu']['flags']) or 'no int8/bf16 flags'})"
              f", {env['threads']} threads for PyTorch and ONNX Runtime alike; "
              + ", ".join(f"{k} {v}" for k, v in env["versions"].items()) + ".",
              f"Latency: p50/p90 of up to {report['config']['repeats']} calls on random inputs of "
              f"the real shape after {report['config']['warmup']} warm-up calls; accuracy on the "
              "test split, which training, calibration and model selection never see.", ""]
    return "\n".join(lines)


def _quantization_markdown(report: dict) -> list[str]:
    """What each variant really runs in int8, what stayed float and why, and parity."""
    lines = ["## Quantization", "", "| variant | int8 ops | kept in float | configuration | "
             "chosen because |", "|---|---|---|---|---|"]
    for r in report["models"]:
        info = r.get("quantization") or {}
        record = info.get("tuning") or {}
        options = info.get("options") or {k: info[k] for k in ("types", "per_channel",
                                                               "calibration_method", "format")
                                          if k in info}
        kept = ", ".join(info.get("float_layers") or []) or "-"
        lines.append(f"| `{r['name']}` | {opstats.summarize(r['op_counts'])} | {kept} | "
                     f"{tuning.label(options) if options else '-'} | {record.get('why', '-')} |")
    tried = [(r["name"], r["quantization"]["tuning"]) for r in report["models"]
             if (r.get("quantization") or {}).get("tuning", {}).get("tried", [])[1:]]
    for name, record in tried:
        lines += ["", f"`{name}` configurations tried on {record['images']} held-out training "
                  "images:", "", "| configuration | accuracy change (points) | p50 ms |",
                  "|---|---|---|"]
        for t in record["tried"]:
            ms = f"{t['latency_ms_p50']:.2f}" if t["latency_ms_p50"] is not None else "-"
            lines.append(f"| {t['label']} | {0.0 - t['drop_points']:+.2f} | {ms} |")
    if report["parity"]:
        lines += ["", "| parity on the test images | max logit difference | top-1 agreement |",
                  "|---|---|---|"]
        for p in report["parity"]:
            flag = "" if p["within_bounds"] else " (out of bounds)"
            lines.append(f"| `{p['b']}` vs `{p['a']}` | {p['max_abs_diff']:.3g} | "
                         f"{p['top1_agreement']:.2%}{flag} |")
    return lines + [""]


def compare_runs(runs: list[Run]) -> tuple[dict, str]:
    """Side by side: every variant of every run, from each run's verified report.json."""
    table = {}
    for other in runs:
        try:
            path = other.verified_path("report/report.json")
        except UsageError:
            raise UsageError(f"run {other.name!r} has no report yet; run 'pipeline --run "
                             f"{other.name} report' first") from None
        table[other.name] = json.loads(path.read_text())
    names = [v for v in VARIANTS if any(v in {m["name"] for m in r["models"]}
                                        for r in table.values())]
    lines = ["# Runs side by side", "", "| variant | " + " | ".join(f"`{n}`" for n in table) + " |",
             "|" + "---|" * (len(table) + 1)]
    for variant in names:
        cells = []
        for data in table.values():
            row = next((m for m in data["models"] if m["name"] == variant), None)
            big = str(data["config"]["batch_sizes"][-1])
            cells.append("-" if row is None else
                         f"{row['accuracy']:.2%}, {row['size_bytes'] / 1e6:.2f} MB, "
                         f"{row['latency_ms'][big]['p50']:.2f} ms @{big}")
        lines.append(f"| `{variant}` | " + " | ".join(cells) + " |")
    lines += ["", "| run | recommended | speed-up | size ratio | accuracy change (points) |",
              "|---|---|---|---|---|"]
    for name, data in table.items():
        v = data["verdict"]
        lines.append(f"| `{name}` | `{v['recommended']}` | {v['speedup']:.2f}x | "
                     f"{v['size_ratio']:.2f}x | {v['accuracy_change_points']:+.2f} |")
    lines += ["", "Each run's numbers come from its own report, measured when that report ran."]
    summary = {name: {"verdict": d["verdict"], "models": d["models"],
                      "environment": d["environment"]} for name, d in table.items()}
    return summary, "\n".join(lines) + "\n"


def _histories(run: Run) -> dict[str, list[dict]]:
    histories = {}
    for name in ("fp32", "amp"):
        if f"{name}/metrics" in run.artifacts():
            text = run.verified_path(f"{name}/metrics").read_text()
            histories[name] = [json.loads(line) for line in text.splitlines() if line.strip()]
    return histories


def run(config, run: Run) -> dict:
    import torch

    threads = config.threads or min(os.cpu_count() or 1, 8)
    torch.set_num_threads(threads)
    compared = [open_run(run.artifacts_dir, name) for name in config.compare if name != run.name]
    rows, reference, pairs = measure_variants(run, config, threads)
    batch = str(config.batch_sizes[-1])
    training = training_rows(run)
    histories = _histories(run)
    folder = run.root / "report"
    folder.mkdir(parents=True, exist_ok=True)
    plots.latency_vs_size(rows, batch, folder / "latency-vs-size.png")
    plots.speedup_and_size(rows, reference, batch, folder / "speedup-and-size.png")
    figures = dict(FIGURES)
    if histories:
        plots.training_curves(histories, folder / "training-curves.png")
    else:
        figures.pop("training-curves.png")
    report = {
        "run": run.name, "reference": reference, "config": asdict(config) | {"threads": threads},
        "models": rows, "training": training, "training_history": histories,
        "verdict": verdict(rows, reference, config.max_accuracy_drop, batch),
        "warnings": warnings_for(rows, reference, config.max_accuracy_drop, batch)
        + parity_warnings(pairs),
        "parity": pairs,
        "amp_vs_quantization": amp_sentence(training, rows),
        "figures": figures, "environment": bench.environment(threads),
    }
    atomic_write_json(folder / "report.json", report)
    atomic_write_text(folder / "report.md", _markdown(report))
    for name in ["report.json", "report.md", *figures]:
        run.register(f"report/{name}", folder / name, kind="report", stage="report")
    if compared:
        summary, markdown = compare_runs([run, *compared])
        atomic_write_json(folder / "compare.json", summary)
        atomic_write_text(folder / "compare.md", markdown)
        for name in ("compare.json", "compare.md"):
            run.register(f"report/{name}", folder / name, kind="report", stage="report")
    run.record_config("report", asdict(config))
    gate = config.fail_under_speedup
    if gate and report["verdict"]["speedup"] < gate:
        v = report["verdict"]
        raise PipelineError(f"the recommended variant {v['recommended']} is {v['speedup']:.2f}x "
                            f"as fast as {reference} at batch {v['batch_size']}, under "
                            f"--fail-under-speedup {gate:g} (report written to {folder})")
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
    v = report["verdict"]
    lines.append(f"recommended: {v['recommended']} ({v['speedup']:.2f}x faster, "
                 f"{v['size_ratio']:.2f}x the size, {v['accuracy_change_points']:+.2f} points)")
    return "\n".join(lines)
