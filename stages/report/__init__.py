"""Measure every variant of a run the same way and write report.md, report.json and plots.

Same images, same random latency inputs, same thread count for every runtime, all on the CPU,
every variant timed in the same interleaved rounds, so that the numbers in one report can be
compared with each other. The recommendation is chosen on held-out training images (the
validation split and images calibration did not use); test accuracy is only reported.
"""
from __future__ import annotations

import functools
import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from stages import runtimes
from stages.data.datasets import (
    BASELINE_WORDS,
    SELECTION_WORDS,
    VALIDATION_WORDS,
    selection_set,
    splits_of_run,
    validation_halves,
)
from stages.measure import contention, machine, timing
from stages.measure.evaluate import (
    PARITY_MIN_AGREEMENT,
    compare_logits,
    predict_dataset,
    top_k_hits,
)
from stages.measure.stats import paired_difference_interval, wilson_interval
from stages.report import plots, profile
from stages.report.markdown import compare_markdown, markdown
from stages.run.artifacts import Run, atomic_write_json, atomic_write_text, open_run
from stages.run.errors import PipelineError, UsageError
from stages.run.progress import say
from stages.runtimes import gpu

FIGURES = {"latency-vs-size.png": "latency against size, each batch size",
           "speedup.png": "speed-up against the fastest float variant, and size",
           "training-curves.png": "training curves",
           "lr-range.png": "learning-rate range test"}


def _hits(logits, labels) -> list[bool]:
    return (logits.argmax(1) == labels).tolist()


def _accuracy(hits: list[bool]) -> dict:
    correct = sum(hits)
    return {"accuracy": correct / len(hits), "ci95": wilson_interval(correct, len(hits)),
            "samples": len(hits)}


def _fitted_model(run: Run, name: str) -> str | None:
    """The trained model whose weights ``name`` carries: itself, or the model it was made from."""
    while name is not None and not runtimes.VARIANTS[name].trained:
        name = run.entry(name).get("parent")
    return name


def _one_training(run: Run, a: str | None, b: str | None) -> bool:
    """Whether trained models ``a`` and ``b`` carry the same weights: the same model, or `amp`
    and `fp32` where `amp` trained in fp32 and `fp32` is its copy."""
    if a == b:
        return True
    fp32 = (run.entry("fp32").get("training") or {}) if {a, b} == {"fp32", "amp"} else {}
    return fp32.get("same_run_as") == "amp"


def reference_of(run: Run, names: list[str]) -> str:
    """The model every change is measured against: the trained float model the variants are
    made from, `amp`, so that a variant's change is what quantization did to it. Where `amp`
    is a copy of `fp32` the two are one model and the reference is called `fp32`; a separately
    trained fp32 baseline is a row like the others (its own training's luck would otherwise
    count against every variant: on the digits, bf16 `amp` and `fp32` trained with seed 0 to
    97.50% and 98.61% test, and with seeds 3 to 5 to within 0.3 points of each other)."""
    if "amp" in names and not ("fp32" in names and _one_training(run, "fp32", "amp")):
        return "amp"
    return "fp32" if "fp32" in names else names[0]


def judged_images(run: Run, name: str, reference: str) -> str:
    """What ``name`` is judged against the reference on, in report.json's words. Where its
    weights come from the reference's training (the same images, epochs and precision),
    training images measure what quantization changed, and serve. A model fine-tuned further
    (torch-qat, and ort-qat made from it) fits them differently, so there they would measure
    memorisation: on mnasnet0_5 the float model scored 96.2% on 925 selection images (88.2% on
    its 144 validation ones) and torch-qat 2.3 points less, though level on validation; it is
    judged on the half of the validation split it did not choose its epoch on. So is a model
    trained apart (the fp32 baseline beside a bf16 `amp`), on the whole validation split, on
    which both chose their epoch alike."""
    fitted, reference_fitted = _fitted_model(run, name), _fitted_model(run, reference)
    if _one_training(run, fitted, reference_fitted):
        return SELECTION_WORDS
    return BASELINE_WORDS if fitted in ("fp32", "amp") else VALIDATION_WORDS


