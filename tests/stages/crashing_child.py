"""What the report's measuring child runs in the crash test (tests/stages/test_report.py):
the real child, with one variant's calls dying of a real SIGSEGV (a read of address 0)."""
import ctypes

CRASHING = "ort-static"


def measure_crashing(doing, *args):
    from stages import runtimes
    from stages.report import worker

    load = runtimes.LOADERS["onnxruntime"]

    def crashing(run, name, threads):
        loaded = load(run, name, threads)
        if name == CRASHING:
            loaded.call_for = lambda batch: lambda: ctypes.string_at(0)
        return loaded

    runtimes.LOADERS["onnxruntime"] = crashing
    return worker.measure_in_child(doing, *args)
