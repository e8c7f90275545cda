"""report.md from the report's data: what a user reads before shipping."""
from __future__ import annotations

from stages import runtimes
from stages.measure import contention
from stages.measure.timing import against
from stages.quantization import tuning
from stages.report import profile
from stages.report.diagnosis import depthwise_in_float_why
from stages.report.judging import BASELINE_WORDS, SELECTION_WORDS, VALIDATION_WORDS
from stages.report.recommendation import device_reference, on_device


def _ratio(r: dict) -> str:
    return f"{r['ratio']:.2f}x ({r['low']:.2f}–{r['high']:.2f})"


def _verdict_paragraph(report: dict) -> list[str]:
    v, ref = report["verdict"], report["reference"]
    models = {m["name"]: m for m in report["models"]}
    big = v["per_batch_size"][str(v["batch_size"])]
    low, high = v["accuracy_change_ci95_points"]
    noise = ("within the noise of the test split" if low <= 0 <= high
             else "a real difference on the test split")
    judged = models[v["recommended"]]["validation"]
    where = {SELECTION_WORDS: "the validation split and training images calibration did not use",
             BASELINE_WORDS: "the validation split"}.get(judged["images"],
                                                         "half the validation split")
    lines = [
        f"**Ship `{v['recommended']}`** for batches of {v['batch_size']} on the CPU. Of the "
        "variants "
        f"within {v['max_accuracy_drop_points']:g} point(s) of `{ref}` on held-out images at 95% "
        f"confidence ({judged['samples']} for it: {where}; "
        f"{v['validation_change_points']:+.2f} points, at worst "
        f"{v['validation_worst_change_points']:+.2f}), it has the lowest p50 latency: "
        + against(big["speedup_vs_best_float"], f"the fastest float variant, `{big['best_float']}`",
                  itself=big["best_float"] == v["recommended"]) + ", " + _fp32_clause(big) +
        against(big["speedup_vs_reference"], f"`{ref}` eager") + f", at "
        f"{v['size_ratio']:.2f}x its size. On the test split, which chose nothing, it scores "
        f"{v['test_accuracy']:.2%}, {v['accuracy_change_points']:+.2f} points against `{ref}` "
        f"(95% interval {low:+.2f} to {high:+.2f}, {noise}).", ""]
    lines += contention.caveat(report.get("timing_conditions"))
    fine_tuned = [m["name"] for m in report["models"]
                  if m["validation"]["images"] == VALIDATION_WORDS]
    if fine_tuned:
        lines += [f"Judged on {models[fine_tuned[0]]['validation']['samples']} validation "
                  f"images alone: {', '.join(f'`{n}`' for n in fine_tuned)}, the half of the "
                  "validation split qat did not choose its epoch on. Their weights were "
                  "fine-tuned after training, so on training images they would differ from "
                  f"`{ref}` in how well they memorised them, not only in what quantization "
                  "changed." + _epochs_cut(models.get("torch-qat")), ""]
    for m in report["models"]:
        if m["validation"]["images"] == BASELINE_WORDS:
            lines += [f"`{m['name']}` was trained apart from `{ref}`, which every other variant "
                      f"is made from: it is judged on the {m['validation']['samples']} images of "
                      "the validation split alone, since on training images it would differ "
                      "in how well it memorised them.", ""]
    if big["within_noise_of"]:
        lines += [f"Within noise of it at this batch size: "
                  f"{', '.join(f'`{n}`' for n in big['within_noise_of'])} (their speed-up "
                  "intervals against it hold 1).", ""]
    for size, choice in v["per_batch_size"].items():
        if size == str(v["batch_size"]):
            continue
        kind = "an int8 variant" if choice["int8"] else "a float variant"
        lines += [f"At batch {size} the fastest within the budget is `{choice['recommended']}` "
                  f"({kind}, {choice['p50_ms']:.2f} ms p50, "
                  f"{_ratio(choice['speedup_vs_best_float'])} against the fastest float, "
                  f"`{choice['best_float']}`)"
                  + (f"; within noise: {', '.join(f'`{n}`' for n in choice['within_noise_of'])}"
                     if choice["within_noise_of"] else "") + ".", ""]
    return lines


def _fp32_clause(choice: dict) -> str:
    """Where the fastest float ran in bf16 or fp16, what int8 buys over the fastest fp32 too:
    both are figures a user can weigh (bf16 may cost accuracy that fp32 does not)."""
    vs_fp32 = choice.get("speedup_vs_best_fp32")
    if not vs_fp32 or vs_fp32["best_fp32"] == choice["best_float"]:
        return "and "
    return (against(vs_fp32, f"the fastest fp32 variant, `{vs_fp32['best_fp32']}`",
                    itself=vs_fp32["best_fp32"] == choice["recommended"]) + ", and ")


