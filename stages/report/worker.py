"""The report's measuring runs in a process of its own (stages/run/isolated.py), for two reasons
measured on a Xeon with AMX:

- A runtime's native crash costs its variant, not the report: OpenVINO 2026.4.1 died with
  SIGSEGV in an AMX kernel timing mobilenet_v3_large's openvino-int8 at batch 1, and took the
  report stage with it. Here the process dies, the variant that was running gets a row that
  says so (signal, what it was doing, batch size, instruction set), and the rest is measured
  again without it.
- Every variant is timed with the instruction set its deployment gets. bf16 training on an
  AMX CPU caps oneDNN for the process that trained, and the cap reached OpenVINO and every
  int8 kernel, so a chained report and one run alone timed different kernels (openvino-int8
  2.28 against 2.88 ms at batch 32 on the default run). The child starts without training's
  cap.

Timing in a child, rather than training in one, keeps one place for both; its cost is the
child's start and the compiles that quantize's process had already made (each compiled
variant is compiled again here, though the C++ library quantize built for it comes from
Inductor's disk cache: stages/runtimes/inductor.py).

On a CPU with AMX a second child times the int8 and bf16 variants that run oneDNN (PyTorch's
compiled ones, OpenVINO's) at the verdict's batch size with oneDNN capped below AMX: at 32x32
the default run's openvino-int8 ran 1.38x faster that way (2.14 against 2.96 ms at batch 32).
Each such row gets `below_amx`, and a variant faster there beyond noise a warning;
`pipeline export` writes the cap into that variant's folder (stages/export).
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from stages.data.datasets import splits_of_run
from stages.measure import contention, machine, timing
from stages.report.measuring import BELOW_AMX_PHASE, EXTRAS, measure_variants, time_variants
from stages.run import isolated
from stages.run.artifacts import Run, versions
from stages.run.errors import PipelineError
from stages.run.progress import say
from stages.run.trained import FLOAT_MODELS
from stages.runtimes import VARIANTS, gpu, load

BELOW_AMX = "AVX512_CORE_BF16"  # the highest oneDNN ISA without AMX (VNNI and BF16 kept)
ONEDNN_RUNTIMES = ("pytorch", "openvino")  # whose kernels the cap reaches (not ORT's MLAS)

# The function the child runs; a test points it at a wrapper that crashes a variant.
CHILD = "stages.report.worker:measure_in_child"
RUNTIME_PACKAGES = {"pytorch": "torch", "onnxruntime": "onnxruntime", "openvino": "openvino"}


def measure_in_child(doing: isolated.Doing, run: Run, config, threads: int, scratch: Path,
                     skip: list[str], plain: list[str] = ()):
    """In the child: measure_variants on the run, and the instruction set it ran with."""
    import torch

    torch.set_num_threads(threads)
    rows, measured = measure_variants(run, config, threads, scratch, skip=skip, plain=plain,
                                      doing=doing)
    return rows, measured | {"isa": machine.isa()}


def measure(run: Run, config, threads: int, scratch: Path) -> tuple[list[dict], dict]:
    """measure_variants in a child process, again without any variant that crashed it;
    ``measured["crashed"]`` lists those. A crash in an extra (profiling, reading kernels)
    costs that extra, not the variant's figures: ``measured["extras_crashed"]``."""
    crashed: list[dict] = []
    extras: list[dict] = []
    while True:
        try:
            rows, measured = isolated.call(CHILD, run, config, threads, scratch,
                                           [c["name"] for c in crashed],
                                           [c["name"] for c in extras])
        except isolated.Crashed as crash:
            record = crash_record(crash)
            if record is None or record["name"] in {c["name"] for c in crashed}:
                raise PipelineError(f"the report's measuring process died with {crash}, "
                                    "outside any variant; run again with --debug") from None
            in_extra = record["phase"] in EXTRAS and record["name"] not in {
                c["name"] for c in extras}
            (extras if in_extra else crashed).append(record)
            say(f"report: {record['name']} crashed ({record['signal']} while "
                f"{record['phase']}); measuring again " + (
                    f"without its {record['phase']}" if in_extra else "without it"),
                quiet=config.quiet)
            continue
        if config.time_below_amx:
            extras += time_below_amx(run, config, threads, rows, measured["timing_conditions"])
        return rows, measured | {"crashed": crashed, "extras_crashed": extras}


def amx_unused() -> bool:
    """No AMX to cap: the CPU has none, or the user capped oneDNN themselves."""
    return (not {"amx_int8", "amx_bf16"} & set(machine.cpu_info()["flags"])
            or "ONEDNN_MAX_CPU_ISA" in isolated.deployment_environment())


