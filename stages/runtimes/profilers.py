"""Where a call's time goes, by operator type, measured by each runtime's own profiler.

Every function here times ``calls`` calls after one untimed call and returns milliseconds per
call for each operator type the runtime reports, as the runtime names it (ONNX Runtime's
`QLinearConv`, OpenVINO's `Convolution`, PyTorch's `onednn::qconv2d_pointwise`): the report
groups them. A profiler adds its own overhead, so these figures say where the time goes, not
how long a call takes: the report's latency harness says that.

- ONNX Runtime: the session's profiling (`enable_profiling`), each node's kernel time, from
  the runs after the first;
- OpenVINO: the CPU plugin's performance counters (`PERF_COUNT`), the real time of each node
  that executed;
- PyTorch: `torch.profiler`, each operator's self time on the calling thread (an operator's
  parallel region counts once, as wall time), so that nested operators are not counted twice.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Callable


def onnxruntime_profile(open_session: Callable[[str], object], batch,
                        calls: int) -> dict[str, float]:
    """ms per call of each ONNX operator type, from a session that ``open_session(prefix)``
    opens with profiling on, its profile written under ``prefix``."""
    from stages.runtimes.onnx_export import INPUT_NAME, OUTPUT_NAME

    with tempfile.TemporaryDirectory() as folder:
        session = open_session(str(Path(folder) / "ort"))
        feed = {INPUT_NAME: batch.numpy()}
        for _ in range(calls + 1):
            session.run([OUTPUT_NAME], feed)
        events = json.loads(Path(session.end_profiling()).read_text())
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")
    timed = runs[-calls:]  # the first run allocates and is left out
    totals: dict[str, float] = defaultdict(float)
    for event in events:
        if event.get("cat") != "Node" or not event.get("name", "").endswith("_kernel_time"):
            continue
        if any(start <= event["ts"] <= end for start, end in timed):
            totals[event["args"]["op_name"]] += event["dur"] / 1000.0 / len(timed)
    return _timed(totals)


def _timed(totals: dict[str, float]) -> dict[str, float]:
    """Operators that took time: a profiler's whole microseconds round the smallest to 0."""
    return {op: ms for op, ms in totals.items() if ms > 0}


def openvino_profile(compiled, batch, calls: int) -> dict[str, float]:
    """ms per call of each OpenVINO node type that executed, from a model compiled with its
    performance counters on, keyed with the precision of the kernel that ran it
    ("Convolution (I8)"): an int8 model's float leftovers show as such."""
    import numpy as np
    import openvino as ov

    request = compiled.create_infer_request()
    array = np.ascontiguousarray(batch.numpy(), dtype=np.float32)
    request.infer({0: array})
    totals: dict[str, float] = defaultdict(float)
    executed = ov.ProfilingInfo.Status.EXECUTED
    for _ in range(calls):
        request.infer({0: array})
        for info in request.profiling_info:  # the counters of the last inference
            if info.status == executed:
                precision = info.exec_type.rsplit("_", 1)[-1].upper()
                key = f"{info.node_type} ({precision})" if precision in KERNEL_PRECISIONS \
                    else info.node_type
                totals[key] += info.real_time.total_seconds() * 1000.0 / calls
    return _timed(totals)


KERNEL_PRECISIONS = ("I8", "U8", "FP32", "F32", "BF16", "FP16", "F16")


def torch_profile(call: Callable[[], object], calls: int) -> dict[str, float]:
    """ms per call of each PyTorch operator (and of each compiled graph's own code), by self
    time."""
    from torch.profiler import ProfilerActivity, profile

    call()
    profiler = profile(activities=[ProfilerActivity.CPU])
    with _native_stderr_silenced():  # Kineto prints "profiler_start" and a GPU probe's error
        profiler.start()
    try:
        for _ in range(calls):
            call()
    finally:
        with _native_stderr_silenced():
            profiler.stop()
    operators: dict[str, float] = {}
    for event in profiler.key_averages():
        if event.self_cpu_time_total > 0:
            name = torch_operator_name(event.key)
            operators[name] = operators.get(name, 0.0) + event.self_cpu_time_total / 1000 / calls
    return operators


def torch_operator_name(key: str) -> str:
    """A profiler event's name as the report prints it: Inductor's record of a compiled
    graph's call ("## Call CompiledFxGraph fabc12 ##", its self time being the generated
    wrapper's own work) as "compiled graph (Inductor's own code)"; a kernel its C++ wrapper
    calls through the C ABI without the ABI's prefix ("aoti_torch_cpu__qconv_pointwise_tensor"
    as "qconv_pointwise_tensor"); and each of Inductor's own fused kernels by what it fuses,
    so that one kind of kernel adds up ("graph_0_cpp_fused_quantize_per_tensor_3" as
    "cpp_fused_quantize_per_tensor")."""
    if key.startswith("## Call CompiledFxGraph"):
        return "compiled graph (Inductor's own code)"
    if key.startswith("aoti_torch_cpu_"):
        return key[len("aoti_torch_cpu_"):].lstrip("_")
    fused = re.fullmatch(r"graph_\d+_(cpp_fused_\w+?)_\d+", key)
    return fused.group(1) if fused else key


@contextlib.contextmanager
def _native_stderr_silenced():
    """File descriptor 2 pointed at /dev/null: what C++ code writes there is dropped (Python's
    own sys.stderr is flushed first and works again after)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def onednn_kernels(call: Callable[[], object]) -> dict[str, int]:
    """How many times one call ran each oneDNN kernel, as "<primitive> <implementation>"
    ("convolution brg_conv_fwd:avx512_core_amx"), read from oneDNN's verbose output
    (ONEDNN_VERBOSE's, switched on for the one call): which instruction set PyTorch's
    convolutions and linear layers really ran. oneDNN prints it with C's stdio on file
    descriptor 1, which is pointed at a file meanwhile."""
    import ctypes

    import torch

    libc = ctypes.CDLL(None)
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 1)
        try:
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                call()
        finally:
            libc.fflush(None)
            os.dup2(saved, 1)
            os.close(saved)
        captured.seek(0)
        lines = captured.read().decode(errors="replace").splitlines()
    kernels: dict[str, int] = {}
    for line in lines:
        fields = line.split(",")
        if fields[0] != "onednn_verbose" or "exec" not in fields:
            continue
        at = fields.index("exec")
        if len(fields) > at + 3 and fields[at + 2] != "reorder":
            kernel = f"{fields[at + 2]} {fields[at + 3]}"
            kernels[kernel] = kernels.get(kernel, 0) + 1
    return kernels
