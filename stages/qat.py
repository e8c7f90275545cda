"""Quantization-aware training: fine-tune the run's float model with fake quantization through
torchao's PT2E QAT flow (prepare_qat_pt2e, then convert_pt2e), for where post-training
quantization loses too much.

torchvision's quantization recipe, scaled to a small data set (10 epochs by default): a low
learning rate, BatchNorm statistics frozen after half the epochs and the quantization ranges
after 70% of them, the epoch with the best validation accuracy kept. The result is `torch-qat`,
and `ort-qat` where the ONNX export of its QDQ graph holds; both are reported like every other
variant.
"""
from __future__ import annotations

import copy
import time
from typing import NamedTuple

from stages.data.datasets import (
    EpochSampler,
    calibration_batches,
    make_loader,
    validation_halves,
)
from stages.measure.evaluate import PARITY_MIN_AGREEMENT, compare_logits, dataset_accuracy
from stages.run.artifacts import Run
from stages.run.errors import Diverged, PipelineError
from stages.run.progress import progress, say
from stages.runtimes import onnx_export, qdq_onnx
from stages.runtimes import pytorch as torch_runtime
from stages.runtimes.context import QuantContext, context
from stages.runtimes.onnxruntime import onnx_op_counts, ort_predict, ort_session
from stages.training import batchnorm
from stages.training.loop import CosineSchedule, DeviceSums, Parts, decay_groups, train_step
from stages.training.precision import (
    Precision,
    grad_scaler,
    resolve_device,
    seed_everything,
)


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
    return Precision("fp32" if config.precision == "auto" else config.precision)


