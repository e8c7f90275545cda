"""Quantize: make the deployable variants of a run's float model, runtime by runtime.

The float model is `amp` (or `fp32` where a run has no `amp`, as after `pipeline import`).
Calibration uses training images only; every choice (--auto, the accuracy budget, layers kept
float) is scored on held-out training images, never on the test split. Every variant is written
atomically, reloaded from disk, compared with what it (or its source) predicted, and
registered in the manifest with what it contains. With --auto, where no post-training
configuration keeps within the accuracy budget, it goes on to quantization-aware training.
"""
from __future__ import annotations

from stages import runtimes
from stages.run.artifacts import Run
from stages.run.errors import NotMade, PipelineError, UsageError
from stages.run.progress import say
from stages.runtimes.context import MAKING, context, remove_leftovers, source_of, sources


def plan(run: Run, methods: tuple[str, ...]) -> list[str]:
    """The variants to make, in registry order, with the sources they need and the run lacks
    (ort-static needs onnx-fp32, openvino-int8 needs openvino-fp32), and those listed that run
    a planned one's own files (openvino-bf16 on openvino-fp32's IR): made again with it, since
    their sha256 would no longer match."""
    wanted, listed = set(methods), run.artifacts()
    for name in list(wanted):
        source = source_of(run, name)
        while source and source not in wanted and source not in listed:
            wanted.add(source)
            source = source_of(run, source)
    wanted |= {name for name in _listed_variants(run) if source_of(run, name) in wanted
               and listed[name]["path"] == listed.get(source_of(run, name), {}).get("path")}
    unmade = [n for n in wanted if runtimes.VARIANTS[n].stage != "quantize"
              and n not in run.artifacts()]
    if unmade:
        made_by_qat = [n for n, v in runtimes.VARIANTS.items() if v.stage == "qat"]
        raise UsageError(f"{', '.join(unmade)} cannot be made by quantize; "
                         f"{', '.join(made_by_qat)} come from 'pipeline qat'")
    return [name for name in runtimes.VARIANTS if name in wanted and
            runtimes.VARIANTS[name].stage == "quantize"]


def run(config, run: Run, qat_config=None, doing=lambda _: None) -> list[str]:
    """Make each variant config.methods asks for (all by default) from the run's float model;
    with config.auto, go on to quantization-aware training with ``qat_config`` (the qat stage's
    config; None: stop at post-training quantization) where no post-training configuration
    kept within the budget. The variants made, in order; one whose search kept nothing is
    named too, and is not in the manifest. ``doing`` is told which variant is being made (a
    crash costs that one: run_as_deployed)."""
    names = plan(run, config.methods)
    with context(run, config, "quantize", defer_compiles=True) as ctx:
        for name in names:
            if name in ctx.refused:  # made from a variant that could not be made
                continue
            say(f"quantize: {name} ...", quiet=config.quiet)
            doing(MAKING + name)
            try:
                runtimes.VARIANTS[name].make(ctx)
            except NotMade as exc:
                _not_made(ctx, names, name, exc)
                continue
            if name not in ctx.deferred and name not in ctx.refused:
                _made(run, name, config.quiet)
        for name, check in ctx.deferred.items():
            if name in ctx.refused:
                continue
            say(f"quantize: {name}: compiling and checking ...", quiet=config.quiet)
            doing(MAKING + name)
            try:
                check()
            except NotMade as exc:
                _not_made(ctx, names, name, exc)
                continue
            if name not in ctx.refused:  # a check may refuse it (a bf16 kernel off budget)
                _made(run, name, config.quiet)
        doing(f"recording what quantize made in run {run.name}")
        run.record_config("quantize", run.recorded_config("quantize") | {
            "not_kept": ctx.refused})
    if config.auto and qat_config is not None:
        return names + escalate_to_qat(run, names, config.max_accuracy_drop, qat_config,
                                       quiet=config.quiet)
    return names


STATIC_INT8 = ("torch-static", "ort-static", "openvino-int8")  # what quantization-aware
# training makes again from fine-tuned weights (torch-qat, ort-qat, openvino-qat)
CHILD = "stages.quantize:_run_in_child"  # a test swaps in a child whose variant crashes


