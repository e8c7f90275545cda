"""Where the time goes: the recommended variant, its fastest float counterpart, and every int8
variant slower than float, profiled per operator type by their runtimes' own profilers.

A runtime names its operators its own way (ONNX Runtime `QLinearConv`, OpenVINO
`Convolution (I8)`, PyTorch `onednn::qconv2d_pointwise`), so the table groups them into a few
kinds that mean the same in every runtime: convolutions, matrix products, quantize/dequantize
steps, layout changes, pooling, element-wise work, and a compiled graph's own code. Each
variant's raw operators stay in report.json.
"""
from __future__ import annotations

import math
import re

# The first kind whose pattern matches an operator's name is its kind; order matters
# (`DynamicQuantizeMatMul` is a matrix product, `QuantizeLinear` a quantize step).
KINDS = (
    ("matrix product", r"gemm|matmul|(?<!quantize)linear|addmm|\bmm\b|bmm|fullyconnected"),
    ("convolution", r"conv(?!ert)"),  # OpenVINO's Convert is a precision conversion
    ("quantize/dequantize", r"dequant|quantize(?!d)|fakequant|convert"),
    ("pooling", r"pool|reducemean|\bmean\b|reduce"),
    ("layout (reorder, copy, reshape)", r"reorder|transpose|reshape|view|copy|contiguous|permute"
                                        r"|concat|\bcat\b|flatten|empty|as_strided|layout"),
    ("element-wise (activations, add, norm)",
     r"relu|add|mul|sigmoid|silu|swish|hswish|hardswish|clip|clamp|eltwise|gelu|norm|softmax"
     r"|(?<![a-z])(div|sub)(?![a-z])"),
    # Inductor's generated code, Dynamo's guards, OpenVINO's Snippets subgraphs (fused code).
    ("compiled graph's own code", r"compiled|dynamo|graph|cpp_fused|kernel"),
)
TOP_OPERATORS = 3  # named in a warning about a slow int8 variant
TARGET_SECONDS = 0.5  # each variant is profiled for about this long, 3 to 20 calls


def kind_of(operator: str) -> str:
    # ONNX Runtime's int8 operators are QLinear + the float name (QLinearAdd is an addition);
    # oneDNN's qlinear_pointwise is a matrix product and keeps its name.
    lowered = re.sub(r"^qlinear(?=[a-z])", "", operator.lower())
    return next((kind for kind, pattern in KINDS if re.search(pattern, lowered)), "other")


def calls_for(p50_ms: float) -> int:
    return max(3, min(20, math.ceil(TARGET_SECONDS * 1000.0 / max(p50_ms, 1e-3))))


def chosen_pairs(rows: list[dict], verdict: dict) -> list[tuple[str, str | None]]:
    """(variant, its fastest float counterpart) for the recommendation and for every int8
    variant slower than the fastest float at the verdict's batch size; None where the
    variant is itself the fastest float."""
    size = str(verdict["batch_size"])
    pairs = [(verdict["recommended"], verdict["per_batch_size"][size]["best_float"])]
    for row in rows:
        ratio = row["speedup_vs_best_float"].get(size)
        if row["int8"] and ratio and ratio["high"] < 1.0:
            pairs.append((row["name"], ratio["best_float"]))
    unique = []
    for name, best_float in pairs:
        pair = (name, None if best_float == name else best_float)
        if pair not in unique:
            unique.append(pair)
    return unique


def measure(loaded: dict, rows: list[dict], verdict: dict, batch,
            announce=lambda name: None) -> dict | None:
    """report.json's `profiles`: each chosen variant's operators (ms per call, by the
    runtime's profiler) and, per pair, the table by kind. None where there is nothing to
    profile (no CPU verdict, or runtimes without a profiler)."""
    size = str(verdict["batch_size"])
    by_name = {row["name"]: row for row in rows}
    pairs = chosen_pairs(rows, verdict)
    variants = {}
    for name in dict.fromkeys(n for pair in pairs for n in pair if n is not None):
        profile = getattr(loaded.get(name), "profile", None)
        if profile is None:
            continue
        calls = calls_for(by_name[name]["latency_ms"][size]["p50"])
        announce(name)
        try:
            operators = profile(batch, calls)
        except Exception as exc:  # a profiler that fails costs its table, not the report
            variants[name] = {"calls": calls, "operators": {}, "error": " ".join(
                f"{type(exc).__name__}: {exc}".split())[:300]}
            continue
        variants[name] = {"calls": calls, "operators": dict(sorted(
            operators.items(), key=lambda item: -item[1]))}
    if not variants:
        return None
    tables = [table(name, best_float, variants) for name, best_float in pairs
              if variants.get(name, {}).get("operators")]
    return {"batch_size": int(size), "variants": variants, "tables": tables}


