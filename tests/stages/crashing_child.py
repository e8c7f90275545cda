"""What the report's measuring child and quantize's child run in the crash tests
(tests/stages/test_report.py, test_quantize.py): the real child, with one variant's calls dying
of a real SIGSEGV (a read of address 0)."""
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
