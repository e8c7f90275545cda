"""Measure every variant of a run the same way and write report.md, report.json and plots.

Same images, same random latency inputs, same thread count for every runtime, every variant
of a device (the CPU, and a CUDA GPU where there is one) timed in the same interleaved rounds,
so that the numbers in one report can be compared with each other. The recommendation is
chosen on held-out training images (the validation split and images calibration did not use);
test accuracy is only reported.
Measuring is in measuring.py, which variant to recommend in recommendation.py, what is wrong
with a result in diagnosis.py, what each variant is judged against in judging.py; this module
assembles report.json from them and writes the report.
"""
from __future__ import annotations

import json
import tempfile
from dataclasses import asdict
from pathlib import Path

from stages.measure import contention, machine
from stages.measure.timing import within_noise
from stages.report import plots, profile
from stages.report.compare import compare_markdown
from stages.report.diagnosis import (
    amx_warnings,
    crash_warnings,
    extra_crash_warnings,
    isa_note,
    parity_warnings,
    warnings_for,
)
from stages.report.markdown import markdown
from stages.report.recommendation import (
    check_gates,
    device_reference,
    gpu_verdict,
    on_device,
    verdict,
)
from stages.report.worker import measure
from stages.run.artifacts import Run, open_run
from stages.run.files import atomic_write_json, atomic_write_text
from stages.runtimes import gpu, vnni_mismatch

FIGURES = {"latency-vs-size.png": "latency against size, each batch size",
           "speedup.png": "speed-up against the fastest float variant, and size",
           "training-curves.png": "training curves",
           "lr-range.png": "learning-rate range test"}


def training_rows(run: Run) -> dict:
    rows = {}
    for name in ("fp32", "amp"):
        entry = run.artifacts().get(name)
        if entry and entry.get("training"):
            rows[name] = {**entry["training"], "checkpoint_bytes": entry["checkpoint_bytes"],
                          "model_bytes": entry["bytes"], "chosen": entry.get("chosen")}
    if "amp" in rows:  # how --precision auto chose (train/step_speed.py)
        rows["amp"]["precision_chosen_by"] = run.recorded_config("train").get(
            "precision_chosen_by", "")
    return rows


def learning_rate_of(run: Run) -> dict:
    """The peak learning rate training used and how it was found (`--lr`, or the range test
    whose curve the run keeps)."""
    recorded = run.recorded_config("train")
    if not recorded:
        return {}
    found = {"value": recorded.get("resolved_lr", recorded.get("lr")),
             "found_by": recorded.get("lr_found_by", "range test" if recorded.get("lr") == "auto"
                                      else "--lr")}
    if "lr-range" in run.artifacts():
        found["curve"] = json.loads(run.verified_path("lr-range").read_text())
    return found


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
    threads = machine.inference_threads(config.threads)
    compared = [open_run(run.artifacts_dir, name) for name in config.compare if name != run.name]
    with tempfile.TemporaryDirectory() as scratch:  # in a child process: worker.py says why
        rows, measured = measure(run, config, threads, Path(scratch))
    folder = run.root / "report"
    folder.mkdir(parents=True, exist_ok=True)
    report = assemble(run, config, threads, rows, measured, folder)
    write(run, folder, report, compared)
    run.record_config("report", asdict(config))
    check_gates(config, report["verdict"], folder)
    return report


def assemble(run: Run, config, threads: int, rows: list[dict], measured: dict,
             folder: Path) -> dict:
    """report.json's content (docs/design.md); its figures are drawn into ``folder``."""
    reference, conditions = measured["reference"], measured["timing_conditions"]
    training = training_rows(run)
    histories = _histories(run)
    environment = machine.environment(threads) | {"isa": measured["isa"]}  # the child's
    learning_rate = learning_rate_of(run)
    figures = draw_figures(rows, reference, histories, learning_rate, folder,
                           config.max_accuracy_drop)
    gpu_rows = on_device(rows, "cuda")
    environment |= {"gpu": gpu.name(), "gpu_rows": bool(gpu_rows),
                    "gpu_note": _gpu_note(config, gpu_rows, measured["unmeasured"])}
    return {
        "run": run.name, "reference": reference,
        "config": asdict(config) | {"threads": threads}, "models": rows,
        "training": training, "training_history": histories, "learning_rate": learning_rate,
        "recipe": run.recorded_config("train").get("recipe", {}),  # {}: kept since 2026-12-06
        "verdict": _verdicts(rows, reference, config, conditions, gpu_rows),
        "warnings": _warnings(run, rows, reference, config, training, measured, environment),
        "parity": measured["parity"], "figures": figures, "environment": environment,
        "timing_conditions": conditions, "profiles": measured["profiles"],
        "crashed": measured["crashed"], "extras_crashed": measured["extras_crashed"],
    }


