"""Quantization-aware training: fine-tune the run's float model with fake quantization through
torchao's PT2E QAT flow (prepare_qat_pt2e, then convert_pt2e), for where post-training
quantization loses too much.

torchvision's quantization recipe, scaled to a small data set (10 epochs by default): a low learning
rate, BatchNorm statistics frozen after half the epochs and the quantization ranges after 70% of
them, the last epoch kept unless an earlier one was better on validation beyond noise
(training/choice.py). The epochs are stages/training/loop.py's `fit`, the loop train drives too;
this stage adds its freezes, scoring with the observers off, the --tuning-time plan
(stages/training/plans.py) and its divergence check. The fine-tuned graph goes to the variants
registered for this stage (stages/runtimes/qat.py): `torch-qat`, `ort-qat` where the ONNX export of
its QDQ graph holds, and `openvino-qat` where OpenVINO runs that QDQ graph as torch-qat does; all
are reported like every other variant.
"""
from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass
from functools import partial

from stages import runtimes
from stages.data.loaders import EpochSampler, make_loader
from stages.data.subsets import validation_halves
from stages.measure.evaluate import dataset_hits
from stages.run.artifacts import Run
from stages.run.errors import Diverged, NotMade, PipelineError
from stages.run.progress import say
from stages.runtimes import qat as qat_runtime
from stages.runtimes.context import (
    MAKING,
    QuantContext,
    context,
    remove_leftovers,
    sources,
)
from stages.training import batchnorm, plans
from stages.training.loop import Hooks, Loop, Parts, Seen, decay_groups, fit
from stages.training.precision import Precision, grad_scaler, resolve_device, seed_everything
from stages.training.schedule import CosineSchedule


def switch_off_stochastic_depth(model) -> list[str]:
    """Switch stochastic depth off (torchvision's StochasticDepth, timm's DropPath) in a model
    about to be exported for training: there it becomes random ops (bernoulli_) that
    torchao's move_exported_model_to_eval leaves in place (it rewrites dropout and BatchNorm
    only), so the int8 model would go on dropping residual branches at random, as
    efficientnet_b0's did. The names of the blocks switched off."""
    names = []
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind == "StochasticDepth" and module.p > 0:
            module.p = 0.0
            names.append(name)
        elif kind == "DropPath" and getattr(module, "drop_prob", 0) > 0:
            module.drop_prob = 0.0
            names.append(name)
    return names


RANDOM_OPS = ("bernoulli", "rand", "normal", "uniform", "multinomial", "poisson")


def refuse_random_ops(graph, model_name: str) -> None:
    """An exported graph in eval mode that still draws random numbers would make a random
    int8 model: refused before any fine-tuning, naming the ops."""
    found = sorted({str(n.target) for n in graph.graph.nodes if n.op == "call_function"
                    and any(word in str(n.target) for word in RANDOM_OPS)})
    if found:
        raise PipelineError(f"qat: {model_name} draws random numbers in training that stay in "
                            f"its exported graph in eval mode ({', '.join(found)}), so its int8 "
                            "model would not be deterministic; use nn.Dropout for such noise, "
                            "or switch it off for fine-tuning")


def _precision(config) -> Precision:
    """auto: fp32. torchao's fake quantizers (fused_moving_avg_obs_fake_quant) take float32
    alone, so under autocast an activation that reaches one in half precision stops the
    fine-tuning: a model trained in bf16 (auto on a CPU with AVX-512 BF16) and fine-tuned under
    bf16 failed with "expected scalar type Float but found BFloat16" at its first step."""
    return Precision(config.fine_tunes_in)


@dataclass
class Tuning:
    """One fine-tuning as its hooks see it: the loop, the graph it trains, the plan (cut by
    --tuning-time), and the half of the validation split it chooses its epoch on."""

    config: object
    loop: Loop
    graph: object
    calibration: object  # training images that recompute BatchNorm statistics
    choosing: object
    plan: plans.Plan
    started: float


