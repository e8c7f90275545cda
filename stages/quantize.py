"""Quantize: make the deployable variants of a run's float model, runtime by runtime.

The float model is `amp` (or `fp32` where a run has no `amp`, as after `pipeline import`).
Calibration uses training images only; every choice (--auto, the accuracy budget, layers kept
float) is scored on held-out training images, never on the test split. Every variant is written
atomically, reloaded from disk, checked against what it predicted before it was written, and
registered in the manifest with what it contains. With --auto, where no post-training
configuration keeps within the accuracy budget, it goes on to quantization-aware training.
"""
from __future__ import annotations

import os

from stages import runtimes
from stages.run.artifacts import Run
from stages.run.errors import PipelineError, UsageError
from stages.run.progress import say
from stages.runtimes.context import context, source_of


def plan(run: Run, methods: tuple[str, ...]) -> list[str]:
    """The variants to make, in registry order, with the sources they need and the run lacks
    (ort-static needs onnx-fp32, openvino-int8 needs openvino-fp32)."""
    wanted = set(methods)
    for name in list(wanted):
        source = source_of(run, name)
        while source and source not in wanted and source not in run.artifacts():
            wanted.add(source)
            source = source_of(run, source)
    unmade = [n for n in wanted if runtimes.VARIANTS[n].stage != "quantize"
              and n not in run.artifacts()]
    if unmade:
        made_by_qat = [n for n, v in runtimes.VARIANTS.items() if v.stage == "qat"]
        raise UsageError(f"{', '.join(unmade)} cannot be made by quantize; "
                         f"{', '.join(made_by_qat)} come from 'pipeline qat'")
    return [name for name in runtimes.VARIANTS if name in wanted and
            runtimes.VARIANTS[name].stage == "quantize"]


def run(config, run: Run, qat_config=None) -> list[str]:
    """Make each variant config.methods asks for (all by default) from the run's float model;
    with config.auto, go on to quantization-aware training with ``qat_config`` (the qat stage's
    config; None: stop at post-training quantization) where no post-training configuration
    kept within the budget. The variants made, in order; one whose search kept nothing is
    named too, and is not in the manifest."""
    names = plan(run, config.methods)
    with context(run, config, "quantize", defer_compiles=True) as ctx:
        for name in names:
            say(f"quantize: {name} ...", quiet=config.quiet)
            runtimes.VARIANTS[name].make(ctx)
            if name not in ctx.deferred and name not in ctx.refused:
                _made(run, name, config.quiet)
        for name, check in ctx.deferred.items():
            say(f"quantize: {name}: compiling and checking ...", quiet=config.quiet)
            check()
            _made(run, name, config.quiet)
        run.record_config("quantize", run.recorded_config("quantize") | {
            "not_kept": ctx.refused})
    if config.auto and qat_config is not None:
        return names + escalate_to_qat(run, names, config.max_accuracy_drop, qat_config,
                                       quiet=config.quiet)
    return names


def run_as_deployed(config, target: Run, qat_config=None) -> list[str]:
    """run(), in a process of its own where this one caps oneDNN for bf16 training (an AMX
    CPU): quantize scores its candidates and times them for --auto, and the cap is not what a
    deployment gets. In the 224x224 chain it made openvino-bf16's scoring 2x slower and
    amp-compiled's 3 to 4x (AMX Xeon: 35 s against 16-17, 26 s against 6-8), and --auto
    would rank candidates as no deployment runs them. A QAT in bf16, which --auto may go on
    to, needs the cap, so stays here."""
    from stages.run import isolated

    bf16_qat = config.auto and qat_config is not None and qat_config.precision == "bf16"
    if isolated.deployment_environment() == dict(os.environ) or bf16_qat:
        return run(config, target, qat_config)
    try:
        return isolated.call("stages.quantize:_run_in_child", config, target, qat_config)
    except isolated.Crashed as crash:
        raise PipelineError(f"quantize: its process died ({crash}); please report this with "
                            "--debug output") from None
    finally:
        isolated.release()  # the report measures in a fresh process, as when run alone


def _run_in_child(doing, config, target: Run, qat_config) -> list[str]:
    doing(f"quantizing run {target.name}")  # what a crash's message names
    return run(config, target, qat_config)


def escalate_to_qat(run: Run, made: list[str], budget_points: float, qat_config, *,
                    quiet: bool) -> list[str]:
    """--auto's last step: says (on stderr, unless quiet: stdout holds the paths made) whether
    post-training quantization kept within the budget and, where it did not, runs the qat
    stage; the variants that made. A QAT that diverges made nothing, and the post-training
    variants still stand; any other failure is the stage's. config.json records the verdict."""
    from stages import qat
    from stages.run.errors import Diverged

    met, why = post_training_verdict(run, made, budget_points)
    say(f"--auto: {why}" + ("" if met else "; trying quantization-aware training"), quiet=quiet)
    run.record_config("quantize", run.recorded_config("quantize") | {"auto_verdict": why})
    if met:
        return []
    try:
        return qat.run(qat_config, run)
    except Diverged as exc:
        say(f"--auto: quantization-aware training made nothing: {exc}", quiet=quiet)
        run.record_config("quantize", run.recorded_config("quantize") | {
            "auto_qat": f"made nothing: {exc}"})
        return []


def _made(run: Run, name: str, quiet: bool) -> None:
    entry = run.entry(name)
    say(f"quantize: {name} -> {run.root / entry['path']} ({run.shipped_bytes(name) / 1e6:.1f} "
        f"MB, {runtimes.summarize_ops(entry['quantization']['op_counts'])})", quiet=quiet)


def post_training_verdict(run: Run, names: list[str], budget_points: float) -> tuple[bool, str]:
    """Whether some static int8 variant made by post-training quantization kept within the
    accuracy budget on the held-out images at 95% confidence, and a sentence saying which (or
    that none did): --auto goes on to quantization-aware training only when none did."""
    drops = {}
    for name in names:
        if name not in run.artifacts():  # searched, and nothing kept: its closest
            closest = run.recorded_config("quantize").get("not_kept", {}).get(name)
            if closest is not None:
                drops[name] = float("inf")
            continue
        quantization = run.entry(name).get("quantization") or {}
        if (quantization.get("options") or {}).get("dynamic"):
            continue  # dynamic int8 leaves convolutions float: nothing QAT would stand in for
        tuning = quantization.get("tuning")
        if tuning:
            chosen = tuning["chosen"]  # runs quantized before 2026-12-02 lack the bound
            drops[name] = chosen.get("worst_drop_points", chosen["drop_points"])
    within = sorted(n for n, drop in drops.items() if drop <= budget_points + 1e-9)
    if within:
        return True, (f"{', '.join(within)} kept within {budget_points:g} point(s) of the float "
                       "model after post-training quantization, so no quantization-aware "
                       "training is needed")
    if not drops:
        return True, "no static int8 variant was made, so there is nothing for QAT to rescue"
    losses = ", ".join(f"{n} {-d:+.2f} points at worst" if d != float("inf")
                       else f"{n} not kept" for n, d in sorted(drops.items()))
    return False, (f"no post-training configuration kept within {budget_points:g} point(s) of "
                   f"the float model on the held-out images at 95% confidence ({losses})")
