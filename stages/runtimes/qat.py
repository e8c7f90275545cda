"""The variants quantization-aware training makes, registered like every other: `torch-qat`
(the fine-tuned graph converted to int8, served by the PyTorch runtime), `ort-qat` (its
QDQ export, served by ONNX Runtime) and `openvino-qat` (that QDQ model read by OpenVINO),
with stage="qat": the qat stage (stages/qat.py)
fine-tunes the graph `prepare` gives it and hands the result, a FineTuned, to each maker.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from stages.data.subsets import calibration_batches, validation_halves
from stages.measure.evaluate import PARITY_MIN_AGREEMENT, compare_logits, dataset_accuracy
from stages.run.errors import PipelineError
from stages.run.files import converter_errors
from stages.runtimes import FLOAT, onnx_export, openvino, pt2e, qdq_onnx, variant
from stages.runtimes.onnxruntime import onnx_op_counts, ort_predict, ort_session
from stages.runtimes.pytorch import save_and_check


@dataclass
class FineTuned:
    """What the qat stage hands the makers: the graph `prepare` gave it, after fine-tuning
    (its fake quantizers hold the ranges), and the stage's record (its settings, epochs and
    history) for the manifest."""

    graph: object
    record: dict


def prepare(model, spec: dict, device):
    """The float ``model`` exported for training with fake quantizers in it (the QAT recipe of
    X86InductorQuantizer, runtimes/pt2e.py), on ``device``, in eval mode: its .train() and
    .eval() switch BatchNorm and dropout as a module's do."""
    prepared = pt2e.prepare_qat(pt2e.export_graph(model, spec, train=True),
                                pt2e.pt2e_options(qat=True)).to(device)
    from torchao.quantization.pt2e import allow_exported_model_train_eval

    allow_exported_model_train_eval(prepared)
    prepared.eval()
    return prepared


def observe(graph, on: bool) -> None:
    """Switch the observers of a prepared ``graph`` on or off; off, its quantization ranges
    stay as they are."""
    from torchao.quantization.pt2e import disable_observer, enable_observer

    graph.apply(enable_observer if on else disable_observer)


@variant("torch-qat", runtime="pytorch", source=FLOAT, int8=True, trained=True, stage="qat",
         description="fine-tuned with fake quantization (PT2E QAT), converted to int8")
def make_torch_qat(ctx, tuned: FineTuned) -> dict:
    """Converted to int8, saved and checked as torch-static is; judged against the float model
    on the half of the validation split the stage did not choose its epoch on."""
    import torch

    converted = pt2e.convert(tuned.graph)
    splits = ctx.splits
    judging = torch.utils.data.Subset(splits.val, validation_halves(len(splits.val))[1])
    reference = dataset_accuracy(ctx.float_model(), judging)
    accuracy = dataset_accuracy(converted, judging)
    recipe = {"options": pt2e.pt2e_options(qat=True), "float_layers": [],  # prepare's
              "qat": True}
    info = recipe | {"validation_drop_points": (reference - accuracy) * 100, **tuned.record}
    save_and_check(ctx, "torch-qat", converted, recipe, info)
    ctx.say(f"qat: torch-qat scores {accuracy:.2%} against the float model's {reference:.2%} "
            "on the half of the validation split it did not choose its epoch on")
    return info


@variant("ort-qat", runtime="onnxruntime", source="torch-qat", int8=True, stage="qat",
         description="torch-qat exported to ONNX QDQ, run by ONNX Runtime")
def make_ort_qat(ctx, tuned: FineTuned) -> dict | None:
    """torch-qat's int8 graph, as written, exported to ONNX where the exporter manages it: its
    quantize/dequantize pairs become QuantizeLinear/DequantizeLinear (a QDQ model), completed
    so that ONNX Runtime runs every conv and linear in int8 (runtimes/qdq_onnx.py), and kept
    where ONNX Runtime agrees with torch-qat. None where not made."""
    path = ctx.folder / "ort-qat.onnx"
    images = ctx.check_images()
    try:
        pools = onnx_export.export_onnx(pt2e.load_pt2e(ctx.run, "torch-qat"), images[:2], path)
    except PipelineError as exc:
        ctx.say(f"qat: ort-qat not made: {exc}")
        return None
    completed = qdq_onnx.complete_for_onnx_runtime(path, calibration_batches(
        ctx.splits, qdq_onnx.RESIDUAL_CALIBRATION_IMAGES, 64, ctx.config.seed))
    reference = ctx.logits_of("torch-qat", images)
    with converter_errors("ONNX Runtime", path):
        logits = ort_predict(ort_session(path, threads=1), images)
    parity = parity_with_torch_qat("ort-qat", reference, logits)
    if parity["top1_agreement"] < PARITY_MIN_AGREEMENT:
        cause = qdq_onnx.bias_rounding_cause(path, reference, images)
        path.unlink()
        ctx.say(f"qat: ort-qat not kept: ONNX Runtime agrees with torch-qat on only "
                f"{parity['top1_agreement']:.1%} of training images (max logit difference "
                f"{parity['max_abs_diff']:.3g}) once it fuses the QDQ pairs into its int8 "
                "kernels" + cause)
        return None
    info = {"exporter": "torch.onnx.export(dynamo=True) of torch-qat",
            "means_as_global_average_pool": pools, **completed,
            "parity_vs_torch_qat": parity}
    counts = onnx_op_counts(path)
    if not any(c["int8"] for c in counts.values()):  # as openvino-qat: not kept, not a failure
        path.unlink()
        ctx.say("qat: ort-qat not kept: ONNX Runtime runs none of its convolutions or linear "
                "layers in int8")
        return None
    ctx.register("ort-qat", path, info, fmt="onnx", op_counts=counts)
    return info


