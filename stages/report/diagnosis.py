"""The report's warnings: results that defeat their purpose, each with its cause read from what
the variant contains (a slow int8 variant, an accuracy budget exceeded, a reference that lost
to its fp32 baseline, a model at chance, runtimes that disagree, a capped oneDNN)."""
from __future__ import annotations

from stages.measure.evaluate import PARITY_MIN_AGREEMENT
from stages.report import profile
from stages.report.measuring import BELOW_AMX_PHASE
from stages.report.recommendation import (
    accuracy_drop,
    beside,
    cap_that_pays,
    within_budget,
    worst_accuracy_drop,
)

NO_VNNI = ("this CPU has no VNNI, so int8 kernels multiply through 16-bit steps that saturate "
           "(oneDNN's 'Nuances of int8 computations') and run little faster than float ones; "
           "int8 pays on CPUs with AVX-512 VNNI, AVX-VNNI or AMX")

# Why torch-static keeps depthwise convolutions in float without VNNI (runtimes/pt2e.py).
DEPTHWISE_IN_FLOAT = ("without VNNI, oneDNN runs int8 depthwise convolutions through its general "
                      "int8 kernel, about twice the time of its float depthwise one; "
                      "uxlfoundation/oneDNN#1043")


def depthwise_in_float_why(quantization: dict) -> str:
    """Why a PT2E variant's depthwise convolutions run in float: where --auto also tried the
    chosen configuration with them in int8, what that trial showed (slower, or over the
    accuracy budget); otherwise the default of a CPU without VNNI."""
    record = quantization.get("tuning") or {}
    chosen = (record.get("chosen") or {}).get("options")
    twin = chosen and next((t for t in record.get("tried") or []
                            if t.get("options") == chosen | {"float_depthwise": False}), None)
    if not twin:
        return DEPTHWISE_IN_FLOAT
    worst, budget = twin.get("worst_drop_points", twin["drop_points"]), record["budget_points"]
    if worst > budget:
        return (f"--auto kept them float: in int8 the same configuration may lose {worst:.2f} "
                f"points at worst, over the {budget:g}-point budget")
    # Both were timed: tune times every trial where it tried more than one.
    return (f"--auto timed them faster in float: {record['chosen']['latency_ms_p50']:.2f} "
            f"against {twin['latency_ms_p50']:.2f} ms with them in int8")


# ONEDNN_VERBOSE on the VNNI EPYC, batch 32 (docs/measurements.md): oneDNN's int8 kernels of
# mnasnet0_5's torch-static took 0.65 ms a call, its qconv ops 1.43 ms by torch.profiler; all
# were oneDNN's VNNI kernels (brgconv, brdgmm_dw), none a reference one.
QCONV_OVERHEAD = ("PyTorch's quantized convolution op adds per-call work around each oneDNN int8 "
                  "kernel, on small layers as much as the kernel itself (upstream: PyTorch cut "
                  "part of it in pytorch/pytorch#123240; docs/design.md)")


def diagnose_slow(row: dict, vnni: bool = True, lost: str | None = None) -> str:
    """Why an int8 variant is slow, read from what it contains rather than from its name, and
    from ``lost`` (profile.largest_loss: where the profiles found it losing the most time);
    on a CPU without VNNI, that its int8 kernels gain little over float there."""
    cause = _contents_cause(row, lost)
    return cause if vnni or "Integer" in cause else f"{cause}; and {NO_VNNI}"


def _contents_cause(row: dict, lost: str | None = None) -> str:
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
        why = (f" (its depthwise convolutions among them: {depthwise_in_float_why(quantization)})"
               if (quantization.get("options") or {}).get("float_depthwise") else "")
        return (f"{parts} layers still run in float{why}, so it pays for quantizing and "
                "dequantizing around them")
    if lost:  # measured: on mnasnet0_5 (VNNI) the int8 convolutions themselves were slower
        cause = f"every Conv/Linear layer runs in int8, yet it loses the most time in {lost}"
        if lost.startswith("convolution") and row.get("serving", "").startswith("PT2E"):
            cause += f"; {QCONV_OVERHEAD}"
        return cause
    return ("every Conv/Linear layer runs in int8, so the time goes to what is not int8 "
            "(quantize/dequantize steps, pooling, normalisation) or to per-call overhead")


def _profiled_at(profiles: dict | None, size: str) -> bool:
    return bool(profiles) and str(profiles["batch_size"]) == size


def _lost(profiles: dict | None, name: str, size: str) -> str | None:
    return profile.largest_loss(profiles, name) if _profiled_at(profiles, size) else None


def _measured_time(profiles: dict | None, name: str, size: str) -> str:
    top = profile.top_operators(profiles, name) if _profiled_at(profiles, size) else None
    return f" Measured at batch {size}, its time goes to {top}." if top else ""


def _call_and_image_ms(row: dict) -> tuple[int, int, float, float] | None:
    """The line through a variant's p50 at its smallest and largest batch sizes: (smallest,
    largest, ms a call whatever its size, ms an image). None with one batch size."""
    sizes = sorted(int(size) for size in row["latency_ms"])
    if len(sizes) < 2:
        return None
    low, high = sizes[0], sizes[-1]
    low_ms, high_ms = (row["latency_ms"][str(size)]["p50"] for size in (low, high))
    per_image = max((high_ms - low_ms) / (high - low), 0.0)
    return low, high, max(low_ms - per_image * low, 0.0), per_image


