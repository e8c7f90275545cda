"""The recommendation: speed-ups with their intervals, the verdict (the fastest variant within
the accuracy budget, per batch size and device), and the CI gates on it."""
from __future__ import annotations

import functools

from stages.measure import timing
from stages.run.errors import PipelineError
from stages.runtimes import gpu

DEVICES = ["cpu", "cuda"]  # the order the report times and lists them in


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


def speedups(rows: list[dict], reference: str, budget_points: float) -> None:
    """Each variant's speed-up against the reference eager and against the fastest float
    variant at the same batch size on its own device, as ratios of medians with bootstrap
    intervals over the rounds: a GPU row is never compared with a CPU one. The fastest float
    is one a user could serve, within the accuracy budget as the verdict's choice is (on
    efficientnet_b0 at 224 an openvino-bf16 beyond it was the fastest float, and the report
    called the variant it recommended 0.86x "faster" than one it would never ship)."""
    for device in DEVICES:
        group = on_device(rows, device)
        if not group:
            continue
        own_reference = {row["name"]: row for row in group}[
            device_reference(rows, reference, device)]
        for size in group[0]["latency_ms"]:
            fastest = functools.partial(min, key=lambda r: r["latency_ms"][size]["p50"],
                                        default=None)
            floats = [r for r in group if not r["int8"]]
            servable = [r for r in floats if within_budget(r, budget_points)]
            best_float = fastest(servable or floats)
            # Alike, on its own: bf16 rows alone within the budget still leave an fp32 to
            # compare with (the fastest of all of them), not none.
            fp32s = [r for r in floats if r.get("precision", "fp32") == "fp32"]
            best_fp32 = fastest([r for r in fp32s if r in servable] or fp32s)
            for row in group:
                row.setdefault("speedup_vs_reference", {})[size] = faster(own_reference, row,
                                                                          size)
                row.setdefault("speedup_vs_best_float", {})[size] = faster(
                    best_float, row, size) | {"best_float": best_float["name"]}
                if best_fp32 is not None:
                    row.setdefault("speedup_vs_best_fp32", {})[size] = faster(
                        best_fp32, row, size) | {"best_fp32": best_fp32["name"]}


def cap_that_pays(row: dict, size: str, clean_only: bool = True) -> str | None:
    """The oneDNN cap (ONEDNN_MAX_CPU_ISA) under which ``row`` ran faster than with AMX at
    batch ``size``, beyond noise (stages/report/worker.py: time_below_amx), and, ``clean_only``,
    in sessions the machine left alone: what export writes into the deployment. Else None."""
    below = row.get("below_amx") or {}
    faster = below.get("amx_speedup", {}).get(size)
    clean = below.get("timing_clean", True) or not clean_only  # True: a report before it
    return below["onednn_max_cpu_isa"] if faster and faster["high"] < 1.0 and clean else None


def accuracy_drop(row: dict, split: str = "validation") -> float:
    """Points of accuracy lost against the reference on ``split`` (negative: gained)."""
    return -row[split]["change_vs_reference"]["difference"] * 100


def worst_accuracy_drop(row: dict) -> float:
    """What a variant may lose at worst on the held-out images (one-sided 95%): what the
    accuracy budget holds, as in quantize (stages/quantization/tuning.py)."""
    return -row["validation"]["change_vs_reference"]["worst"] * 100


def within_budget(row: dict, budget_points: float) -> bool:
    """The accuracy budget as the verdict holds it: the worst drop at 95%, rounding aside."""
    return worst_accuracy_drop(row) <= budget_points + 1e-9


def beside(value: float, limit: float, digits: int = 2) -> str:
    """``value`` to ``digits`` decimals, or to as many more as tell it from ``limit`` (a drop of
    1.004 points "more than the budget of 1" had read 1.00)."""
    while round(value, digits) == round(limit, digits) and value != limit and digits < 6:
        digits += 1
    return f"{value:.{digits}f}"


def verdict(rows: list[dict], reference: str, budget_points: float,
            accuracy_reference: str | None = None) -> dict:
    """Per batch size, the fastest variant within the accuracy budget on the held-out images
    at 95% confidence; the recommendation is the one for the largest batch size. Ranked by
    speed-up against the fastest float variant; 'within noise' names variants whose speed
    cannot be told apart. Speed and size are against ``reference``, accuracy against
    ``accuracy_reference`` (the rows' change_vs_reference: the CPU's, for the GPU rows)."""
    by_name = {row["name"]: row for row in rows}
    within = [r for r in rows if within_budget(r, budget_points)]
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
            "speedup_vs_best_fp32": best.get("speedup_vs_best_fp32", {}).get(size),
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
            "speedup_vs_best_fp32": (per_batch[largest]["speedup_vs_best_fp32"] or {}).get(
                "ratio"),
            "size_ratio": best["size_bytes"] / ref["size_bytes"],
            "validation_change_points": -accuracy_drop(best),
            "validation_worst_change_points": -worst_accuracy_drop(best),
            "accuracy_change_points": test_change["difference"] * 100,
            "accuracy_change_ci95_points": [test_change["low"] * 100, test_change["high"] * 100],
            "test_accuracy": best["test"]["accuracy"],
            "max_accuracy_drop_points": budget_points, "reference": reference,
            "accuracy_reference": accuracy_reference or reference}


def gpu_verdict(gpu_rows: list[dict], reference: str, budget_points: float,
                accuracy_reference: str) -> dict:
    """The GPU rows' own verdict, their speed against ``reference`` (a GPU row). Their accuracy
    is judged against the CPU's ``accuracy_reference``, so none may keep within the budget (a
    flip or two of TF32 or bf16 under --max-accuracy-drop 0): then no recommendation, and why,
    where verdict() would have had no row to rank."""
    within = [r for r in gpu_rows if within_budget(r, budget_points)]
    if not within:
        return {"recommended": None, "device": "cuda",
                "why": f"no GPU row kept within {budget_points:g} point(s) of the CPU's "
                       "reference on the held-out images at 95% confidence"}
    return verdict(gpu_rows, reference, budget_points, accuracy_reference) | {"device": "cuda"}


def check_gates(config, v: dict, folder) -> None:
    """--fail-under-speedup (against the reference, `amp` served eager) and
    --fail-under-float-speedup (against the fastest float variant): a CI gate fails once the
    report is written."""
    best_float = v["per_batch_size"][str(v["batch_size"])]["best_float"]
    gates = (("--fail-under-speedup", config.fail_under_speedup, v["speedup"], v["reference"]),
             ("--fail-under-float-speedup", config.fail_under_float_speedup,
              v["speedup_vs_best_float"], f"the fastest float variant within the accuracy "
              f"budget, {best_float},"))
    for flag, gate, ratio, against in gates:
        if gate and ratio < gate:
            raise PipelineError(f"the recommended variant {v['recommended']} is "
                                f"{beside(ratio, gate)}x as "
                                f"fast as {against} at batch {v['batch_size']}, under {flag} "
                                f"{gate:g} (report written to {folder})")
