"""Measuring the variants: each one scored on the same held-out and test images, compared
with the reference on the same images, and every variant of a device timed in the same
interleaved rounds (stages/measure/timing.py)."""
from __future__ import annotations

import functools
import gc
import json
from pathlib import Path
from typing import Callable

from stages import runtimes
from stages.data.datasets import splits_of_run
from stages.data.subsets import selection_set, validation_halves
from stages.measure import contention, timing
from stages.measure.evaluate import (
    PARITY_MIN_AGREEMENT,
    compare_logits,
    predict_dataset,
    top1_hits,
    top_k_hits,
)
from stages.measure.stats import paired_difference_interval, wilson_interval
from stages.report import profile
from stages.report.judging import (
    BASELINE_WORDS,
    SELECTION_WORDS,
    VALIDATION_WORDS,
    judged_images,
    reference_of,
)
from stages.report.recommendation import (
    DEVICES,
    on_device,
    speedups,
    verdict,
    worst_accuracy_drop,
)
from stages.run.artifacts import Run
from stages.run.errors import UsageError
from stages.run.isolated import Doing
from stages.run.progress import say
from stages.runtimes import gpu


def _hits(logits, labels) -> list[bool]:
    return top1_hits(logits, labels).tolist()


def _accuracy(hits: list[bool]) -> dict:
    correct = sum(hits)
    return {"accuracy": correct / len(hits), "ci95": wilson_interval(correct, len(hits)),
            "samples": len(hits)}


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


def doing_text(row: str, phase: str, batch_size: int | None = None) -> str:
    """What the measuring process is doing, as Doing holds it (stages/report/worker.py)."""
    return json.dumps({"row": row, "phase": phase, "batch_size": batch_size})


def calibrations(run: Run) -> set[tuple[int, int]]:
    """(samples, seed) of each listed variant's quantize: one made by an earlier quantize with
    other settings was calibrated on images the last one's record does not name."""
    return {(entry["config"]["calibration_samples"], entry["config"].get("seed", 0))
            for entry in run.artifacts().values()
            if entry.get("stage") == "quantize" and entry.get("config", {}).get(
                "calibration_samples")}


PEAK_MEMORY_PHASE = "measuring its peak GPU memory"
EXTRAS = ("reading the kernels it runs", "profiling",  # phases a row's figures stand without
          PEAK_MEMORY_PHASE)
# An extras_crashed phase too: the child timing variants below AMX crashed (report/worker.py);
# the comparison with AMX is lost, not any row.
BELOW_AMX_PHASE = "timed below AMX"


def measure_variants(run: Run, config, threads: int, scratch: Path, skip=(), plain=(),
                     doing: Doing = Doing()) -> tuple[list[dict], dict]:
    """Score every variant (every row but those in ``skip``) on the selection and test images,
    then time them all together; ``doing`` is told which row each step runs. The rows in
    ``plain`` get none of the EXTRAS (one crashed the process in them)."""
    splits = splits_of_run(run)
    quantized_with = run.recorded_config("quantize")
    calibrated = (quantized_with.get("calibration_samples", 512), quantized_with.get("seed", 0))
    selection = selection_set(splits, *calibrated, also_calibrated=calibrations(run) - {calibrated})
    rows, loaded, logits, unmeasured = [], {}, {}, []
    served = [row for row in servings(run, config, threads, scratch) if row[0] not in skip]
    if not served:
        raise UsageError(f"run {run.name!r}: no variant could be measured ({', '.join(skip)} "
                         "crashed)")
    for variant in dict.fromkeys(variant for _, variant, _ in served):
        run.verified_path(variant)  # every file at once: not a tampered one found minutes in
    reference = reference_of(run, [name for name, _, _ in served])
    for name, variant, load in served:
        say(f"report: loading and scoring {name} ...", quiet=config.quiet)
        doing(doing_text(name, "loading and scoring"))
        made = load()
        if made is None:
            unmeasured.append(f"{name} not measured: ONNX Runtime here has no CUDA execution "
                              "provider that starts (onnxruntime-gpu in place of onnxruntime, "
                              "with the CUDA and cuDNN libraries it was built for)")
            continue
        loaded[name] = made
        row, logits[name] = score(run, name, variant, made, splits, selection, reference)
        rows.append(row)
    compare_with_reference(rows, logits, reference)
    # The floats speed-ups are credited against (recommendation.speedups): those a user could
    # serve, within the accuracy budget; the timing narrows its intervals against them.
    servable = {r["name"] for r in rows if not r["int8"]
                and worst_accuracy_drop(r) <= config.max_accuracy_drop + 1e-9}
    timings, conditions = time_variants(loaded, splits, config, threads, doing=doing,
                                        floats_within=servable)
    record_latencies(rows, timings, loaded, splits, config, doing, plain)
    record_kernels(rows, loaded, splits, config, doing, plain)
    speedups(rows, reference, config.max_accuracy_drop)
    for name in plain:
        loaded.pop(name, None)
    return rows, {"reference": reference, "parity": parity(run, logits),
                  "unmeasured": unmeasured, "timing_conditions": conditions,
                  "profiles": profiled(loaded, rows, reference, config, splits, doing)}