def run_as_deployed(config, target: Run, qat_config=None) -> list[str]:
    """run(), its post-training part in a process of its own, for two reasons. A runtime's
    native crash (a SIGSEGV in a kernel, an abort) while one variant is made or checked costs
    that variant, not the stage: config.json's not_kept names it with the signal, and the
    others are made again in a fresh process without it and what is made from it. And where
    this process caps oneDNN for bf16 training (an AMX CPU), quantize scores and times its
    candidates as a deployment runs them: in the 224x224 chain the cap made openvino-bf16's
    scoring 2x slower and amp-compiled's 3 to 4x (AMX Xeon: 35 s against 16-17, 26 s against
    6-8), and --auto would rank candidates as no deployment runs them. The QAT that --auto may
    go on to fine-tunes here, as `pipeline qat` does (in bf16 it needs training's cap), and
    makes the variants read from torch-qat's files in a child of its own."""
    import copy

    from stages.run import isolated

    asked, crashed = copy.copy(config), {}
    first_plan = plan(target, config.methods)  # a source a crashed child made is named too
    try:
        while True:
            try:
                made = isolated.call(CHILD, asked, target)
                break
            except isolated.Crashed as crash:
                name = crash.doing.removeprefix(MAKING)
                if not crash.doing.startswith(MAKING) or name in crashed:
                    raise PipelineError(f"quantize: its process died ({crash}); please report "
                                        "this with --debug output") from None
                say(f"quantize: {name}: {crash}; making the others again without it",
                    quiet=config.quiet)
                planned = plan(target, asked.methods)
                for lost in (m for m in dict.fromkeys([*planned, *_listed_variants(target)])
                             if name in sources(target, m)):
                    crashed[lost] = (f"not made: its runtime crashed ({crash.signal_name}) "
                                     "while it was made" if lost == name else
                                     f"not made: it is made from {name}, whose runtime crashed")
                asked.methods = tuple(m for m in planned if m not in crashed)
                if not asked.methods:
                    made = []
                    break
    finally:
        isolated.release()  # the report measures in a fresh process, as when run alone
    if crashed:  # the crashed child's scratch folder, where no later child removed it
        remove_leftovers(target.root / "quantize")
    for name in crashed:  # what an earlier quantize made under the name is not this run's
        target.unregister(name)
    if crashed:
        recorded = target.recorded_config("quantize")
        target.record_config("quantize", recorded | {
            "not_kept": recorded.get("not_kept", {}) | crashed})
    made = list(dict.fromkeys([*(n for n in first_plan if n in made or n in crashed
                                 or n in target.artifacts()), *made, *crashed]))
    if config.auto and qat_config is not None:
        made += escalate_to_qat(target, made, config.max_accuracy_drop, qat_config,
                                quiet=config.quiet)
    return made


def _not_made(ctx, names: list[str], failed: str, exc: NotMade) -> None:
    """A converter that cannot take the model costs its variant and what is made from it, as
    a native crash does (run_as_deployed), not the stage."""
    ctx.refuse(failed, f"not made: {exc}")
    # What an earlier quantize made from it goes too: listed with no source, it failed the report.
    for later in dict.fromkeys([*names, *_listed_variants(ctx.run)]):
        if later != failed and later not in ctx.refused and failed in sources(ctx.run, later):
            ctx.refuse(later, f"not made: it is made from {failed}, which could not be made")


def _listed_variants(run: Run) -> list[str]:
    return [name for name in run.artifacts() if name in runtimes.VARIANTS]


def _run_in_child(doing, config, target: Run) -> list[str]:
    doing(f"quantizing run {target.name}")  # what a crash before any variant names
    return run(config, target, None, doing)


def escalate_to_qat(run: Run, made: list[str], budget_points: float, qat_config, *,
                    quiet: bool) -> list[str]:
    """--auto's last step: says (on stderr, unless quiet: stdout holds the paths made) whether
    post-training quantization kept within the budget and, where it did not, runs the qat
    stage; the variants that made. A QAT that diverges made nothing, and the post-training
    variants still stand; any other failure is the stage's. config.json records the verdict."""
    from stages import qat
    from stages.run.errors import Diverged

    met, why = post_training_verdict(run, made, budget_points)
    has_qat = "torch-qat" in run.artifacts()  # `pipeline qat` ran: its flags, not ours, hold
    say(f"--auto: {why}" + ("" if met else "; the run has its quantization-aware training "
                            "already (pipeline qat)" if has_qat else
                            "; trying quantization-aware training"), quiet=quiet)
    run.record_config("quantize", run.recorded_config("quantize") | {"auto_verdict": why})
    if met or has_qat:
        return []
    try:
        return qat.run(qat_config, run)
    except (Diverged, NotMade) as exc:  # the post-training variants still stand
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
    # Static int8 alone: dynamic int8 leaves convolutions float (nothing QAT would stand in
    # for), and the float variants scored the same way (openvino-bf16, amp-compiled) had met
    # the budget for every bf16 CPU, so --auto never went on to QAT there.
    for name in (n for n in names if n in STATIC_INT8):
        if name not in run.artifacts():  # searched, and nothing kept within the budget
            why = run.recorded_config("quantize").get("not_kept", {}).get(name)
            # One not made at all (its converter or runtime failed) says nothing of accuracy,
            # and QAT, made through the same converters, would not rescue it.
            if why is not None and not why.startswith("not made:"):
                drops[name] = float("inf")
            continue
        quantization = run.entry(name).get("quantization") or {}
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
