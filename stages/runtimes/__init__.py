"""Inference runtimes and the model variants they run, in one registry.

A runtime is one module (pytorch, onnxruntime, openvino) that registers its variants with
`@variant(...)` on the function that makes them from the float model and calibration data,
and a loader with `@loader(...)` that opens a variant from its verified files and returns a
`Loaded`: predict logits for a batch, a call to time, and the count of int8 and float ops
that really run. quantize.py makes what is asked for and report.py measures what is there,
both by walking VARIANTS, so a new runtime is one new module plus its tests. The variants the
qat stage makes from its fine-tuned graph (torch-qat, ort-qat, openvino-qat) are registered
the same way, with stage="qat", in runtimes/qat.py. A runtime whose variants are searched
hands the search a quantization/tuning.Backend; the PyTorch runtime's helpers are pt2e.py (the
PT2E int8 flow) and inductor.py (compiling, and counting the kernels that run).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from stages.run.registry import register


@dataclass(frozen=True)
class Variant:
    name: str
    runtime: str  # the runtime whose loader opens it
    source: str | None  # the variant it is made from; None for a trained or imported model
    int8: bool
    # quantize's: (QuantContext) -> info; qat's: (QuantContext, FineTuned) -> info, or None
    # where it was not made; None for a variant that train or import writes
    make: Callable | None
    description: str
    # Its weights were fitted to the training images (train, import, qat). The report judges a
    # variant on training images only where its weights come from the reference's training
    # (stages/report/judging.py); a model fine-tuned or trained apart fits them differently.
    trained: bool = False
    stage: str = "quantize"  # whose run calls make: quantize or qat; "train" for fp32 and amp


@dataclass
class Loaded:
    """A variant ready to run, on the CPU unless it says otherwise."""

    predict: Callable  # float images (N, C, H, W) -> logits, a float32 CPU tensor
    call_for: Callable  # a batch -> a call without arguments, which the harness times
    op_counts: dict  # {"Conv": {"int8": n, "float": m}, ...}, of what really runs
    serving: str  # how it runs, in words, for the report
    precision: str = "fp32"  # of its float arithmetic: fp32, bf16 or fp16 (int8 variants: int8)
    device: str = "cpu"
    timer: str = "wall"  # "wall": the host's clock; "cuda-events": the GPU's (stages/runtimes/gpu)
    # (batch, calls) -> ms per call of each operator type, by the runtime's own profiler
    # (stages/runtimes/profilers.py); None where the runtime offers none.
    profile: Callable | None = None
    # (batch) -> how many times a call ran each oneDNN kernel, by the name oneDNN or OpenVINO
    # gives it (OpenVINO's: its Conv and Linear layers; PyTorch's: every primitive but
    # reorders): which instruction set really ran. None where the runtime does not say (ONNX
    # Runtime's MLAS).
    kernels: Callable | None = None


FLOAT = "float"  # a source that means the run's float model: amp, or an imported fp32
VARIANTS: dict[str, Variant] = {}  # in the order the report lists them: runtime by runtime
LOADERS: dict[str, Callable] = {}  # runtime -> load(run, name, threads) -> Loaded


def declare(name: str, *, runtime: str, source: str | None, int8: bool, description: str,
            make: Callable | None = None, trained: bool = False,
            stage: str = "quantize") -> None:
    """Register a variant; without ``make``, one that train or import writes and its runtime
    only loads. It is listed after the variants of its runtime registered before it, wherever
    it is registered (runtimes/qat.py registers a PyTorch, an ONNX Runtime and an OpenVINO
    variant)."""
    register(VARIANTS, name)(Variant(name, runtime, source, int8, make, description, trained,
                                     stage))
    runtimes = list(dict.fromkeys(v.runtime for v in VARIANTS.values()))
    listed = sorted(VARIANTS.values(), key=lambda v: runtimes.index(v.runtime))  # stable
    VARIANTS.clear()
    VARIANTS.update((v.name, v) for v in listed)


def variant(name: str, **fields):
    """Decorator: register a variant made by quantize (or ``stage``) with the decorated
    function."""

    def add(make: Callable) -> Callable:
        declare(name, make=make, **fields)
        return make

    return add


def loader(runtime: str):
    """Decorator: the function that opens every variant of ``runtime`` (one per runtime)."""
    return register(LOADERS, runtime)


def load(run, name: str, threads: int) -> Loaded:
    """``name`` of ``run`` ready to run here; warns where it was made for VNNI and this CPU
    has none (vnni_mismatch)."""
    import warnings

    mismatch = vnni_mismatch(run, name)
    if mismatch:
        warnings.warn(mismatch, stacklevel=2)
    return LOADERS[VARIANTS[name].runtime](run, name, threads)


def made_for_vnni(run, name: str) -> bool:
    """Whether ``name`` was quantized for a CPU with VNNI: full 8-bit weights (PT2E), or ONNX
    Runtime's weights without reduce_range."""
    quantization = run.entry(name).get("quantization") or {}
    options = quantization | (quantization.get("options") or {})  # ORT's: the record itself
    return options.get("weight_bits") == 8 or options.get("reduce_range") is False


