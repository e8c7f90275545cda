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
  2.18 against 2.92 ms at batch 32 on the default run). The child starts without training's
  cap.

Timing in a child, rather than training in one, keeps one place for both; its cost is the
child's start and the compiles that quantize's process had already made (each compiled
variant is compiled again here).
"""
from __future__ import annotations

import json
from pathlib import Path

from stages.measure import machine
from stages.report.measuring import measure_variants
from stages.run import isolated
from stages.run.artifacts import Run, open_run, versions
from stages.run.errors import PipelineError
from stages.run.progress import say
from stages.runtimes import VARIANTS, gpu

# The function the child runs; a test points it at a wrapper that crashes a variant.
CHILD = "stages.report.worker:measure_in_child"
RUNTIME_PACKAGES = {"pytorch": "torch", "onnxruntime": "onnxruntime", "openvino": "openvino"}


def measure_in_child(doing: isolated.Doing, artifacts_dir: Path, run_name: str, config,
                     threads: int, scratch: Path, skip: list[str]):
    """In the child: measure_variants on the run, and the instruction set it ran with."""
    import torch

    torch.set_num_threads(threads)
    run = open_run(artifacts_dir, run_name)
    rows, measured = measure_variants(run, config, threads, scratch, skip=skip, doing=doing)
    return rows, measured | {"isa": machine.isa()}


def measure(run: Run, config, threads: int, scratch: Path) -> tuple[list[dict], dict]:
    """measure_variants in a child process, again without any variant that crashed it;
    ``measured["crashed"]`` lists those."""
    crashed: list[dict] = []
    while True:
        try:
            rows, measured = isolated.call(CHILD, run.artifacts_dir, run.name, config, threads,
                                           scratch, [c["name"] for c in crashed])
        except isolated.Crashed as crash:
            record = crash_record(crash)
            if record is None or record["name"] in {c["name"] for c in crashed}:
                raise PipelineError(f"the report's measuring process died with {crash}, "
                                    "outside any variant; run again with --debug") from None
            crashed.append(record)
            say(f"report: {record['name']} crashed ({record['signal']} while "
                f"{record['phase']}); measuring the other variants again without it",
                quiet=config.quiet)
            continue
        return rows, measured | {"crashed": crashed}


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
            "cpu_flags": machine.cpu_info()["flags"],
            "onednn_max_cpu_isa": isolated.deployment_environment().get(
                "ONEDNN_MAX_CPU_ISA", "not capped")}