def _epochs_cut(fine_tuned: dict | None) -> str:
    """Where qat's --tuning-time cut the epochs: a short fine-tuning explains a weak result."""
    info = (fine_tuned or {}).get("quantization") or {}
    if info.get("epochs_asked", 0) <= info.get("epochs", 0):
        return ""
    return (f" `torch-qat` was fine-tuned for {info['epochs']} of the {info['epochs_asked']} "
            f"epochs asked: --tuning-time {info['tuning_time_s']:g}s allowed no more.")


def _models_table(report: dict) -> list[str]:
    ref, rows = report["reference"], report["models"]
    by_name = {r["name"]: r for r in rows}
    sizes = [str(b) for b in report["config"]["batch_sizes"]]
    big = sizes[-1]
    head = ["variant", "device", "runs as", "size (MB)", f"size vs `{ref}`"]
    head += [f"p50 / p90 ms (batch {b})" for b in sizes]
    gpu_rows = on_device(rows, "cuda")  # against their own reference, which may have crashed
    gpu = f" (GPU rows: `{device_reference(rows, ref, 'cuda')}`)" if gpu_rows else ""
    head += [f"vs `{ref}`{gpu} eager (batch {big})",
             f"vs fastest float on its device (batch {big})",
             "held-out accuracy (images)", "test accuracy (95% CI)",
             "test change in points (95% CI)",
             f"agreement with `{ref}`"]
    lines = ["## Models", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        change = r["test"]["change_vs_reference"]
        cells = [f"`{r['name']}`", r.get("device", "cpu").upper(), r["serving"],
                 f"{r['size_bytes'] / 1e6:.2f}",
                 f"{r['size_bytes'] / by_name[ref]['size_bytes']:.2f}x"]
        cells += [f"{r['latency_ms'][b]['p50']:.2f} / {r['latency_ms'][b]['p90']:.2f}"
                  for b in sizes]
        cells += [_ratio(r["speedup_vs_reference"][big]), _ratio(r["speedup_vs_best_float"][big]),
                  f"{r['validation']['accuracy']:.2%} ({r['validation']['samples']})",
                  f"{r['accuracy']:.2%} ({r['accuracy_ci95'][0]:.1%}–{r['accuracy_ci95'][1]:.1%})",
                  "reference" if r["name"] == ref else
                  f"{change['difference'] * 100:+.2f} ({change['low'] * 100:+.2f} to "
                  f"{change['high'] * 100:+.2f})",
                  f"{r['agreement']:.2%} ({r['flipped_predictions']} flipped)"]
        lines.append("| " + " | ".join(cells) + " |")
    for c in report.get("crashed") or []:  # no figures: what killed the process measuring it
        at = f" at batch {c['batch_size']}" if c["batch_size"] else ""
        lines.append("| " + " | ".join(
            [f"`{c['name']}`", "", f"crashed: {c['signal']} in {c['runtime']} while "
             f"{c['phase']}{at} (oneDNN {c['onednn_max_cpu_isa']})"] + ["-"] * (len(head) - 3))
            + " |")
    cpu_rows = on_device(rows, "cpu")  # the GPU rows are timed in sessions of their own
    timing = cpu_rows[0]["latency_ms"][big]
    calls = [r["latency_ms"][big]["calls"] for r in cpu_rows]
    waited = max(r["latency_ms"][b].get("idle_wait_ms_max", 0.0) for r in cpu_rows for b in sizes)
    on_gpu = (f", the GPU rows' in {gpu_rows[0]['latency_ms'][big]['rounds']} rounds of "
              "their own" if gpu_rows else "")
    lines += ["", f"Speed-ups are ratios of p50 latencies measured in the same "
              f"{timing['rounds']} rounds at batch {big}{on_gpu} (the order rotated each round, "
              "garbage collection off, each variant's calls filling about 50 ms a round: "
              f"{min(calls)} to {max(calls)} calls in all; each variant timed only once no "
              "other thread of the process used the CPU, after a wait of at most "
              f"{waited:.0f} ms), with 95% bootstrap intervals over the rounds. Accuracy: top-1 "
              f"on the test split, Wilson intervals; the change against `{ref}` uses Newcombe's "
              "paired interval on the same images."
              + contention.quiet_sentence(report.get("timing_conditions")), ""]
    return lines


def _memory_sentence(training: dict) -> str:
    """How each model's peak memory was measured: one sentence when all were measured alike,
    else one clause per model (an fp32 baseline copied from another run, say)."""
    def how(method):
        return (f"was {method}" if method.startswith("not measured") else f"is the {method}")

    methods = {name: t.get("peak_memory_method") or "not measured"
               for name, t in training.items()}
    if len(set(methods.values())) == 1:
        return f"Peak memory {how(next(iter(methods.values())))}"
    return "Peak memory " + "; ".join(f"of `{name}` {how(method)}"
                                      for name, method in methods.items())


def _quantization(report: dict) -> list[str]:
    """What each variant really runs in int8, what stayed float and why, and parity."""
    lines = ["## Quantization", "", "| variant | int8 ops (counted in what runs) | kept in float "
             "| configuration | chosen because |", "|---|---|---|---|---|"]
    for r in report["models"]:
        info = r.get("quantization") or {}
        record = info.get("tuning") or {}
        keys = ("types", "per_channel", "calibration_method", "format", "preset", "equalize")
        options = info.get("options") or {k: info[k] for k in keys if k in info}
        kept = ", ".join(info.get("float_layers") or []) or "-"
        if gates := info.get("float_excitation_multiplies"):
            kept = (f"{len(gates)} squeeze-excitation multiplies (HardSigmoid gates: OpenVINO "
                    "fuses no quantize step into them)" + (f"; {kept}" if kept != "-" else ""))
        if options.get("float_depthwise"):
            kept = f"every depthwise convolution ({depthwise_in_float_why(info)})" + (
                f"; {kept}" if kept != "-" else "")
        lines.append(f"| `{r['name']}` | {runtimes.summarize_ops(r['op_counts'])} | {kept} | "
                     f"{tuning.label(options) if options else '-'} | {record.get('why', '-')} |")
    for r in report["models"]:
        record = (r.get("quantization") or {}).get("tuning") or {}
        if len(record.get("tried", [])) < 2:
            continue
        lines += ["", f"`{r['name']}` configurations tried on {record['images']} held-out "
                  "training images:", "", "| configuration | accuracy change (points) | at "
                  "worst, 95% | p50 ms |", "|---|---|---|---|"]
        for t in record["tried"]:
            ms = f"{t['latency_ms_p50']:.2f}" if t["latency_ms_p50"] is not None else "-"
            worst = t.get("worst_drop_points")  # absent from runs quantized before 2026-12-02
            worst = f"{0.0 - worst:+.2f}" if worst is not None else "-"
            lines.append(f"| {t['label']} | {0.0 - t['drop_points']:+.2f} | {worst} | {ms} |")
    lines += _sensitive_layers(report)
    if report["parity"]:
        lines += ["", "| parity on the test images | max logit difference | top-1 agreement |",
                  "|---|---|---|"]
        for p in report["parity"]:
            flag = "" if p["within_bounds"] else " (out of bounds)"
            lines.append(f"| `{p['b']}` vs `{p['a']}` | {p['max_abs_diff']:.3g} | "
                         f"{p['top1_agreement']:.2%}{flag} |")
    return lines + [""]


def _sensitive_layers(report: dict) -> list[str]:
    """The ten layers int8 hurt most, for each variant whose search ranked them, and what
    keeping some in float cost."""
    lines = []
    for r in report["models"]:
        fallback = ((r.get("quantization") or {}).get("tuning") or {}).get("fallback")
        if not fallback or r.get("device", "cpu") != "cpu":
            continue
        kept = set(fallback["float_layers"])
        key = "error" if fallback["ranking"] and "error" in fallback["ranking"][0] \
            else "logit_mse_gain"
        measure = "relative output error" if key == "error" else "logits brought back"
        lines += ["", f"`{r['name']}`: the most sensitive layers, ranked by "
                  f"{fallback['ranked_by']} ({fallback['stopped']}):", "",
                  f"| layer | {measure} | kept in float |", "|---|---|---|"]
        for item in fallback["ranking"][:10]:
            lines.append(f"| {item['layer']} | {item[key]:.3g} | "
                         f"{'yes' if item['layer'] in kept else '-'} |")
        chosen = r["quantization"]["tuning"]["chosen"] or {}
        if fallback.get("latency_ms_all_int8") and chosen.get("latency_ms_p50"):
            lines += ["", f"Keeping {len(kept)} layer(s) in float took "
                      f"{chosen['latency_ms_p50']:.2f} ms against "
                      f"{fallback['latency_ms_all_int8']:.2f} ms with every layer in int8 "
                      "(timed together at batch 32)."]
    return lines


def amp_sentence(training: dict, rows: list[dict]) -> str:
    if "fp32" not in training or "amp" not in training:
        return "Train with the fp32 baseline to compare AMP training against fp32."
    fp32, amp = training["fp32"], training["amp"]
    int8 = min((r for r in rows if r.get("precision") == "int8"), key=lambda r: r["size_bytes"],
               default=None)  # not a float row, which shrinks nothing
    shrinks = (f"quantization is what shrinks the model (`{int8['name']}`: "
               f"{int8['size_bytes'] / fp32['model_bytes']:.2f}x)" if int8 else
               "quantization would shrink it (no int8 variant was made)")
    if fp32.get("same_run_as") == "amp":
        measured = amp.get("precision_chosen_by", "").partition("auto, measured: ")[2]
        why = (f"--precision auto measured {measured}" if measured else
               "autocast resolved to fp32: a CPU without bf16 instructions, or --precision fp32")
        return (f"`amp` trained in fp32 here ({why}), so it is the fp32 baseline's computation "
                f"and was trained once; `fp32` is a copy of it. Its master weights are fp32 "
                f"either way ({amp['model_bytes'] / 1e6:.2f} MB); {shrinks}. Train with "
                "--precision bf16 to compare mixed-precision training on this machine.")
    memory = (f" Training memory: {amp['peak_memory_bytes'] / 1e6:.0f} MB against "
              f"{fp32['peak_memory_bytes'] / 1e6:.0f} MB."
              if fp32["peak_memory_bytes"] and amp["peak_memory_bytes"] else "")
    return (f"AMP training ({amp['precision']}) saved a model of {amp['model_bytes'] / 1e6:.2f} MB "
            f"against fp32's {fp32['model_bytes'] / 1e6:.2f} MB: its master weights are fp32, "
            f"so mixed precision does not shrink the saved model; {shrinks}. It trained at "
            f"{amp['samples_per_second']:.0f} samples/s against fp32's "
            f"{fp32['samples_per_second']:.0f} "
            f"({amp['samples_per_second'] / max(fp32['samples_per_second'], 1e-9):.2f}x)."
            + memory)


def _training(report: dict) -> list[str]:
    training = report["training"]
    if not training:
        return []
    lines = ["## Training", "", amp_sentence(training, report["models"]), "",
             "| model | precision | device (layout) | epochs (why it stopped) | seconds | "
             "samples/s | peak memory (MB) | checkpoint (MB) | model.pt (MB) | model.pt is | "
             "test accuracy | skipped steps |",
             "|" + "---|" * 12]
    for name, t in training.items():
        epochs = (f"{t['epochs_run']} ({t['stopped']})" if t.get("stopped")
                  else str(t.get("epochs_run") or t.get("epochs") or "-"))
        layout = f" ({t['memory_format']})" if t.get("memory_format") else ""
        lines.append(f"| `{name}` | {t['precision']} | {t['device']}{layout} | {epochs} | "
                     f"{t['seconds']:.1f} | "
                     f"{t['samples_per_second']:.0f} | {_megabytes(t['peak_memory_bytes'])} | "
                     f"{t['checkpoint_bytes'] / 1e6:.2f} | {t['model_bytes'] / 1e6:.2f} | "
                     f"{t.get('chosen') or '-'} | {t['test_accuracy']:.2%} | "
                     f"{t['skipped_steps']} |")
    isa = {name: (t.get("isa") or {}) for name, t in training.items()}
    lines += ["", f"{_memory_sentence(training)}. Every later stage starts from model.pt, the "
              "epoch in the `chosen` column: the last, unless an earlier one was better on "
              "validation beyond noise." + _lr_sentence(report)
              + _recipe_sentence(report.get("recipe") or {})]
    for name, found in isa.items():
        if found:
            lines.append(f"`{name}` trained with ATen's {found.get('aten')} kernels, oneDNN "
                         f"{found.get('onednn_max_cpu_isa')}.")
    lines.append("")
    for figure in ("training-curves.png", "lr-range.png"):
        if figure in report["figures"]:
            lines += [f"![{report['figures'][figure]}]({figure})", ""]
    return lines


def _megabytes(count: int) -> str:
    return f"{count / 1e6:.0f}" if count else "-"  # 0: not measured


def _lr_sentence(report: dict) -> str:
    """How the peak learning rate was chosen."""
    found = report.get("learning_rate") or {}
    if not found.get("value"):
        return ""
    curve = found.get("curve")
    rule = "linear-scaling rule (0.1 per 256 images a step; "
    if not curve and found.get("found_by", "").startswith(rule):  # why, in the parentheses
        return (f" Peak learning rate {found['value']:.3g}, by Goyal et al.'s linear-scaling "
                f"rule (0.1 per 256 images a step): {found['found_by'][len(rule):-1]}.")
    if not curve and found.get("found_by", "").startswith("rates probed ("):  # lr_range.PROBED
        return f" Peak learning rate {found['value']:.3g}, the best of the {found['found_by']}."
    if not curve:
        return f" Peak learning rate {found['value']:g}, as --lr gave it."
    capped = found.get("found_by") == "range test" and curve.get("capped")
    uncapped = curve.get("uncapped", curve["chosen"])
    # Runs before 2026-12-06 chose the minimum over 2 and recorded no `climbed`.
    read, at = ((f"where the smoothed loss, past its lowest, first rose {curve['climb'] - 1:.0%} "
                 "above it", curve["climbed"]) if "climbed" in curve
                else ("where the smoothed loss was lowest", curve["minimum"]))
    return (f" Peak learning rate {found['value']:.3g}, found by a range test of "
            f"{curve['steps']} steps from {curve['start_lr']:g} upwards: the learning rate "
            f"{read} ({at:.3g}) divided by {at / uncapped:.3g}"
            + (f" ({uncapped:.3g}), held to {curve['ceiling']:.3g}, the most its batch size "
               "allows (twice Goyal et al.'s linear-scaling rule)." if capped else "."))


def _recipe_sentence(recipe: dict) -> str:
    """The rest of how the models trained (config.json's recipe, stages/training/loop.py)."""
    if not recipe:
        return ""
    smoothing = (f"label smoothing {recipe['label_smoothing']:g}" if recipe["label_smoothing"]
                 else "no label smoothing")
    averaging = ("no averaging of weights" if recipe["weight_averaging"] == "none"
                 else f"weights averaged ({recipe['weight_averaging']})")
    return (f" {recipe['optimizer']}, batches of {recipe['batch_size']}, weight decay "
            f"{recipe['weight_decay']:g} on {recipe['weight_decay_on']}, "
            f"{recipe['schedule']}; {smoothing}; {averaging}; "
            + (f"initial weights: {recipe['initialisation']}; " if "initialisation" in recipe
               else "")
            + ("training images not augmented." if recipe["augmentation"] == "none"
               else f"training images given {recipe['augmentation']}."))


def _gpu_paragraph(report: dict) -> list[str]:
    """The GPU's recommendation, or why there are no GPU rows."""
    v, note = report["verdict"].get("gpu"), report["environment"].get("gpu_note")
    notes = [f"{note[0].upper()}{note[1:]}.", ""] if note else []
    if not v or not v["recommended"]:  # no GPU rows, or none within the budget
        return ([f"**On the GPU** ({report['environment'].get('gpu')}): no recommendation: "
                 f"{v['why']}.", ""] if v else []) + notes
    big = v["per_batch_size"][str(v["batch_size"])]
    return [f"**On the GPU** ({report['environment'].get('gpu')}), for batches of "
            f"{v['batch_size']}: `{v['recommended']}`, " + against(big["speedup_vs_reference"],
            f"`{v['reference']}`", itself=v["reference"] == v["recommended"])
            + f", and {_ratio(big['speedup_vs_best_float'])} "
            f"against the fastest float there, `{big['best_float']}`; "
            f"{v['accuracy_change_points']:+.2f} points against `{report['reference']}` on "
            "the test split. GPU rows are compared with GPU rows only.", ""] + notes


def markdown(report: dict) -> str:
    lines = [f"# Report for run `{report['run']}`", ""] + _verdict_paragraph(report)
    lines += _gpu_paragraph(report)
    if report["warnings"]:
        lines += ["## Warnings", ""] + [f"- {w}" for w in report["warnings"]] + [""]
    lines += _models_table(report)
    lines += [f"![{title}]({name})" for name, title in report["figures"].items()
              if name not in ("training-curves.png", "lr-range.png")] + [""]  # in Training
    lines += profile.markdown(report.get("profiles"))
    lines += _quantization(report) + _training(report)
    env = report["environment"]
    lines += ["## Environment", "",
              f"CPU {env['cpu']['model']} "
              f"({', '.join(env['cpu']['flags']) or 'no int8/bf16 flags'})"
              f"; inference with ATen's {env['isa']['aten']} kernels, oneDNN "
              f"{env['isa']['onednn_max_cpu_isa']}; {env['threads']} threads for every runtime; "
              + ", ".join(f"{k} {v}" for k, v in env["versions"].items()) + ".", ""]
    return "\n".join(lines)