def onednn_rows(rows: list[dict]) -> list[str]:
    """The CPU rows whose int8 or bf16 kernels are oneDNN's, the trained models served eager
    (amp under autocast) left out; torch-qat, a compiled PT2E graph as torch-static is, in."""
    return [row["name"] for row in rows if row["device"] == "cpu"
            and row["precision"] in ("int8", "bf16") and row["variant"] not in FLOAT_MODELS
            and VARIANTS[row["variant"]].runtime in ONEDNN_RUNTIMES]


def time_below_amx(run: Run, config, threads: int, rows: list[dict],
                   timed_with_amx: dict) -> list[dict]:
    """Each int8 or bf16 CPU variant that runs oneDNN, but the trained models served eager,
    gets `below_amx`: its latency at the verdict's batch size (the largest) with oneDNN capped
    at BELOW_AMX, timed in a child of its own in the same harness, and `amx_speedup`, how many
    times faster it ran with AMX than without (below 1: AMX lost), and `timing_clean`, whether
    both sessions (``timed_with_amx``: the report's timing conditions) were. Returns the crash
    of that child, as report.json's `extras_crashed` lists it: the comparison is lost, not the
    report."""
    names = onednn_rows(rows)
    if not names or amx_unused():
        return []
    say(f"report: timing {len(names)} variants again with oneDNN capped at {BELOW_AMX} ...",
        quiet=config.quiet)
    config = dataclasses.replace(config, batch_sizes=(max(config.batch_sizes),))
    try:
        below = isolated.deployment_environment() | {"ONEDNN_MAX_CPU_ISA": BELOW_AMX}
        timings, isa, conditions = isolated.call("stages.report.worker:time_in_child", run,
                                                 config, threads, names, environment=below)
    except isolated.Crashed as crash:
        say(f"report: timing below AMX stopped: {crash}", quiet=config.quiet)
        record = crash_record(crash) or {"name": "a variant", "signal": crash.signal_name,
                                         "runtime": "its runtime"}
        return [record | {"phase": BELOW_AMX_PHASE, "onednn_max_cpu_isa": BELOW_AMX}]
    for row in rows:
        if row["name"] not in names:
            continue
        latency, faster = {}, {}
        for size, by_name in timings.items():
            capped = by_name[row["name"]]
            latency[size] = capped.summary()
            with_amx = timing.Timing([[ms / 1000 for ms in calls]
                                      for calls in row["latency_ms"][size]["rounds_ms"]])
            faster[size] = timing.speedup(capped, with_amx, paired=False)  # two sessions
        row["below_amx"] = {"onednn_max_cpu_isa": isa["onednn_max_cpu_isa"],
                            "latency_ms": latency, "amx_speedup": faster,
                            "timing_clean": contention.all_clean([conditions["clean"]] + [
                                session["clean"] for size, session in contention.sessions_of(
                                    timed_with_amx, "cpu").items() if size in timings])}
    return []


def time_in_child(doing: isolated.Doing, run: Run, config, threads: int,
                  names: list[str]) -> tuple[dict, dict, dict]:
    """In the capped child: the named variants timed together, as in measure_variants, the
    instruction set the child ran with, and what they were timed beside."""
    import torch

    torch.set_num_threads(threads)
    loaded = {name: load(run, name, threads) for name in names}
    timings, conditions = time_variants(loaded, splits_of_run(run), config, threads,
                                        doing=doing)
    return timings, machine.isa(), conditions


def crash_record(crash: isolated.Crashed) -> dict | None:
    """report.json's `crashed` entry for what the child was doing when it died, or None
    where it was not running a variant."""
    try:
        doing = json.loads(crash.doing)
    except ValueError:
        return None
    name = doing["row"]
    variant = gpu.ROWS.get(name, name)
    if variant not in VARIANTS:
        return None
    runtime = VARIANTS[variant].runtime
    package = RUNTIME_PACKAGES.get(runtime, runtime)
    return {"name": name, "variant": variant, "signal": crash.signal_name,
            "phase": doing["phase"], "batch_size": doing["batch_size"],
            "runtime": f"{package} {versions().get(package, 'unknown')}",
            "cpu_flags": machine.cpu_info()["flags"], "peak_rss_bytes": crash.peak_rss_bytes,
            "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            "onednn_max_cpu_isa": isolated.deployment_environment().get(
                "ONEDNN_MAX_CPU_ISA", "not capped")}