def fine_tune(config, run: Run, ctx: QuantContext, device) -> tuple[object, dict]:
    """The prepared QAT graph after fine-tuning (the epoch best on the validation half it
    chooses on), and its history."""
    import torch

    quantize_pt2e, _ = torch_runtime._pt2e()
    from torchao.quantization.pt2e import (
        allow_exported_model_train_eval,
        disable_observer,
        enable_observer,
        move_exported_model_to_eval,
        move_exported_model_to_train,
    )

    seed_everything(config.seed)
    splits = ctx.splits
    model = copy.deepcopy(ctx.float_model())
    stochastic_depth_off = switch_off_stochastic_depth(model)
    if stochastic_depth_off:
        say(f"qat: stochastic depth switched off in {len(stochastic_depth_off)} blocks for "
            "fine-tuning (exported for training it would stay random in the int8 model)",
            quiet=config.quiet)
    graph = torch_runtime.export_graph(model, ctx.spec, train=True)
    options = torch_runtime.pt2e_options()
    prepared = quantize_pt2e.prepare_qat_pt2e(
        graph, torch_runtime.make_quantizer(options, qat=True)).to(device)
    allow_exported_model_train_eval(prepared)  # .eval() where scoring calls it
    move_exported_model_to_eval(prepared)
    refuse_random_ops(prepared, ctx.spec["model"])
    # The epoch is chosen on half the validation split; the report judges torch-qat on the other.
    choosing = torch.utils.data.Subset(splits.val, validation_halves(len(splits.val))[0])
    sampler = EpochSampler(len(splits.train), config.seed)
    loader = make_loader(splits.train, config.batch_size, sampler)
    optimizer = torch.optim.SGD(decay_groups(prepared, 5e-4), lr=config.lr, momentum=0.9)
    plan = Plan(config.epochs, config.freeze_bn_after, config.freeze_observers_after)
    schedule = CosineSchedule(plan.epochs * len(loader), 0)  # re-planned where epochs are cut
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    precision = _precision(config)
    parts = Parts(prepared, prepared, optimizer, scheduler, grad_scaler(precision, device),
                  torch.nn.CrossEntropyLoss(), sampler, loader, [])
    advice = f"lower --lr (now {config.lr:g})" + (
        " or use --precision fp32" if precision.name != "fp32" else "")
    history, best, best_acc, step = [], None, -1.0, 0
    started = time.perf_counter()
    epoch = 0
    while epoch < plan.epochs:
        epoch += 1
        move_exported_model_to_train(prepared)
        if epoch > plan.freeze_observers_after:
            prepared.apply(disable_observer)
        if epoch > plan.freeze_bn_after:
            batchnorm.freeze_graph(prepared)
        sampler.set_epoch(epoch)
        sums = DeviceSums(device)
        try:
            for images, labels in progress(loader, desc=f"qat {epoch}/{plan.epochs}",
                                           quiet=config.quiet, total=len(loader)):
                train_step(parts, precision, device, _LoopConfig, images, labels, sums, step)
                step += 1
        except AssertionError:
            # torchao's observers assert min <= max, which NaN fails: weights that diverged
            # reach an observer in the next forward, before the epoch's loss check (mnasnet0_5
            # on notMNIST, 2026-12-02, in its first epoch). Told apart from any other assertion
            # by the model's own state, not by torchao's wording.
            if not _has_non_finite(prepared):
                raise
            raise Diverged(
                f"qat: the fake-quantized model diverged at epoch {epoch} step "
                f"{step % len(loader) + 1}: its weights or activations became NaN or infinite; "
                f"{advice}") from None
        seen = sums.read()
        if seen["first_bad"] >= 0:
            raise Diverged(f"qat: the loss became NaN or infinite at epoch {epoch}; {advice}")
        if epoch <= plan.freeze_bn_after:  # the statistics it will be frozen with
            batchnorm.recompute_graph(prepared, splits.calibration, config.batch_size, device)
        move_exported_model_to_eval(prepared)
        # Observers left on would fit the quantization ranges to the validation images while
        # scoring them: ranges come from training images only.
        prepared.apply(disable_observer)
        val_acc = dataset_accuracy(prepared, choosing, device)
        if val_acc > best_acc:  # kept with its observers off, as it was scored
            best_acc, best = val_acc, copy.deepcopy(prepared.state_dict())
        history.append({"epoch": epoch, "loss": seen["loss"] / seen["seen"],
                        "train_accuracy": seen["correct"] / seen["seen"],
                        "val_accuracy": val_acc, "seconds": time.perf_counter() - started})
        say(f"qat epoch {epoch}/{plan.epochs}: loss {history[-1]['loss']:.4f} validation "
            f"accuracy {val_acc:.3f} (fake-quantized)", quiet=config.quiet)
        cut = fitted_plan(config, epoch, history[-1]["seconds"])
        if cut.epochs < plan.epochs:
            plan = cut
            schedule.total_steps = plan.epochs * len(loader)
            say(f"qat: --tuning-time {config.tuning_time:g}s fits {plan.epochs} of "
                f"{config.epochs} epochs at {history[-1]['seconds'] / epoch:.0f} s each; "
                f"BatchNorm frozen after {plan.freeze_bn_after}, ranges after "
                f"{plan.freeze_observers_after}", quiet=config.quiet)
        if epoch < plan.freeze_observers_after:
            prepared.apply(enable_observer)
    prepared.load_state_dict(best)
    move_exported_model_to_eval(prepared)
    return prepared.cpu(), {"history": history, "precision": precision.name,
                            "stochastic_depth_off": stochastic_depth_off,
                            "seconds": time.perf_counter() - started,
                            "epochs": plan.epochs, "freeze_bn_after": plan.freeze_bn_after,
                            "freeze_observers_after": plan.freeze_observers_after,
                            "epochs_asked": config.epochs}


def _has_non_finite(model) -> bool:
    """Whether a parameter is NaN or infinite, or an observer has recorded a NaN (their ranges
    start at +-inf, so only NaN in a buffer tells)."""
    import torch

    return (any(not torch.isfinite(p).all() for p in model.parameters())
            or any(b.is_floating_point() and torch.isnan(b).any() for b in model.buffers()))


class Plan(NamedTuple):
    epochs: int
    freeze_bn_after: int
    freeze_observers_after: int