def fine_tune(config, ctx: QuantContext, device) -> qat_runtime.FineTuned:
    """The prepared QAT graph after fine-tuning (the epoch kept on the validation half it
    chooses on, observers off), and the stage's record."""
    import torch

    seed_everything(config.seed)
    splits = ctx.splits
    model = copy.deepcopy(ctx.float_model())
    stochastic_depth_off = switch_off_stochastic_depth(model)
    if stochastic_depth_off:
        say(f"qat: stochastic depth switched off in {len(stochastic_depth_off)} blocks for "
            "fine-tuning (exported for training it would stay random in the int8 model)",
            quiet=config.quiet)
    graph = qat_runtime.prepare(model, ctx.spec, device)
    refuse_random_ops(graph, ctx.spec["model"])
    # The epoch is chosen on half the validation split; the report judges torch-qat on the other.
    choosing = torch.utils.data.Subset(splits.val, validation_halves(len(splits.val))[0])
    tuning = Tuning(config, _loop(config, graph, splits, device), graph, splits.calibration,
                    choosing, plans.Plan(config.epochs, config.freeze_bn_after,
                                         config.freeze_observers_after), time.perf_counter())
    try:
        fit(tuning.loop, _hooks(tuning))
    except RuntimeError as exc:  # --precision bf16 or fp16 (_precision says why)
        half = tuning.loop.precision.name
        if half == "fp32":
            raise
        raise PipelineError(f"qat --precision {half} failed ({' '.join(str(exc).split())[:200]}"
                            "): torchao's fake quantizers take float32 alone, and fail where an "
                            "activation reaches one in half precision; fine-tune with "
                            "--precision fp32 (or auto)") from exc
    # Kept as scored, observers off, whether the best epoch's weights were loaded or the last
    # epoch's stay (its _end_epoch lets them go on where the plan has not frozen them yet).
    qat_runtime.observe(graph, False)
    graph.eval()
    plan = tuning.plan
    return qat_runtime.FineTuned(graph.cpu(), {
        "lr": config.lr, "tuning_time_s": config.tuning_time, "history": tuning.loop.history,
        "precision": tuning.loop.precision.name, "stochastic_depth_off": stochastic_depth_off,
        "chosen": tuning.loop.totals.chosen,
        "seconds": time.perf_counter() - tuning.started, "epochs": plan.epochs,
        "freeze_bn_after": plan.freeze_bn_after,
        "freeze_observers_after": plan.freeze_observers_after, "epochs_asked": config.epochs})


def _loop(config, graph, splits, device) -> Loop:
    """SGD with momentum, no Nesterov, weight decay 5e-4 and a cosine schedule without
    warm-up (cut where --tuning-time cuts the epochs); no gradient clipping."""
    import torch

    sampler = EpochSampler(len(splits.train), config.seed, batch_size=config.batch_size)
    loader = make_loader(splits.train, config.batch_size, sampler)
    optimizer = torch.optim.SGD(decay_groups(graph, 5e-4), lr=config.lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, CosineSchedule(config.epochs * len(loader), 0))
    precision = _precision(config)
    parts = Parts(graph, graph, optimizer, scheduler, grad_scaler(precision, device),
                  torch.nn.CrossEntropyLoss(), sampler, loader, [],
                  memory_format="channels_last" if device.type == "cuda" else "NCHW")
    return Loop("qat", parts, precision, device, config.epochs, config.batch_size,
                quiet=config.quiet)


def _hooks(tuning: Tuning) -> Hooks:
    """What qat adds to the loop: its freezes, scoring with the observers off, the
    --tuning-time plan, and Diverged where the loss or the weights become NaN."""
    return Hooks(score=partial(_score, tuning), start_epoch=partial(_freeze, tuning),
                 check=lambda seen, epoch, epoch_start: _check_loss(tuning, seen, epoch),
                 end_epoch=lambda epoch, record, improved: _end_epoch(tuning, epoch, record),
                 guard=lambda epoch, data_iterator: _divergence(tuning, epoch))


def _freeze(tuning: Tuning, epoch: int) -> None:
    """At the start of an epoch, in training mode: the freezes the plan has reached."""
    if epoch > tuning.plan.freeze_observers_after:
        qat_runtime.observe(tuning.graph, False)
    if epoch > tuning.plan.freeze_bn_after:
        batchnorm.freeze_graph(tuning.graph)


def _advice(tuning: Tuning) -> str:
    return f"lower --lr (now {tuning.config.lr:g})" + (
        " or use --precision fp32" if tuning.loop.precision.name != "fp32" else "")


@contextlib.contextmanager
def _divergence(tuning: Tuning, epoch: int):
    """torchao's observers assert min <= max, which NaN fails: weights that diverged reach an
    observer in the next forward, before the loss is checked (mnasnet0_5 on notMNIST,
    2026-12-02, in its first epoch). Told apart from any other assertion by the model's own
    state, not by torchao's wording."""
    try:
        yield
    except AssertionError:
        if not _has_non_finite(tuning.graph):
            raise
        raise Diverged(
            f"qat: the fake-quantized model diverged at epoch {epoch} step "
            f"{tuning.loop.pos.step_in_epoch + 1}: its weights or activations became NaN "
            f"or infinite; {_advice(tuning)}") from None


def _check_loss(tuning: Tuning, seen: Seen, epoch: int) -> None:
    if seen.first_bad >= 0:
        raise Diverged(f"qat: the loss became NaN or infinite at epoch {epoch}; "
                       f"{_advice(tuning)}")


def _score(tuning: Tuning, epoch: int):
    """The fake-quantized graph's hits on the half of the validation split it chooses on.
    Observers left on would fit the quantization ranges to the validation images while scoring
    them: ranges come from training images only, and the epoch kept is kept as scored."""
    graph, loop = tuning.graph, tuning.loop
    with _divergence(tuning, epoch):  # weights NaN after the epoch's last step meet it here
        if epoch <= tuning.plan.freeze_bn_after:  # the statistics it will be frozen with
            batchnorm.recompute_graph(graph, tuning.calibration, tuning.config.batch_size,
                                      loop.device)
    graph.eval()
    qat_runtime.observe(graph, False)
    return dataset_hits(graph, tuning.choosing, loop.device)