def servings(run: Run, config, threads: int, scratch: Path) -> list[tuple[str, str, Callable]]:
    """(row name, variant, loader) of every row: each variant on the CPU, and on a CUDA machine
    (unless --device cpu) the float models as a GPU user serves them (stages/runtimes/gpu)."""
    present = [name for name in runtimes.VARIANTS if name in run.artifacts()]
    if not present:
        raise UsageError(f"run {run.name!r} has no model to report on; run 'pipeline train' first")
    rows = [(name, name, functools.partial(runtimes.load, run, name, threads))
            for name in present]
    if gpu.wanted(config.device):
        rows += [(row, variant, functools.partial(gpu.load, run, row, scratch))
                 for row, variant in gpu.ROWS.items() if variant in present]
    return rows


def measure_variants(run: Run, config, threads: int, scratch: Path) -> tuple[list[dict], dict]:
    """Score every variant on the selection and test images, then time them all together."""
    splits = splits_of_run(run)
    quantized_with = run.recorded_config("quantize")
    selection = selection_set(splits, quantized_with.get("calibration_samples", 512),
                              quantized_with.get("seed", 0))
    # selection_set puts the validation split first; a fine-tuned variant is judged on the half
    # of it that qat did not choose its epoch on.
    judging_half = validation_halves(len(selection.datasets[0]))[1]
    rows, loaded, logits, unmeasured = [], {}, {}, []
    served = servings(run, config, threads, scratch)
    for variant in dict.fromkeys(variant for _, variant, _ in served):
        run.verified_path(variant)  # every file at once: not a tampered one found minutes in
    reference = reference_of(run, [name for name, _, _ in served])
    for name, variant, load in served:
        say(f"report: loading and scoring {name} ...", quiet=config.quiet)
        made = load()
        if made is None:
            unmeasured.append(f"{name} not measured: ONNX Runtime here has no CUDA execution "
                              "provider (install onnxruntime-gpu in place of onnxruntime)")
            continue
        loaded[name] = made
        entry = run.entry(variant)
        val_logits, val_labels = predict_dataset(made.predict, selection)
        test_logits, test_labels = predict_dataset(made.predict, splits.test)
        logits[name] = test_logits
        row = {"name": name, "variant": variant, "device": made.device,
               "format": entry["format"], "path": entry["path"], "serving": made.serving,
               "int8": runtimes.VARIANTS[variant].int8, "size_bytes": run.shipped_bytes(variant),
               "parent": entry.get("parent"), "quantization": entry.get("quantization"),
               "op_counts": made.op_counts, "test": _accuracy(_hits(test_logits, test_labels))}
        images = judged_images(run, variant, reference)
        row["_judged"] = {SELECTION_WORDS: list(range(len(selection))),
                          BASELINE_WORDS: list(range(len(selection.datasets[0]))),
                          VALIDATION_WORDS: judging_half}[images]
        hits = _hits(val_logits, val_labels)
        row["validation"] = _accuracy([hits[i] for i in row["_judged"]]) | {"images": images}
        row["accuracy"], row["accuracy_ci95"] = row["test"]["accuracy"], row["test"]["ci95"]
        row["_hits"] = {"validation": _hits(val_logits, val_labels),
                        "test": _hits(test_logits, test_labels)}
        if splits.num_classes > 5:
            top5 = top_k_hits(test_logits, test_labels, 5)
            row["top5_accuracy"] = float(top5.float().mean())
        rows.append(row)
    present = [row["name"] for row in rows]
    by_name = {row["name"]: row for row in rows}
    predictions = {name: logits[name].argmax(1) for name in present}
    for row in rows:
        same = predictions[row["name"]] == predictions[reference]
        row["agreement"] = float(same.float().mean())
        row["flipped_predictions"] = int((~same).sum())
        for split in ("validation", "test"):
            judged = row["_judged"] if split == "validation" else range(row[split]["samples"])
            row[split]["change_vs_reference"] = paired_difference_interval(  # the same images
                [by_name[reference]["_hits"][split][i] for i in judged],
                [row["_hits"][split][i] for i in judged])
    timings, conditions = time_variants(loaded, splits, config, threads)
    for row in rows:
        row["latency_ms"] = {b: t[row["name"]].summary() | {"rounds_ms": [
            [s * 1000 for s in calls] for calls in t[row["name"]].rounds]}
            for b, t in timings.items()}
        row.pop("_hits"), row.pop("_judged")
        if row["device"] == "cuda" and loaded[row["name"]].timer == "cuda-events":
            largest = timing.random_batch(splits.input_shape(max(config.batch_sizes)))
            row["peak_gpu_memory_bytes"] = gpu.peak_memory(loaded[row["name"]].call_for(largest))
    speedups(rows, reference)
    return rows, {"reference": reference, "parity": parity(run, logits),
                  "unmeasured": unmeasured, "timing_conditions": conditions,
                  "profiles": profiled(loaded, rows, reference, config, splits)}


