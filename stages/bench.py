"""One latency harness for PyTorch modules and ONNX Runtime sessions, and the machine it ran on."""
from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8",
             "asimddp")


def summarize(seconds: list[float]) -> dict:
    """p50, p90 and spread in milliseconds; p90 by linear interpolation between order stats."""
    if not seconds:
        raise ValueError("no timings to summarize")
    ms = sorted(s * 1000.0 for s in seconds)

    def percentile(q: float) -> float:
        position = (len(ms) - 1) * q
        low = int(position)
        high = min(low + 1, len(ms) - 1)
        return ms[low] + (ms[high] - ms[low]) * (position - low)

    return {"p50": percentile(0.5), "p90": percentile(0.9), "iqr": percentile(0.75) - percentile(0.25),
            "mean": statistics.fmean(ms),
            "stdev": statistics.stdev(ms) if len(ms) > 1 else 0.0, "min": ms[0], "max": ms[-1],
            "repeats": len(ms)}


def measure(call: Callable[[], object], warmup: int, repeats: int, max_seconds: float,
            clock: Callable[[], float] = time.perf_counter) -> dict:
    """Time ``call`` after ``warmup`` calls: ``repeats`` times, or fewer (at least 3) when the
    repeats would take longer than ``max_seconds`` (ConvInteger graphs can be 100x slower)."""
    for _ in range(warmup):
        call()
    seconds: list[float] = []
    started = clock()
    while len(seconds) < repeats:
        t0 = clock()
        call()
        seconds.append(clock() - t0)
        if len(seconds) >= 3 and clock() - started > max_seconds:
            break
    return summarize(seconds)


def torch_call(model, batch) -> Callable[[], object]:
    """One forward pass; on CUDA it waits for the kernels, since launches return at once."""
    import torch

    sync = torch.cuda.synchronize if batch.device.type == "cuda" else (lambda: None)

    def call():
        with torch.inference_mode():
            out = model(batch)
        sync()
        return out

    return call


def ort_call(session, batch) -> Callable[[], object]:
    from stages.export import INPUT_NAME

    feed = {INPUT_NAME: batch.numpy()}
    return lambda: session.run(None, feed)


def random_batch(shape: tuple[int, ...], seed: int = 0):
    """A batch of the real shape and dtype, random rather than zeros (zeros hit fast paths)."""
    import torch

    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def cpu_info() -> dict:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() in ("flags", "Features"):
                flags = set(value.split())
    except OSError:
        pass
    return {"model": model, "flags": [f for f in CPU_FLAGS if f in flags],
            "cores": os.cpu_count()}


def environment(threads: int) -> dict:
    import torch

    from stages.artifacts import versions

    return {"versions": versions(), "device": "cpu", "cpu": cpu_info(), "threads": threads,
            "cuda_available": torch.cuda.is_available(),
            "quantized_engine": torch.backends.quantized.engine,
            "platform": platform.platform()}