def _end_epoch(tuning: Tuning, epoch: int, record: dict) -> None:
    """Say how the epoch went, plan the epochs that fit --tuning-time, and let the observers
    go on where the plan has not frozen them."""
    config = tuning.config
    record["seconds"] = time.perf_counter() - tuning.started
    say(f"qat epoch {epoch}/{tuning.plan.epochs}: loss {record['loss']:.4f} validation "
        f"accuracy {record['val_accuracy']:.3f} (fake-quantized)", quiet=config.quiet)
    cut = plans.fitted_plan(config, epoch, record["seconds"])
    if cut.epochs < tuning.plan.epochs:
        tuning.plan = cut = plans.replanned(tuning.plan, cut, epoch)
        plans.cut(tuning.loop, cut.epochs)
        say(f"qat: --tuning-time {config.tuning_time:g}s fits {cut.epochs} of "
            f"{config.epochs} epochs at {record['seconds'] / epoch:.0f} s each; BatchNorm "
            f"frozen after {cut.freeze_bn_after}, ranges after {cut.freeze_observers_after}",
            quiet=config.quiet)
    if epoch < tuning.plan.freeze_observers_after:
        qat_runtime.observe(tuning.graph, True)


def _has_non_finite(model) -> bool:
    """Whether a parameter is NaN or infinite, or an observer has recorded a NaN (their ranges
    start at +-inf, so only NaN in a buffer tells)."""
    import torch

    return (any(not torch.isfinite(p).all() for p in model.parameters())
            or any(b.is_floating_point() and torch.isnan(b).any() for b in model.buffers()))


CHILD = "stages.qat:_make_in_child"  # a test swaps in a child whose variant crashes


def run(config, run: Run) -> list[str]:
    """Fine-tune, then make each variant registered for this stage; the names of those made.
    `torch-qat` is made here from the fine-tuned graph; those read from its files (`ort-qat`,
    and `openvino-qat` from that) in a process of their own, as quantize makes its variants
    (quantize.run_as_deployed): a runtime's native crash costs its variant, not the stage,
    and they are checked without training's oneDNN cap, as a deployment runs them."""
    device = resolve_device(config.device)
    names = [name for name, v in runtimes.VARIANTS.items() if v.stage == "qat"]
    from_files = [name for name in names if runtimes.VARIANTS[name].source in names]
    with context(run, config, "qat") as ctx:
        tuned = fine_tune(config, ctx, device)
        # An earlier fine-tuning's variants go, all before any is made: openvino-qat would
        # otherwise be read from the ort-qat of a fine-tuning this one replaced, and one left
        # listed where a later one failed would stand beside this fine-tuning's torch-qat.
        for name in names:
            run.unregister(name)
        made = _make(ctx, [name for name in names if name not in from_files], tuned)
        del tuned  # the child loads what it needs from the run: not held twice meanwhile
    return made + (_made_apart(config, run, from_files) if made else [])


def _make(ctx: QuantContext, names: list[str], tuned, doing=None) -> list[str]:
    made = []
    for name in names:
        if doing is not None:
            doing(MAKING + name)
        try:
            if runtimes.VARIANTS[name].make(ctx, tuned) is not None:
                made.append(name)
        except NotMade as exc:  # costs this one (and what is read from it), not the stage
            ctx.say(f"qat: {name} not made: {exc}")
            ctx.run.unregister(name)
    return made


def _make_in_child(doing, config, run: Run, names: list[str]) -> list[str]:
    doing(f"making the QAT variants of run {run.name}")  # what a crash before any names
    with context(run, config, "qat", record=False) as ctx:
        return _make(ctx, names, None, doing)


def _made_apart(config, run: Run, names: list[str]) -> list[str]:
    """``names`` made in a child (_make_in_child); where a runtime crashes it, the variant it
    was making and those read from it are not made, config.json's qat record says why, and
    the others are made again in a fresh child."""
    from stages.run import isolated

    left, lost, made = list(names), {}, []
    try:
        while left:
            try:
                made = isolated.call(CHILD, config, run, left)
                break
            except isolated.Crashed as crash:
                name = crash.doing.removeprefix(MAKING)
                if not crash.doing.startswith(MAKING) or name not in left:
                    raise PipelineError(f"qat: its process died ({crash}); please report this "
                                        "with --debug output") from None
                say(f"qat: {name}: {crash}; making the others again without it",
                    quiet=config.quiet)
                for gone in [n for n in left if name in sources(run, n)]:
                    run.unregister(gone)
                    lost[gone] = (f"not made: its runtime crashed ({crash.signal_name}) while "
                                  "it was made" if gone == name else
                                  f"not made: it is read from {name}, whose runtime crashed")
                    left.remove(gone)
    finally:
        isolated.release()
    if lost:  # the crashed child's scratch folder, where no later child removed it
        remove_leftovers(run.root / "quantize")
        recorded = run.recorded_config("qat")
        run.record_config("qat", recorded | {"not_kept": recorded.get("not_kept", {}) | lost})
    return made