def profiled(loaded: dict, rows: list[dict], reference: str, config, splits) -> dict | None:
    """Where the time goes (stages/report/profile.py), for the CPU variants the verdict
    will name, while they are still loaded."""
    cpu_rows = on_device(rows, "cpu")
    if not cpu_rows:
        return None
    chosen = verdict(cpu_rows, reference, config.max_accuracy_drop)
    say(f"report: profiling where {chosen['recommended']}'s time goes ...", quiet=config.quiet)
    batch = timing.random_batch(splits.input_shape(int(chosen["batch_size"])))
    return profile.measure({name: loaded[name] for name in (r["name"] for r in cpu_rows)},
                           cpu_rows, chosen, batch)


def time_variants(loaded: dict, splits, config, threads: int,
                  meter: contention.Meter | None = None
                  ) -> tuple[dict[str, dict[str, timing.Timing]], dict]:
    """Every variant of a device in the same interleaved rounds, batch size by batch size,
    until every speed-up against that device's fastest float variant is known to within
    --target-interval. GPU rows are timed by CUDA events where they run on PyTorch's stream.
    A batch size timed while other processes took the cores is timed again
    (stages/measure/contention.py); also returned: what each was timed beside."""
    timings: dict[str, dict[str, timing.Timing]] = {}
    watch = contention.Watch(threads, meter)
    for device in sorted({item.device for item in loaded.values()}, key=DEVICES.index):
        on_device = {name: item for name, item in loaded.items() if item.device == device}
        floats = {name for name in on_device if not _is_int8(name)}
        timers = {name: _timer(item) for name, item in on_device.items()}
        for size in config.batch_sizes:
            say(f"report: timing {len(on_device)} variants on the {device.upper()} at batch "
                f"{size} ...", quiet=config.quiet)
            batch = timing.random_batch(splits.input_shape(size))
            calls = {name: item.call_for(batch) for name, item in on_device.items()}
            timings.setdefault(str(size), {}).update(watch.time(device, size, functools.partial(
                timing.interleaved, calls, config.rounds, config.repeats, config.warmup,
                max_rounds=config.max_rounds,
                done=timing.narrow_enough(floats, config.target_interval),
                budget_seconds=config.timing_budget, timers=timers)))
    return timings, watch.record()


DEVICES = ["cpu", "cuda"]


def _is_int8(row_name: str) -> bool:
    return runtimes.VARIANTS[gpu.ROWS.get(row_name, row_name)].int8


def _timer(item):
    if item.timer != "cuda-events":
        return timing.wall_timer()
    import torch

    return timing.cuda_timer(lambda: torch.cuda.Event(enable_timing=True))


def faster(slower: dict, row: dict, size: str) -> dict:
    """How many times faster ``row`` ran than ``slower`` at batch ``size``, with its interval
    (from the call times of each round, kept in the report)."""
    return timing.speedup(timing.Timing(slower["latency_ms"][size]["rounds_ms"]),
                          timing.Timing(row["latency_ms"][size]["rounds_ms"]))


def on_device(rows: list[dict], device: str) -> list[dict]:
    return [row for row in rows if row.get("device", "cpu") == device]


def device_reference(rows: list[dict], reference: str, device: str) -> str:
    """The reference eager on the CPU; on the GPU, `fp32` eager there (or the first GPU row)."""
    names = [row["name"] for row in on_device(rows, device)]
    wanted = reference if device == "cpu" else gpu.REFERENCE
    return wanted if wanted in names else names[0]


