"""The one latency harness, for every runtime and for --auto alike, and the machine it ran on.

Fair timing on a shared, noisy machine: every variant is timed in each of several rounds, the
order rotated between rounds so that none always runs first or after the slowest, garbage
collection off while timing, and every variant gets the same number of calls. A speed-up is a
ratio of medians measured in the same rounds, with a bootstrap interval over the rounds, so
that two variants within noise of each other read as such.
"""
from __future__ import annotations

import gc
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8",
             "asimddp")


def _percentile(ms: list[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default)."""
    position = (len(ms) - 1) * q
    low = int(position)
    high = min(low + 1, len(ms) - 1)
    return ms[low] + (ms[high] - ms[low]) * (position - low)


def summarize(seconds: list[float]) -> dict:
    """p50, p90 and spread in milliseconds of a list of call times in seconds."""
    if not seconds:
        raise ValueError("no timings to summarize")
    ms = sorted(s * 1000.0 for s in seconds)
    return {"p50": _percentile(ms, 0.5), "p90": _percentile(ms, 0.9),
            "iqr": _percentile(ms, 0.75) - _percentile(ms, 0.25), "mean": statistics.fmean(ms),
            "min": ms[0], "max": ms[-1], "calls": len(ms)}


@dataclass
class Timing:
    """Seconds of every timed call of one variant, round by round."""

    rounds: list[list[float]]

    def summary(self) -> dict:
        return summarize([s for calls in self.rounds for s in calls]) | {
            "rounds": len(self.rounds)}

    def median_of(self, picked) -> float:
        return statistics.median(s for r in picked for s in self.rounds[r])


def interleaved(calls: dict[str, Callable[[], object]], rounds: int, calls_per_round: int,
                warmup: int, clock: Callable[[], float] = time.perf_counter) -> dict[str, Timing]:
    """Time every call ``rounds`` x ``calls_per_round`` times, rotating the order each round."""
    names = list(calls)
    for name in names:
        for _ in range(warmup):
            calls[name]()
    timings = {name: Timing([]) for name in names}
    was_enabled = gc.isenabled()
    try:
        for r in range(rounds):
            gc.collect()
            gc.disable()
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                call, seconds = calls[name], []
                call()  # untimed: whatever the previous variant left behind (spinning
                # worker threads, a cold cache) is paid here, not by the first timed call
                for _ in range(calls_per_round):
                    t0 = clock()
                    call()
                    seconds.append(clock() - t0)
                timings[name].rounds.append(seconds)
            if was_enabled:
                gc.enable()
    finally:
        if was_enabled:
            gc.enable()
    return timings


def speedup(reference: Timing, candidate: Timing, resamples: int = 2000,
            seed: int = 0) -> dict:
    """How many times faster ``candidate`` is than ``reference`` (ratio of medians), with a 95%
    percentile-bootstrap interval that resamples rounds: calls in one round share the
    machine's state, so the round is the unit that varies."""
    import numpy as np
    from scipy import stats

    rounds = min(len(reference.rounds), len(candidate.rounds))
    everything = range(rounds)
    point = reference.median_of(everything) / candidate.median_of(everything)
    if rounds < 2:
        return {"ratio": point, "low": point, "high": point}

    def ratio(picked, axis=-1):
        return np.apply_along_axis(
            lambda p: reference.median_of(p.astype(int)) / candidate.median_of(p.astype(int)),
            axis, picked)

    result = stats.bootstrap((np.arange(rounds),), ratio, n_resamples=resamples,
                             method="percentile", vectorized=True,
                             rng=np.random.default_rng(seed))
    low, high = result.confidence_interval
    return {"ratio": point, "low": float(min(low, point)), "high": float(max(high, point))}


def within_noise(interval: dict) -> bool:
    """A ratio whose interval holds 1: the two variants cannot be told apart in this run."""
    return interval["low"] <= 1.0 <= interval["high"]


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


def cpu_has_vnni() -> bool:
    """VNNI (AVX-512, AVX or AMX) multiplies uint8 by int8 without saturating; without it,
    int8 kernels need one operand of 7 bits (the weights, here) to stay exact."""
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & set(cpu_info()["flags"]))


def isa() -> dict:
    """What the kernels may use: ATen's vector ISA, and oneDNN's cap where one is set."""
    import torch

    return {"aten": torch.backends.cpu.get_cpu_capability(),
            "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", "not capped")}


def environment(threads: int) -> dict:
    import torch

    from stages.shared.artifacts import versions

    return {"versions": versions(), "device": "cpu", "cpu": cpu_info(), "isa": isa(),
            "threads": threads, "cuda_available": torch.cuda.is_available(),
            "platform": platform.platform()}