@variant("openvino-qat", runtime="openvino", source="ort-qat", int8=True, stage="qat",
         description="ort-qat's QDQ model read by OpenVINO, run in int8")
def make_openvino_qat(ctx, tuned: FineTuned) -> dict | None:
    """ort-qat's QDQ model (the fine-tuned ranges, as ONNX Runtime runs them) converted to
    OpenVINO IR, whose low-precision passes turn each quantize/dequantize pair into int8
    kernels, without the Sigmoid pairs added for ONNX Runtime and with its HardSigmoid gates
    left float as openvino-int8's are; kept where it agrees with torch-qat. The fine-tuning is
    the one torch-qat and ort-qat come from, not a second one with NNCF's own QAT, which
    measured no better (docs/design.md). None where not made."""
    if "ort-qat" not in ctx.run.artifacts():
        ctx.say("qat: openvino-qat not made: it is read from ort-qat, which was not kept")
        return None
    try:
        ov = openvino._openvino()
    except PipelineError as exc:
        ctx.say(f"qat: openvino-qat not made: {exc}")
        return None
    read, sigmoid_pairs = _ort_qat_for_openvino(ctx)
    try:
        model = ov.convert_model(str(read))
    except Exception as exc:  # OpenVINO's converter raises its own types
        ctx.say(f"qat: openvino-qat not made: OpenVINO cannot read ort-qat: "
                f"{str(exc).strip().splitlines()[0][:200]}")
        return None
    float_gates = openvino.unquantize_hard_gates(model)  # as openvino-int8 leaves them
    pools = openvino.means_as_avg_pools(model)  # as openvino-fp32's
    xml = ctx.folder / "openvino-qat.xml"
    weights = openvino.save_ir(model, xml, ctx.scratch)
    compiled = openvino.compile_model(openvino.core().read_model(str(xml)), threads=1)
    images = ctx.check_images()
    parity = parity_with_torch_qat("openvino-qat", ctx.logits_of("torch-qat", images),
                                   openvino.runner(compiled)[0](images))
    op_counts = openvino.runtime_op_counts(compiled)
    why = None
    if parity["top1_agreement"] < PARITY_MIN_AGREEMENT:
        why = (f"OpenVINO agrees with torch-qat on only {parity['top1_agreement']:.1%} of "
               f"training images (max logit difference {parity['max_abs_diff']:.3g})")
    elif not any(counts["int8"] for counts in op_counts.values()):
        why = "OpenVINO runs none of its convolutions or linear layers in int8"
    if why is not None:
        for path in (xml, weights):
            path.unlink()
        ctx.say(f"qat: openvino-qat not kept: {why}")
        return None
    info = {"converter": "openvino.convert_model of ort-qat (its Sigmoid pairs left out)",
            "precision_hint": "f32",
            "sigmoid_pairs_left_out": sigmoid_pairs, "float_excitation_multiplies": float_gates,
            "means_as_avg_pool": pools,
            "parity_vs_torch_qat": parity}
    ctx.register("openvino-qat", xml, info, fmt="openvino", companions=(weights,),
                 op_counts=op_counts)
    return info


def parity_with_torch_qat(name: str, reference, logits) -> dict:
    """How closely the variant ``name``'s logits follow torch-qat's on the check images: it is
    kept at PARITY_MIN_AGREEMENT of top-1 agreement or more."""
    return compare_logits(reference, logits)


def _ort_qat_for_openvino(ctx) -> tuple[Path, int]:
    """The file openvino-qat converts: ort-qat, or where its Sigmoids were given QDQ pairs for
    ONNX Runtime, a copy without them in the scratch folder (qdq_onnx.without_sigmoid_pairs);
    and how many pairs it left out."""
    import onnx

    path = ctx.run.verified_path("ort-qat")
    model = onnx.load(str(path))
    left_out = qdq_onnx.without_sigmoid_pairs(model)
    if not left_out:
        return path, 0
    copy = ctx.scratch / "ort-qat-for-openvino.onnx"
    onnx.save_model(model, str(copy))
    return copy, left_out