def speedups(rows: list[dict], reference: str) -> None:
    """Each variant's speed-up against the reference eager and against the fastest float
    variant at the same batch size on its own device, as ratios of medians with bootstrap
    intervals over the rounds: a GPU row is never compared with a CPU one."""
    for device in DEVICES:
        group = on_device(rows, device)
        if not group:
            continue
        own_reference = {row["name"]: row for row in group}[
            device_reference(rows, reference, device)]
        for size in group[0]["latency_ms"]:
            best_float = min((r for r in group if not r["int8"]),
                             key=lambda r: r["latency_ms"][size]["p50"])
            for row in group:
                row.setdefault("speedup_vs_reference", {})[size] = faster(own_reference, row,
                                                                          size)
                row.setdefault("speedup_vs_best_float", {})[size] = faster(
                    best_float, row, size) | {"best_float": best_float["name"]}


def parity(run: Run, logits: dict) -> list[dict]:
    """Each variant against its float source, PyTorch's int8 against ONNX Runtime's, and each
    GPU row against the same model on the CPU."""
    pairs = [(runtimes.VARIANTS[n].source and run.entry(n).get("parent"), n) for n in logits
             if n in runtimes.VARIANTS]
    pairs += [("torch-static", "ort-static"), ("torch-qat", "ort-qat")]
    pairs += [(gpu.ROWS[n], n) for n in logits if n in gpu.ROWS]
    found = []
    for a, b in dict.fromkeys(pairs):  # ort-qat's parent is torch-qat: that pair came twice
        if a in logits and b in logits:
            measured = compare_logits(logits[a], logits[b])
            found.append({"a": a, "b": b, **measured,
                          "within_bounds": measured["top1_agreement"] >= PARITY_MIN_AGREEMENT})
    return found


def training_rows(run: Run) -> dict:
    rows = {}
    for name in ("fp32", "amp"):
        entry = run.artifacts().get(name)
        if entry and entry.get("training"):
            rows[name] = {**entry["training"], "checkpoint_bytes": entry["checkpoint_bytes"],
                          "model_bytes": entry["bytes"], "chosen": entry.get("chosen")}
    return rows


def learning_rate_of(run: Run) -> dict:
    """The peak learning rate training used and how it was found (`--lr`, or the range test
    whose curve the run keeps)."""
    recorded = run.recorded_config("train")
    if not recorded:
        return {}
    found = {"value": recorded.get("resolved_lr", recorded.get("lr")),
             "found_by": "range test" if recorded.get("lr") == "auto" else "--lr"}
    if "lr-range" in run.artifacts():
        found["curve"] = json.loads(run.verified_path("lr-range").read_text())
    return found


def _drop(row: dict, split: str = "validation") -> float:
    """Points of accuracy lost against the reference on ``split`` (negative: gained)."""
    return -row[split]["change_vs_reference"]["difference"] * 100


def _worst_drop(row: dict) -> float:
    """What a variant may lose at worst on the held-out images (one-sided 95%): what the
    accuracy budget holds, as in quantize (stages/quantization/tuning.py)."""
    return -row["validation"]["change_vs_reference"]["worst"] * 100


def verdict(rows: list[dict], reference: str, budget_points: float) -> dict:
    """Per batch size, the fastest variant within the accuracy budget on the held-out images
    at 95% confidence; the recommendation is the one for the largest batch size. Ranked by
    speed-up against the fastest float variant; 'within noise' names variants whose speed
    cannot be told apart."""
    by_name = {row["name"]: row for row in rows}
    within = [r for r in rows if _worst_drop(r) <= budget_points + 1e-9]
    sizes = list(rows[0]["latency_ms"])
    per_batch = {}
    for size in sizes:
        ranked = sorted(within, key=lambda r: r["latency_ms"][size]["p50"])
        best = ranked[0]
        ties = [r["name"] for r in ranked[1:] if timing.within_noise(faster(r, best, size))]
        vs_float = best["speedup_vs_best_float"][size]
        per_batch[size] = {
            "recommended": best["name"], "int8": best["int8"],
            "p50_ms": best["latency_ms"][size]["p50"],
            "speedup_vs_reference": best["speedup_vs_reference"][size],
            "speedup_vs_best_float": vs_float, "best_float": vs_float["best_float"],
            "within_noise_of": ties}
    largest = max(sizes, key=int)  # whatever order --batch-sizes listed them in
    best = by_name[per_batch[largest]["recommended"]]
    ref = by_name[reference]
    test_change = best["test"]["change_vs_reference"]
    return {"recommended": best["name"], "batch_size": int(largest),
            "chosen_on": best["validation"]["images"],
            "per_batch_size": per_batch,
            "speedup": per_batch[largest]["speedup_vs_reference"]["ratio"],
            "speedup_vs_best_float": per_batch[largest]["speedup_vs_best_float"]["ratio"],
            "size_ratio": best["size_bytes"] / ref["size_bytes"],
            "validation_change_points": -_drop(best),
            "validation_worst_change_points": -_worst_drop(best),
            "accuracy_change_points": test_change["difference"] * 100,
            "accuracy_change_ci95_points": [test_change["low"] * 100, test_change["high"] * 100],
            "test_accuracy": best["test"]["accuracy"],
            "max_accuracy_drop_points": budget_points, "reference": reference}