def _fitted_costs(row: dict, best_float: dict, size: str) -> str:
    """Where a variant not profiled at ``size`` loses its time against the fastest float, from
    the latency table alone: its cost per call and per image against the float's (on
    mnasnet0_5, torch-static's 1.08 ms a call against onnx-fp32's 0.08 ms lost batch 1)."""
    mine, theirs = _call_and_image_ms(row), _call_and_image_ms(best_float)
    if mine is None or theirs is None:
        return ""
    low, high, call_ms, image_ms = mine
    call_excess, image_excess = call_ms - theirs[2], int(size) * (image_ms - theirs[3])
    if max(call_excess, image_excess) <= 0:  # the line does not explain it
        return ""
    per_call = call_excess >= image_excess
    return (f" By its p50 at batch {low} and {high}, a call costs it {call_ms:.2f} ms whatever its"
            f" size and {image_ms:.3f} ms an image, against {theirs[2]:.2f} and {theirs[3]:.3f}"
            f" ms for {best_float['name']}: at batch {size} the time is lost "
            f"{'per call' if per_call else 'per image'}.")


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
                             f" {diagnose_slow(row, vnni, _lost(profiles, row['name'], size))}."
                             + (_measured_time(profiles, row["name"], size) or _fitted_costs(
                                 row, by_name[ratio["best_float"]], size)))
        if not within_budget(row, budget_points):
            found.append(f"{row['name']} may lose up to "
                         f"{beside(worst_accuracy_drop(row), budget_points)} points of "
                         f"held-out accuracy against {reference} at 95% confidence (measured: "
                         f"{-accuracy_drop(row):+.2f}), more than the budget of {budget_points:g}.")
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
    """The measuring process runs without training's cap (stages/report/worker.py): a cap
    still in force is the user's own."""
    capped = environment["isa"]["onednn_max_cpu_isa"]
    if capped == "not capped":
        return []
    return [f"oneDNN was capped at {capped} (ONEDNN_MAX_CPU_ISA in the environment), so "
            "PyTorch's and OpenVINO's timings here exclude the instructions above it; a "
            "deployment without that variable may run other kernels."]


def amx_warnings(rows: list[dict], size: str) -> list[str]:
    """A variant that ran faster with oneDNN capped below AMX, with both figures: export runs
    it that way, where both sessions were timed on a quiet machine."""
    found = []
    for row in rows:
        cap = cap_that_pays(row, size, clean_only=False)
        if cap:
            below = row["below_amx"]
            ratio = below["amx_speedup"][size]
            unclean = ("the machine was busy in one of the two timings"
                       if below.get("timing_clean") is False else "whether the machine was "
                       "quiet in both timings is unknown (its load could not be read)")
            export = ("'pipeline export' sets the variable in its folder's predict.py."
                      if cap_that_pays(row, size) else f"{unclean}, so 'pipeline export' does "
                      "not set the variable on this figure.")
            found.append(
                f"{row['name']} ran {1 / ratio['ratio']:.2f}x ({1 / ratio['high']:.2f}–"
                f"{1 / ratio['low']:.2f}) faster with oneDNN capped below AMX "
                f"(ONEDNN_MAX_CPU_ISA={cap}) than with it: "
                f"{below['latency_ms'][size]['p50']:.2f} against "
                f"{row['latency_ms'][size]['p50']:.2f} ms p50 at batch {size}. The table gives "
                "its time with AMX, as a process without that variable runs it; " + export)
    return found


def crash_warnings(crashed: list[dict]) -> list[str]:
    return [f"{c['name']} crashed the process measuring it ({c['signal']} in {c['runtime']}, "
            f"while {c['phase']}" + (f" at batch {c['batch_size']}" if c["batch_size"] else "")
            + f", oneDNN {c['onednn_max_cpu_isa']}): it has no figures in this report and is "
            "not recommended; the other variants were measured again without it."
            + _killed_for_memory(c) for c in crashed]


def extra_crash_warnings(crashed: list[dict]) -> list[str]:
    return [f"{c['name']} crashed the process timing it with oneDNN capped at "
            f"{c['onednn_max_cpu_isa']} ({c['signal']} in {c['runtime']}): no variant has a "
            "figure below AMX, and the figures with AMX stand." if c["phase"] == BELOW_AMX_PHASE
            else f"{c['name']} crashed the process measuring it while {c['phase']} "
            f"({c['signal']} in {c['runtime']}, oneDNN {c['onednn_max_cpu_isa']}): it was "
            "measured again without that, and its figures stand." for c in crashed]


def _killed_for_memory(crash: dict) -> str:
    """Why a SIGKILL most likely came: the kernel's out-of-memory killer sends it, and the
    measuring process holds every variant at once (efficientnet_b0 at 224x224: 24 GB)."""
    if crash["signal"] != "SIGKILL" or not crash.get("peak_rss_bytes"):
        return ""
    return (f" SIGKILL is what the kernel's out-of-memory killer sends: the measuring process "
            f"was seen holding {crash['peak_rss_bytes'] / 1e9:.1f} GB of this machine's "
            f"{crash['memory_bytes'] / 1e9:.1f} GB; smaller --batch-sizes need less.")
