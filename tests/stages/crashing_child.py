"""What the report's measuring child, quantize's child and qat's child run in the crash tests
(tests/stages/test_report.py, test_quantize.py, test_qat.py): the real child, with one variant's
calls dying of a real SIGSEGV (a read of address 0), or failing as a test needs it to there."""
import ctypes

CRASHING = "ort-static"
CRASHING_IN_AN_EXTRA = "onnx-fp32"  # while its kernels are read, after it was timed


def measure_crashing(doing, *args):
    from stages import runtimes
    from stages.report import worker

    load = runtimes.LOADERS["onnxruntime"]

    def crashing(run, name, threads):
        loaded = load(run, name, threads)
        if name == CRASHING:
            loaded.call_for = lambda batch: lambda: ctypes.string_at(0)
        if name == CRASHING_IN_AN_EXTRA:
            loaded.kernels = lambda batch: ctypes.string_at(0)
        return loaded

    runtimes.LOADERS["onnxruntime"] = crashing
    return worker.measure_in_child(doing, *args)


def quantize_crashing(doing, config, target):
    """quantize's child, with openvino-fp32's making dying of a real SIGSEGV: openvino-int8,
    made from it, cannot be made either."""
    import dataclasses

    from stages import quantize, runtimes

    variant = runtimes.VARIANTS["openvino-fp32"]
    runtimes.VARIANTS["openvino-fp32"] = dataclasses.replace(
        variant, make=lambda ctx: ctypes.string_at(0))
    return quantize._run_in_child(doing, config, target)


def _qat_child_with(make: dict, doing, config, run, names):
    """qat's child (stages/qat.py:_make_in_child) with the makers in ``make`` swapped in."""
    import dataclasses

    from stages import qat, runtimes

    for name, maker in make.items():
        runtimes.VARIANTS[name] = dataclasses.replace(runtimes.VARIANTS[name], make=maker)
    return qat._make_in_child(doing, config, run, names)


def qat_crashing(doing, config, run, names):
    """ort-qat's making dies of a real SIGSEGV: openvino-qat, read from it, is not made."""
    return _qat_child_with({"ort-qat": lambda ctx, tuned: ctypes.string_at(0)}, doing, config,
                           run, names)


def qat_failing(doing, config, run, names):
    """ort-qat's making fails (an error the stage does not catch)."""
    from stages.run.errors import PipelineError

    def fails(ctx, tuned):
        raise PipelineError("ort-qat: failed")

    return _qat_child_with({"ort-qat": fails}, doing, config, run, names)


def qat_openvino_refusing(doing, config, run, names):
    """ort-qat kept whatever its parity, and OpenVINO's compiler refusing openvino-qat."""
    from stages.run.errors import NotMade
    from stages.runtimes import openvino, qat

    def refuses(*_, **__):
        raise NotMade("OpenVINO's compile_model failed: a test's refusal")

    real = qat.parity_with_torch_qat
    qat.parity_with_torch_qat = lambda name, reference, logits: real(
        name, reference, logits) | {"top1_agreement": 1.0}
    openvino.compile_model = refuses
    return _qat_child_with({}, doing, config, run, names)