NO_VNNI = ("this CPU has no VNNI, so int8 kernels multiply through 16-bit steps that saturate "
           "(oneDNN's 'Nuances of int8 computations') and run little faster than float ones; "
           "int8 pays on CPUs with AVX-512 VNNI, AVX-VNNI or AMX")


def diagnose_slow(row: dict, vnni: bool = True) -> str:
    """Why an int8 variant is slow, read from what it contains rather than from its name;
    on a CPU without VNNI, that its int8 kernels gain little over float there."""
    cause = _contents_cause(row)
    return cause if vnni or "Integer" in cause else f"{cause}; and {NO_VNNI}"


def _contents_cause(row: dict) -> str:
    counts = row["op_counts"]
    ops = {op for c in counts.values() for op in c.get("ops", {})}
    quantization = row.get("quantization") or {}
    total = {kind: c["int8"] + c["float"] for kind, c in counts.items()}
    if any(op.endswith("Integer") for op in ops):
        integer = sorted(op for op in ops if op.endswith("Integer"))
        return (f"its int8 layers run as {', '.join(integer)} (dynamic quantization), which "
                "ONNX Runtime executes without fused int8 kernels; a static QDQ model avoids that")
    if quantization.get("format") == "QOperator":
        return ("a QOperator graph runs per-channel int8 convolutions on slow reference kernels; "
                "use the QDQ format")
    float_left = {k: c["float"] for k, c in counts.items() if c["float"]}
    if float_left and (quantization.get("options") or {}).get("dynamic"):
        parts = ", ".join(f"its {n} {k} layers" for k, n in float_left.items())
        return (f"dynamic int8 quantizes the fully connected layers alone, and {parts} run in "
                "float as in the float model; static int8 quantizes them")
    if float_left:
        parts = ", ".join(f"{n} of {total[k]} {k}" for k, n in float_left.items())
        return (f"{parts} layers still run in float, so it pays for quantizing and "
                "dequantizing around them")
    return ("every Conv/Linear layer runs in int8, so the time goes to what is not int8 "
            "(quantize/dequantize steps, pooling, normalisation) or to per-call overhead")


def _measured_time(profiles: dict | None, name: str, size: str) -> str:
    top = profile.top_operators(profiles, name) if profiles and str(
        profiles["batch_size"]) == size else None
    return f" Measured at batch {size}, its time goes to {top}." if top else ""