def fitted_plan(config, done: int, seconds: float) -> Plan:
    """The epochs that fit config.tuning_time at the pace of the ``done`` epochs so far (which
    took ``seconds``), never fewer than those done, with each freeze scaled alike so that a cut
    run still trains, then freezes BatchNorm, then the ranges."""
    asked = Plan(config.epochs, config.freeze_bn_after, config.freeze_observers_after)
    if config.tuning_time is None:
        return asked
    fits = max(done, min(config.epochs, int(config.tuning_time * done / max(seconds, 1e-9))))

    def scaled(after: int) -> int:
        return after if after == 0 else max(1, after * fits // config.epochs)

    return Plan(fits, scaled(config.freeze_bn_after), scaled(config.freeze_observers_after))


class _LoopConfig:
    """What train_step reads from a training config: no clipping in fine-tuning."""

    grad_clip = 0.0


def export_qdq(ctx: QuantContext, graph) -> dict | None:
    """`ort-qat`: the converted QAT graph exported to ONNX, where the exporter manages it; its
    quantize/dequantize pairs become QuantizeLinear/DequantizeLinear (a QDQ model)."""
    path = ctx.folder / "ort-qat.onnx"
    images = ctx.check_images()
    try:
        onnx_export.export_onnx(graph, images[:2], path)
    except PipelineError as exc:
        say(f"qat: ort-qat not made: {exc}", quiet=ctx.config.quiet)
        return None
    completed = qdq_onnx.complete_for_onnx_runtime(path, calibration_batches(
        ctx.splits, qdq_onnx.RESIDUAL_CALIBRATION_IMAGES, 64, ctx.config.seed))
    reference = ctx.logits_of("torch-qat", images)
    parity = compare_logits(reference, ort_predict(ort_session(path, threads=1), images))
    if parity["top1_agreement"] < PARITY_MIN_AGREEMENT:
        cause = qdq_onnx.bias_rounding_cause(path, reference, images)
        path.unlink()
        say(f"qat: ort-qat not kept: ONNX Runtime agrees with torch-qat on only "
            f"{parity['top1_agreement']:.1%} of training images (max logit difference "
            f"{parity['max_abs_diff']:.3g}) once it fuses the QDQ pairs into its int8 kernels"
            + cause, quiet=ctx.config.quiet)
        return None
    info = {"exporter": "torch.onnx.export(dynamo=True) of torch-qat", **completed,
            "parity_vs_torch_qat": parity}
    ctx.register("ort-qat", path, info, fmt="onnx", op_counts=onnx_op_counts(path))
    return info


def run(config, run: Run) -> list[str]:
    """Fine-tune, convert, save and check `torch-qat`, then export `ort-qat`."""
    import torch

    device = resolve_device(config.device)
    with context(run, config, "qat") as ctx:
        splits = ctx.splits
        prepared, record = fine_tune(config, run, ctx, device)
        quantize_pt2e, _ = torch_runtime._pt2e()
        converted = torch_runtime.plain_graph(quantize_pt2e.convert_pt2e(prepared))
        judging = torch.utils.data.Subset(splits.val, validation_halves(len(splits.val))[1])
        reference = dataset_accuracy(ctx.float_model(), judging)
        qat_acc = dataset_accuracy(converted, judging)
        recipe = {"options": torch_runtime.pt2e_options(), "float_layers": [], "qat": True}
        info = recipe | {"lr": config.lr, "tuning_time_s": config.tuning_time,
                         "validation_drop_points": (reference - qat_acc) * 100, **record}
        torch_runtime._finish(ctx, "torch-qat", converted, recipe, info)
        made = ["torch-qat"]
        if export_qdq(ctx, converted) is not None:
            made.append("ort-qat")
    say(f"qat: torch-qat scores {qat_acc:.2%} against the float model's {reference:.2%} on the "
        f"half of the validation split it did not choose its epoch on", quiet=config.quiet)
    return made