def score(run: Run, name: str, variant: str, made, splits, selection, reference: str):
    """(report.json's row, test logits) of one loaded variant: what it is, and its accuracy on
    the test split and on the held-out images it is judged on. The row keeps each image's hit
    (``_hits``) and the indices of the held-out images judged (``_judged``, into the selection
    set, which the reference is scored on whole) for compare_with_reference."""
    import torch

    entry = run.entry(variant)
    images = judged_images(run, variant, reference)
    judged = _judged_indices(selection, images)
    # Only the images it is judged on: the fp32 baseline is judged on the validation split, on
    # the digits 144 of the 925 held-out images at 32x32 and of 1,309 at 224x224 (where its
    # scoring in resnet18's report took 10 s instead of 31 on the AMX Xeon).
    val_logits, val_labels = predict_dataset(made.predict, torch.utils.data.Subset(selection,
                                                                                   judged))
    test_logits, test_labels = predict_dataset(made.predict, splits.test)
    hits = {"validation": _hits(val_logits, val_labels), "test": _hits(test_logits, test_labels)}
    row = {"name": name, "variant": variant, "device": made.device,
           "format": entry["format"], "path": entry["path"], "sha256": entry["sha256"],
           "companions_sha256": [f["sha256"] for f in entry.get("files", [])],
           "serving": made.serving,
           "int8": runtimes.VARIANTS[variant].int8, "size_bytes": run.shipped_bytes(variant),
           "precision": "int8" if runtimes.VARIANTS[variant].int8 else made.precision,
           "parent": entry.get("parent"), "quantization": entry.get("quantization"),
           "op_counts": made.op_counts, "test": _accuracy(hits["test"])}
    row["_judged"] = judged
    row["validation"] = _accuracy(hits["validation"]) | {"images": images}
    row["accuracy"], row["accuracy_ci95"] = row["test"]["accuracy"], row["test"]["ci95"]
    row["_hits"] = hits
    if splits.num_classes > 5:
        top5 = top_k_hits(test_logits, test_labels, 5)
        row["top5_accuracy"] = float(top5.float().mean())
    return row, test_logits


def _judged_indices(selection, images: str) -> list[int]:
    """Indices into the selection set of the images ``images`` names. selection_set puts the
    validation split (or its sample) first; a fine-tuned variant is judged on those of its
    images in the half of the split that qat did not choose its epoch on."""
    validation = selection.datasets[0].indices  # into the validation split
    judging = set(validation_halves(len(selection.datasets[0].dataset))[1])
    return {SELECTION_WORDS: list(range(len(selection))),
            BASELINE_WORDS: list(range(len(validation))),
            VALIDATION_WORDS: [i for i, v in enumerate(validation) if v in judging]}[images]


def compare_with_reference(rows: list[dict], logits: dict, reference: str) -> None:
    """Each row's agreement with the reference on the test split, and its change in accuracy
    against it on the same images (paired), on the held-out images it is judged on and on test;
    then the per-image hits leave the row."""
    by_name = {row["name"]: row for row in rows}
    predictions = {name: logits[name].argmax(1) for name in by_name}
    for row in rows:
        same = predictions[row["name"]] == predictions[reference]
        row["agreement"] = float(same.float().mean())
        row["flipped_predictions"] = int((~same).sum())
        for split in ("validation", "test"):
            # A row's hits follow its judged images; the reference's cover every held-out image.
            judged = row["_judged"] if split == "validation" else range(row[split]["samples"])
            row[split]["change_vs_reference"] = paired_difference_interval(  # the same images
                [by_name[reference]["_hits"][split][i] for i in judged], row["_hits"][split])
    for row in rows:
        row.pop("_hits"), row.pop("_judged")


def record_latencies(rows: list[dict], timings: dict, loaded: dict, splits, config,
                     doing: Doing = Doing(), plain=()) -> None:
    """Each row's latency at every batch size (with every round's call times, from which the
    speed-up intervals are drawn), and a GPU row's peak memory at the largest batch (not for
    one in ``plain``: it crashed the process there before)."""
    size = max(config.batch_sizes)
    for row in rows:
        row["latency_ms"] = {b: t[row["name"]].summary() | {"rounds_ms": [
            [s * 1000 for s in calls] for calls in t[row["name"]].rounds]}
            for b, t in timings.items()}
        if (row["device"] == "cuda" and loaded[row["name"]].timer == "cuda-events"
                and row["name"] not in plain):
            doing(doing_text(row["name"], PEAK_MEMORY_PHASE, size))  # a crash costs this one
            largest = timing.random_batch(splits.input_shape(size))
            row["peak_gpu_memory_bytes"] = gpu.peak_memory(loaded[row["name"]].call_for(largest))