def warnings_for(rows: list[dict], reference: str, budget_points: float,
                 training: dict, profiles: dict | None = None, vnni: bool = True) -> list[str]:
    """Results that defeat their purpose, each with its cause."""
    by_name = {row["name"]: row for row in rows}
    found = []
    for row in rows:
        if not row["int8"]:
            continue
        for size, ratio in row["speedup_vs_best_float"].items():
            if ratio["high"] < 1.0:
                found.append(f"{row['name']} is slower than the fastest float variant "
                             f"{ratio['best_float']} at batch {size} "
                             f"({row['latency_ms'][size]['p50']:.2f} ms against "
                             f"{by_name[ratio['best_float']]['latency_ms'][size]['p50']:.2f} ms):"
                             f" {diagnose_slow(row, vnni)}."
                             + _measured_time(profiles, row["name"], size))
        if _worst_drop(row) > budget_points:
            found.append(f"{row['name']} may lose up to {_worst_drop(row):.2f} points of "
                         f"held-out accuracy against {reference} at 95% confidence (measured: "
                         f"{-_drop(row):+.2f}), more than the budget of {budget_points:g}.")
    baseline = by_name.get("fp32")
    if baseline and reference != "fp32":
        gain = baseline["validation"]["change_vs_reference"]
        if gain["worst"] * 100 > budget_points:
            found.append(f"{reference} scores {gain['difference'] * 100:.2f} points below the fp32 "
                         f"baseline on held-out images (at least {gain['worst'] * 100:.2f} at 95% "
                         f"confidence), more than the budget of {budget_points:g}: every variant "
                         f"is made from {reference}, so its training lost that much; train again "
                         "with --precision fp32, or check its skipped steps.")
    for name, result in training.items():
        if result.get("val_at_chance"):
            found.append(f"{name} learned its training images but its validation accuracy "
                         f"({result['val_accuracy']:.1%}) stayed at chance: no variant of it is "
                         "worth shipping; check the labels, the split, and any layer that "
                         "behaves differently in evaluation (BatchNorm statistics that never "
                         "settled, dropout).")
    return found


def parity_warnings(pairs: list[dict]) -> list[str]:
    return [f"{p['b']} agrees with {p['a']} on only {p['top1_agreement']:.1%} of test images "
            f"(max logit difference {p['max_abs_diff']:.3g}), below "
            f"{PARITY_MIN_AGREEMENT:.0%}." for p in pairs if not p["within_bounds"]]


def isa_note(environment: dict) -> list[str]:
    capped = environment["isa"]["onednn_max_cpu_isa"]
    if capped == "not capped":
        return []
    return [f"oneDNN was capped at {capped} in this process (bf16 training on an AMX CPU, "
            "whose AMX bf16 kernels gave NaN at random steps), so PyTorch's int8 timings here "
            "exclude AMX; run 'pipeline report' on its own to time them with AMX."]


def _histories(run: Run) -> dict[str, list[dict]]:
    histories = {}
    for name in ("fp32", "amp"):
        if f"{name}/metrics" in run.artifacts():
            text = run.verified_path(f"{name}/metrics").read_text()
            histories[name] = [json.loads(line) for line in text.splitlines() if line.strip()]
    fp32 = run.artifacts().get("fp32", {}).get("training") or {}
    if fp32.get("same_run_as") == "amp" and "amp" in histories:  # one run, both names
        histories = {"amp = fp32 (one fp32 run)": histories["amp"]}
    return histories


def _gpu_note(config, gpu_rows: list[dict], unmeasured: list[str]) -> str:
    if gpu_rows:
        return "; ".join(unmeasured)
    if config.device == "cpu":
        return "GPU rows not measured: --device cpu"
    return "no GPU: GPU rows not measured (PyTorch finds no CUDA device here)"