def vnni_mismatch(run, name: str) -> str | None:
    """Why ``name`` may compute wrongly on this CPU: made where VNNI ran it (full 8-bit weights,
    stages/runtimes/pt2e.py and onnxruntime.py), it runs here without VNNI, whose AVX2 int8
    products can saturate their 16-bit sums (full-range weights drifted the tiny model's logits
    by half their spread on an AVX2 EPYC); None where it fits this CPU."""
    from stages.measure.machine import cpu_has_vnni

    if cpu_has_vnni() or not made_for_vnni(run, name):
        return None
    return (f"{name} was made on a CPU with VNNI (full 8-bit weights), and this one has none, "
            "where int8 products can saturate: make it again on this CPU (pipeline quantize) "
            "before trusting its figures here")


RECOMMENDED = "recommended"


def resolve(run, variant: str) -> str:
    """A variant of ``run`` by name; "recommended" is the one its report recommends."""
    import json

    from stages.run.errors import UsageError

    measured = None  # the report's row of it, for "recommended"
    if variant == RECOMMENDED:
        if "report/report.json" not in run.artifacts():
            raise UsageError(f"run {run.name!r} has no report yet, so nothing is recommended; "
                             "run 'pipeline report' first, or name a variant")
        report = json.loads(run.verified_path("report/report.json").read_text())
        variant = report["verdict"]["recommended"]
        measured = next((r for r in report["models"] if r["name"] == variant), None)
    present = [name for name in VARIANTS if name in run.artifacts()]
    if variant not in present:
        raise UsageError(f"run {run.name!r} has no variant {variant!r}; it has: "
                         f"{', '.join(present) or 'none'} (or {RECOMMENDED})")
    if measured and _made_again(measured, run.entry(variant)):
        raise UsageError(f"run {run.name!r}: its report recommends {variant}, which was made "
                         "again since the report measured it; run 'pipeline report' again, or "
                         "name a variant")
    return variant


def _made_again(row: dict, entry: dict) -> bool:
    """Whether a variant's files differ from those its report row measured: OpenVINO's .bin
    too, which a variant made again with other weights changes while its .xml may not. Rows
    of older reports lack the digests, and are taken as they are."""
    if "sha256" in row and row["sha256"] != entry["sha256"]:
        return True
    return ("companions_sha256" in row and
            row["companions_sha256"] != [f["sha256"] for f in entry.get("files", [])])


def made_by_quantize() -> list[str]:
    return [v.name for v in VARIANTS.values() if v.stage == "quantize"]


def summarize_ops(counts: dict[str, dict[str, int]]) -> str:
    return ", ".join(f"{kind} {c['int8']}/{c['int8'] + c['float']} int8"
                     for kind, c in sorted(counts.items())) or "no Conv/Linear ops"


# The runtimes register themselves on import, in the report's order.
from stages.runtimes import pytorch  # noqa: E402,F401,I001  isort: skip
from stages.runtimes import onnxruntime  # noqa: E402,F401  isort: skip
from stages.runtimes import openvino  # noqa: E402,F401  isort: skip
from stages.runtimes import qat  # noqa: E402,F401  isort: skip