def record_kernels(rows: list[dict], loaded: dict, splits, config, doing: Doing,
                   plain=()) -> None:
    """Each CPU row's `kernels` at the largest batch size: the oneDNN kernels one call ran, as
    its runtime names them (None where the runtime does not say: ONNX Runtime, or where
    reading them crashed the process before: ``plain``)."""
    size = max(config.batch_sizes)
    batch = timing.random_batch(splits.input_shape(size))
    for row in rows:
        read = loaded[row["name"]].kernels if row["device"] == "cpu" else None
        row["kernels"] = None
        if row["name"] in plain:
            continue
        if read is not None:
            doing(doing_text(row["name"], "reading the kernels it runs", size))
            try:
                row["kernels"] = dict(sorted(read(batch).items(), key=lambda item: -item[1]))
            except Exception as exc:  # costs the field, not the report
                row["kernels"] = {"error": " ".join(f"{type(exc).__name__}: {exc}".split())[:300]}


def profiled(loaded: dict, rows: list[dict], reference: str, config, splits,
             doing: Doing = Doing()) -> dict | None:
    """Where the time goes (stages/report/profile.py), for the CPU variants the verdict
    will name, while they are still loaded; the others are dropped from ``loaded``."""
    cpu_rows = on_device(rows, "cpu")
    if not cpu_rows:
        return None
    chosen = verdict(cpu_rows, reference, config.max_accuracy_drop)
    # The profiler builds one more session beside every loaded variant (efficientnet_b0 at
    # 224x224: 4.0 GB loaded, 4.8 at the peak of profiling ort-dynamic), so what it does not
    # profile is let go first. (The report's out-of-memory kill at 224x224 was the scoring
    # batches': stages/measure/evaluate.py.)
    profiled_names = {n for pair in profile.chosen_pairs(cpu_rows, chosen) for n in pair if n}
    for name in [n for n in loaded if n not in profiled_names]:
        del loaded[name]
    gc.collect()
    say(f"report: profiling where {chosen['recommended']}'s time goes ...", quiet=config.quiet)
    batch = timing.random_batch(splits.input_shape(int(chosen["batch_size"])))
    return profile.measure({name: loaded[name] for name in (r["name"] for r in cpu_rows)
                            if name in loaded},
                           cpu_rows, chosen, batch, announce=lambda name: doing(
                               doing_text(name, "profiling", int(chosen["batch_size"]))))


def time_variants(loaded: dict, splits, config, threads: int,
                  meter: contention.Meter | None = None, doing: Doing = Doing(),
                  floats_within: set[str] | None = None
                  ) -> tuple[dict[str, dict[str, timing.Timing]], dict]:
    """Every variant of a device in the same interleaved rounds, batch size by batch size,
    until every speed-up against that device's fastest float variant (of ``floats_within``,
    those within the accuracy budget, where any is on the device) is known to within
    --target-interval. GPU rows are timed by CUDA events where they run on PyTorch's stream.
    A batch size timed while other processes took the cores is timed again
    (stages/measure/contention.py); also returned: what each was timed beside."""
    timings: dict[str, dict[str, timing.Timing]] = {}
    watch = contention.Watch(threads, meter)
    for device in sorted({item.device for item in loaded.values()}, key=DEVICES.index):
        on_this_device = {name: item for name, item in loaded.items()
                          if item.device == device}
        floats = {name for name in on_this_device if not _is_int8(name)}
        floats = floats & (floats_within or set()) or floats
        timers = {name: _timer(item) for name, item in on_this_device.items()}
        for size in config.batch_sizes:
            say(f"report: timing {len(on_this_device)} variants on the {device.upper()} at batch "
                f"{size} ...", quiet=config.quiet)
            batch = timing.random_batch(splits.input_shape(size))
            calls = {name: item.call_for(batch) for name, item in on_this_device.items()}
            marks = {name: doing_text(name, "timing", size) for name in calls}
            timings.setdefault(str(size), {}).update(watch.time(device, size, functools.partial(
                timing.interleaved, calls, config.rounds, config.repeats, config.warmup,
                max_rounds=config.max_rounds,
                done=timing.narrow_enough(floats, config.target_interval),
                budget_seconds=config.timing_budget, timers=timers,
                announce=lambda name: doing(marks[name]))))
    return timings, watch.record()


def _is_int8(row_name: str) -> bool:
    return runtimes.VARIANTS[gpu.ROWS.get(row_name, row_name)].int8


def _timer(item):
    if item.timer != "cuda-events":
        return timing.wall_timer()
    import torch

    return timing.cuda_timer(lambda: torch.cuda.Event(enable_timing=True))


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