def by_kind(operators: dict[str, float]) -> dict[str, float]:
    kinds: dict[str, float] = {}
    for operator, ms in operators.items():
        kinds[kind_of(operator)] = kinds.get(kind_of(operator), 0.0) + ms
    return kinds


def table(name: str, best_float: str | None, variants: dict) -> dict:
    """One variant against its float counterpart, kind by kind, largest first: ms per call
    of each and the variant's share of its own profiled call."""
    mine = by_kind(variants[name]["operators"])
    theirs = by_kind(variants[best_float]["operators"]) if best_float in variants else {}
    total = sum(mine.values()) or 1.0
    kinds = sorted(set(mine) | set(theirs), key=lambda k: -max(mine.get(k, 0), theirs.get(k, 0)))
    return {"variant": name, "float": best_float if theirs else None,
            "rows": [{"kind": kind, "float_ms": theirs.get(kind) if theirs else None,
                      "ms": mine.get(kind, 0.0), "share": mine.get(kind, 0.0) / total}
                     for kind in kinds]}


def failures(profiles: dict | None) -> list[str]:
    """A warning for each variant whose profiler failed."""
    return [f"{name} could not be profiled per operator ({v['error']}); its latency stands."
            for name, v in (profiles or {}).get("variants", {}).items() if v.get("error")]


def largest_loss(profiles: dict | None, name: str) -> str | None:
    """"convolution: 1.36 ms a call against 0.91 ms in onnx-fp32": the operator kind where
    ``name`` loses the most time to its float counterpart, or None where it loses none or was
    not profiled against one."""
    entry = next((t for t in (profiles or {}).get("tables", [])
                  if t["variant"] == name and t["float"]), None)
    if entry is None:
        return None
    row = max(entry["rows"], key=lambda r: r["ms"] - (r["float_ms"] or 0.0))
    if row["ms"] <= (row["float_ms"] or 0.0):
        return None
    theirs = f"{row['float_ms']:.2f} ms" if row["float_ms"] else "none"
    return f"{row['kind']}: {row['ms']:.2f} ms a call against {theirs} in {entry['float']}"


def top_operators(profiles: dict | None, name: str) -> str | None:
    """"QLinearConv 8.1 ms (62%), QuantizeLinear 2.0 ms (15%)": where ``name``'s time went."""
    if not profiles or name not in profiles["variants"]:
        return None
    operators = profiles["variants"][name]["operators"]
    total = sum(operators.values()) or 1.0
    return ", ".join(f"{op} {ms:.2f} ms ({ms / total:.0%})"
                     for op, ms in list(operators.items())[:TOP_OPERATORS])


def markdown(profiles: dict | None) -> list[str]:
    """The report's section: one table per profiled pair."""
    if not profiles:
        return []
    lines = ["## Where the time goes", "",
             f"Per operator kind at batch {profiles['batch_size']}, measured by each runtime's "
             "own profiler (ONNX Runtime's profiling, OpenVINO's performance counters, "
             "torch.profiler); milliseconds per call with the profiler on, so they show where "
             "the time goes, not how long a call takes (the latency table says that). "
             "report.json's `profiles` lists every operator.", ""]
    for entry in profiles["tables"]:
        against = entry["float"]
        lines += [f"`{entry['variant']}`" + (f" against `{against}`:" if against else ":"), "",
                  "| operator kind | " + (f"{against} ms | " if against else "")
                  + f"{entry['variant']} ms | share of its call |",
                  "|---|" + ("---:|" if against else "") + "---:|---:|"]
        for row in entry["rows"]:
            float_cell = (f"{row['float_ms']:.2f} | " if row["float_ms"] is not None else
                          "- | ") if against else ""
            lines.append(f"| {row['kind']} | {float_cell}{row['ms']:.2f} | {row['share']:.0%} |")
        lines.append("")
    return lines