def draw_figures(rows: list[dict], reference: str, histories: dict, learning_rate: dict,
                 folder: Path, budget_points: float) -> dict[str, str]:
    """The report's figures, each with what it shows: those with nothing to show are left out."""
    figures = dict(FIGURES)
    plots.latency_vs_size(rows, folder / "latency-vs-size.png")
    plots.speedup_and_size(rows, reference, folder / "speedup.png", budget_points)
    if histories:
        plots.training_curves(histories, folder / "training-curves.png")
    else:
        figures.pop("training-curves.png")
    if learning_rate.get("curve"):
        plots.lr_range(learning_rate["curve"], folder / "lr-range.png")
    else:
        figures.pop("lr-range.png")
    return figures


def _verdicts(rows: list[dict], reference: str, config, conditions: dict,
              gpu_rows: list[dict]) -> dict:
    """The verdict on the CPU rows, with the GPU rows' own verdict inside it (None without)."""
    budget = config.max_accuracy_drop
    on_gpu = None
    if gpu_rows:
        on_gpu = gpu_verdict(gpu_rows, device_reference(rows, reference, "cuda"), budget,
                             reference)
        if on_gpu["recommended"]:
            on_gpu = contention.mark_verdict(on_gpu, conditions, "cuda") | {"device": "cuda"}
    return contention.mark_verdict(verdict(on_device(rows, "cpu"), reference, budget),
                                   conditions, "cpu") | {"device": "cpu", "gpu": on_gpu}


def _warnings(run: Run, rows: list[dict], reference: str, config, training: dict,
              measured: dict, environment: dict) -> list[str]:
    return (contention.warnings(measured["timing_conditions"])
            + warnings_for(rows, reference, config.max_accuracy_drop, training,
                           measured["profiles"], machine.cpu_has_vnni())
            + parity_warnings(measured["parity"]) + profile.failures(measured["profiles"])
            + isa_note(environment) + crash_warnings(measured["crashed"])
            + extra_crash_warnings(measured["extras_crashed"])
            + amx_warnings(rows, str(max(config.batch_sizes)))
            + [m for m in dict.fromkeys(vnni_mismatch(run, r["variant"]) for r in rows) if m]
            + [f"{name} ({stage}): {why}" for stage in ("quantize", "qat")
               for name, why in run.recorded_config(stage).get("not_kept", {}).items()])


def write(run: Run, folder: Path, report: dict, compared: list[Run]) -> None:
    """report.json, report.md and (with --compare) compare.json and compare.md, each listed in
    the manifest with the figures."""
    atomic_write_json(folder / "report.json", report)
    atomic_write_text(folder / "report.md", markdown(report))
    for name in ["report.json", "report.md", *report["figures"]]:
        run.register(f"report/{name}", folder / name, kind="report", stage="report")
    if compared:
        summary, text = compare_markdown([run, *compared])
        atomic_write_json(folder / "compare.json", summary)
        atomic_write_text(folder / "compare.md", text)
        for name in ("compare.json", "compare.md"):
            run.register(f"report/{name}", folder / name, kind="report", stage="report")


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
    for v in (v for v in (report["verdict"], report["verdict"].get("gpu"))
              if v and v["recommended"]):
        vs_float = v["per_batch_size"][str(v["batch_size"])]["speedup_vs_best_float"]
        fastest_float = ("it is the fastest float, " if vs_float["best_float"] == v["recommended"]
                         else f"{v['speedup_vs_best_float']:.2f}x the fastest float"
                         + (" (within noise), " if within_noise(vs_float) else ", "))
        lines.append(f"recommended on the {v.get('device', 'cpu').upper()}: {v['recommended']} "
                     f"({v['speedup']:.2f}x {v['reference']}'s speed, {fastest_float}"
                     + (f"{v['speedup_vs_best_fp32']:.2f}x the fastest fp32, "
                        if v.get("speedup_vs_best_fp32") and v["speedup_vs_best_fp32"]
                        != v["speedup_vs_best_float"] else "") +
                     f"{v['size_ratio']:.2f}x the size, {v['accuracy_change_points']:+.2f} "
                     "points on the test split" + (
                         f" against {v['accuracy_reference']}"
                         if v.get("accuracy_reference", v["reference"]) != v["reference"]
                         else "") + ")")
    note = report["environment"].get("gpu_note")
    lines += [note] if note and not report["verdict"].get("gpu") else []
    return "\n".join(lines + contention.warnings(report.get("timing_conditions")))


__all__ = ["run", "summary_table"]