def run(config, run: Run) -> dict:
    import torch

    threads = config.threads or min(os.cpu_count() or 1, 8)
    torch.set_num_threads(threads)
    compared = [open_run(run.artifacts_dir, name) for name in config.compare if name != run.name]
    with tempfile.TemporaryDirectory() as scratch:
        rows, measured = measure_variants(run, config, threads, Path(scratch))
    reference, conditions = measured["reference"], measured["timing_conditions"]
    training = training_rows(run)
    histories = _histories(run)
    environment = machine.environment(threads)
    folder = run.root / "report"
    folder.mkdir(parents=True, exist_ok=True)
    figures = dict(FIGURES)
    plots.latency_vs_size(rows, folder / "latency-vs-size.png")
    plots.speedup_and_size(rows, reference, folder / "speedup.png")
    if histories:
        plots.training_curves(histories, folder / "training-curves.png")
    else:
        figures.pop("training-curves.png")
    learning_rate = learning_rate_of(run)
    if learning_rate.get("curve"):
        plots.lr_range(learning_rate["curve"], folder / "lr-range.png")
    else:
        figures.pop("lr-range.png")
    gpu_rows = on_device(rows, "cuda")
    environment |= {"gpu": gpu.name(), "gpu_rows": bool(gpu_rows),
                    "gpu_note": _gpu_note(config, gpu_rows, measured["unmeasured"])}
    report = {
        "run": run.name, "reference": reference,
        "config": asdict(config) | {"threads": threads}, "models": rows,
        "training": training, "training_history": histories, "learning_rate": learning_rate,
        "verdict": contention.mark_verdict(verdict(
            on_device(rows, "cpu"), reference, config.max_accuracy_drop), conditions, "cpu") | {
            "device": "cpu",
            "gpu": contention.mark_verdict(verdict(
                gpu_rows, device_reference(rows, reference, "cuda"), config.max_accuracy_drop),
                conditions, "cuda") | {"device": "cuda"} if gpu_rows else None},
        "warnings": contention.warnings(conditions)
        + warnings_for(rows, reference, config.max_accuracy_drop, training,
                       measured["profiles"], machine.cpu_has_vnni())
        + parity_warnings(measured["parity"]) + profile.failures(measured["profiles"])
        + isa_note(environment)
        + [f"{name} (quantize): {why}" for name, why in run.recorded_config(
            "quantize").get("not_kept", {}).items()],
        "parity": measured["parity"], "figures": figures, "environment": environment,
        "timing_conditions": conditions, "profiles": measured["profiles"],
    }
    atomic_write_json(folder / "report.json", report)
    atomic_write_text(folder / "report.md", markdown(report))
    for name in ["report.json", "report.md", *figures]:
        run.register(f"report/{name}", folder / name, kind="report", stage="report")
    if compared:
        summary, text = compare_markdown([run, *compared])
        atomic_write_json(folder / "compare.json", summary)
        atomic_write_text(folder / "compare.md", text)
        for name in ("compare.json", "compare.md"):
            run.register(f"report/{name}", folder / name, kind="report", stage="report")
    run.record_config("report", asdict(config))
    check_gates(config, report["verdict"], folder)
    return report


def check_gates(config, v: dict, folder) -> None:
    """--fail-under-speedup (against fp32 eager) and --fail-under-float-speedup (against the
    fastest float variant): a CI gate fails once the report is written."""
    best_float = v["per_batch_size"][str(v["batch_size"])]["best_float"]
    gates = (("--fail-under-speedup", config.fail_under_speedup, v["speedup"], v["reference"]),
             ("--fail-under-float-speedup", config.fail_under_float_speedup,
              v["speedup_vs_best_float"], f"the fastest float variant, {best_float},"))
    for flag, gate, ratio, against in gates:
        if gate and ratio < gate:
            raise PipelineError(f"the recommended variant {v['recommended']} is {ratio:.2f}x as "
                                f"fast as {against} at batch {v['batch_size']}, under {flag} "
                                f"{gate:g} (report written to {folder})")


def summary_table(report: dict) -> str:
    """The few numbers printed at the end of `pipeline report`."""
    sizes = [str(b) for b in report["config"]["batch_sizes"]]
    header = f"{'variant':<20}{'device':>7}{'MB':>8}{'test acc':>10}" + "".join(
        f"{'ms@' + b:>10}" for b in sizes) + f"{'vs best float':>15}"
    lines = [header]
    for r in report["models"]:
        ratio = r["speedup_vs_best_float"][sizes[-1]]["ratio"]
        lines.append(f"{r['name']:<20}{r.get('device', 'cpu'):>7}{r['size_bytes'] / 1e6:>8.2f}"
                     f"{r['accuracy']:>10.2%}"
                     + "".join(f"{r['latency_ms'][b]['p50']:>10.2f}" for b in sizes)
                     + f"{ratio:>14.2f}x")
    for v in filter(None, (report["verdict"], report["verdict"].get("gpu"))):
        lines.append(f"recommended on the {v.get('device', 'cpu').upper()}: {v['recommended']} "
                     f"({v['speedup']:.2f}x faster than {v['reference']}, "
                     f"{v['speedup_vs_best_float']:.2f}x the fastest float, "
                     f"{v['size_ratio']:.2f}x the size, {v['accuracy_change_points']:+.2f} "
                     "points on the test split)")
    note = report["environment"].get("gpu_note")
    lines += [note] if note and not report["verdict"].get("gpu") else []
    return "\n".join(lines + contention.warnings(report.get("timing_conditions")))


__all__ = ["run", "summary_table", "compare_markdown", "open_run"]
