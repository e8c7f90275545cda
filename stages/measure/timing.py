"""The one latency harness, for the report, --auto and the benchmarks alike.

Fair timing on a shared, noisy machine:
- every variant is timed in each of several rounds, the order rotated between rounds so that
  none always runs first or after the slowest, garbage collection off while timing;
- a variant is timed only once the process is idle: a runtime whose threads go on spinning
  after its call returns (ONNX Runtime's pool spins for tens of milliseconds unless told not
  to, libgomp's for a few) would otherwise take the cores from whatever is timed next, so the
  harness waits until no thread of the process uses the CPU before it times the next variant;
- each variant's round holds as many calls as fill about ROUND_SECONDS (a 2 ms variant gets
  25 calls, a 150 ms one a single call), each round starting with one untimed call that brings
  its weights back into the caches (not for calls long enough that a cold cache is noise), and
  rounds go on until every variant has MIN_CALLS calls and every speed-up interval the caller
  cares about is as narrow as asked, or the rounds or the time budget run out.

A speed-up is a ratio of medians measured in the same rounds, with a percentile bootstrap
interval that resamples rounds (calls in one round share the machine's state, so the round is
the unit that varies), so that two variants within noise of each other read as such.
"""
from __future__ import annotations

import gc
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # annotations only: numpy is imported where it is used
    import numpy

ROUND_SECONDS = 0.05  # timed calls of one variant in one round fill about this much
MAX_CALLS_PER_ROUND = 50
MIN_CALLS = 20  # a p90 needs calls to stand on: adaptive timing goes on until each has these
NO_WARM_CALL_OVER = 0.02  # seconds: a call this long needs no untimed call to warm the caches
IDLE_WINDOW = 0.002  # seconds the harness sleeps to see whether other threads still run
IDLE_CPU_SHARE = 0.2  # below this share of one core used by other threads, the process is idle
IDLE_MAX_WAIT = 2.0


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
    """Seconds of every timed call of one variant, round by round, and how long the harness
    waited for the process to go idle before each round of it."""

    rounds: list[list[float]]
    idle_waits: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        waits = self.idle_waits or [0.0]
        return summarize([s for calls in self.rounds for s in calls]) | {
            "rounds": len(self.rounds), "idle_wait_ms_max": max(waits) * 1000.0,
            "round_spread": self.round_spread()}

    def round_spread(self) -> float:
        """How many times slower the slower quarter of the rounds ran than the faster quarter
        (upper over lower quartile of the rounds' medians). The same calls on the same input
        take the same time on a machine that stays the same, so a wide spread means something
        else took the machine during some of the rounds."""
        medians = sorted(statistics.median(calls) for calls in self.rounds if calls)
        if len(medians) < 2 or _percentile(medians, 0.25) <= 0:
            return 1.0
        return _percentile(medians, 0.75) / _percentile(medians, 0.25)


def wait_until_idle(max_wait: float = IDLE_MAX_WAIT, window: float = IDLE_WINDOW,
                    cpu: Callable[[], float] = time.process_time,
                    clock: Callable[[], float] = time.perf_counter,
                    sleep: Callable[[float], None] = time.sleep) -> float:
    """Sleep in short windows until the other threads of this process stop using the CPU (the
    process's CPU time, all threads together, hardly moves while this one sleeps); returns the
    seconds waited, at most ``max_wait``."""
    started = clock()
    while True:
        before, at = cpu(), clock()
        sleep(window)
        used, slept = cpu() - before, clock() - at
        if used <= IDLE_CPU_SHARE * slept or clock() - started >= max_wait:
            return clock() - started


def calls_per_round(seconds_per_call: float) -> int:
    """As many calls as fill ROUND_SECONDS, at least one and at most MAX_CALLS_PER_ROUND."""
    filling = math.ceil(ROUND_SECONDS / max(seconds_per_call, 1e-6))
    return max(1, min(filling, MAX_CALLS_PER_ROUND))


def interleaved(calls: dict[str, Callable[[], object]], rounds: int, repeats: int = 0,
                warmup: int = 1, *, max_rounds: int | None = None,
                done: Callable[[dict[str, Timing]], bool] | None = None,
                budget_seconds: float | None = None,
                clock: Callable[[], float] = time.perf_counter,
                idle: Callable[[], float] = wait_until_idle,
                timers: dict[str, Callable[[Callable], float]] | None = None,
                begin: Callable[[], object] | None = None,
                announce: Callable[[str], object] | None = None) -> dict[str, Timing]:
    """Time every call in at least ``rounds`` rounds, rotating the order each round.

    ``repeats`` timed calls per variant and round, or 0 for as many as fill ROUND_SECONDS
    (sized on one call after the ``warmup`` calls). Without ``done`` exactly ``rounds`` are
    timed. With it, rounds go on until every variant has MIN_CALLS calls and ``done(timings)``
    holds, or until ``max_rounds`` are timed or, past ``rounds``, ``budget_seconds`` have
    passed since timing began. ``begin`` is called once the warm-up calls are done, as the
    rounds start: a first call that compiles (torch.compile's workers are other processes)
    is not part of what the rounds ran beside. ``announce(name)`` is called before each
    variant's warm-up and each of its rounds: what crashed, where one does
    (stages/run/isolated.py)."""
    names = list(calls)
    announce = announce or (lambda name: None)
    wall = wall_timer(clock)
    timer = {name: (timers or {}).get(name, wall) for name in names}
    counts, warm = {}, {}
    for name in names:
        announce(name)
        for _ in range(warmup):
            calls[name]()
        seconds = timer[name](calls[name])
        counts[name] = repeats or calls_per_round(seconds)
        warm[name] = seconds < NO_WARM_CALL_OVER
    limit = max(rounds, max_rounds or rounds) if done is not None else rounds
    timings = {name: Timing([]) for name in names}
    started = clock()
    was_enabled = gc.isenabled()
    # Everything alive now (compiled models hold half a million objects) is left out of the
    # collections between rounds, which would otherwise take 0.6 s each.
    gc.collect()
    gc.freeze()
    if begin is not None:
        begin()
    try:
        for r in range(limit):
            gc.collect()
            gc.disable()
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                waited = idle()
                announce(name)
                call, seconds = calls[name], []
                if warm[name]:
                    call()  # untimed: brings this variant's weights back into the caches
                for _ in range(counts[name]):
                    seconds.append(timer[name](call))
                timings[name].rounds.append(seconds)
                timings[name].idle_waits.append(waited)
            if was_enabled:
                gc.enable()
            if r + 1 < rounds:
                continue
            if done is None or (budget_seconds is not None
                                and clock() - started >= budget_seconds):
                break
            enough = all(sum(map(len, t.rounds)) >= MIN_CALLS for t in timings.values())
            if enough and done(timings):
                break
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()
    return timings


def wall_timer(clock: Callable[[], float] = time.perf_counter) -> Callable[[Callable], float]:
    """Seconds one call takes on the host's clock: what a CPU variant costs."""
    def time_call(call: Callable) -> float:
        started = clock()
        call()
        return clock() - started

    return time_call


def cuda_timer(event: Callable[[], object]) -> Callable[[Callable], float]:
    """Seconds one call takes on the GPU: CUDA events recorded on the stream before and after
    it, the stream synchronized on the second, so that the time is the kernels' and not the
    launch's (a call returns as soon as its kernels are queued). ``event`` makes an event:
    ``lambda: torch.cuda.Event(enable_timing=True)``."""
    def time_call(call: Callable) -> float:
        start, end = event(), event()
        start.record()
        call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000.0  # CUDA events measure milliseconds

    return time_call


def _pooled_medians(timing: Timing, picks) -> "numpy.ndarray":
    """The median of the calls of each resample of rounds (one row of ``picks`` a resample)."""
    import numpy as np

    lengths = {len(r) for r in timing.rounds}
    if len(lengths) == 1:
        calls = np.asarray(timing.rounds, dtype=float)
        return np.median(calls[picks].reshape(len(picks), -1), axis=1)
    return np.array([statistics.median(s for r in row for s in timing.rounds[r])
                     for row in picks])


def speedup(reference: Timing, candidate: Timing, resamples: int = 2000,
            seed: int = 0, paired: bool = True) -> dict:
    """How many times faster ``candidate`` is than ``reference`` (ratio of medians), with a 95%
    percentile-bootstrap interval over the rounds, both resampled with the same rounds. Not
    ``paired`` (two sessions, apart in time): every round of each, each resampled alone."""
    import numpy as np

    if not paired:
        point = (statistics.median(s for r in reference.rounds for s in r)
                 / statistics.median(s for r in candidate.rounds for s in r))
        if min(len(reference.rounds), len(candidate.rounds)) < 2:
            return {"ratio": point, "low": point, "high": point}
        rng = np.random.default_rng(seed)
        medians = [_pooled_medians(t, rng.integers(0, len(t.rounds),
                                                   size=(resamples, len(t.rounds))))
                   for t in (reference, candidate)]
        low, high = np.percentile(medians[0] / medians[1], [2.5, 97.5])
        return {"ratio": point, "low": float(min(low, point)), "high": float(max(high, point))}
    rounds = min(len(reference.rounds), len(candidate.rounds))
    ref, cand = Timing(reference.rounds[:rounds]), Timing(candidate.rounds[:rounds])
    point = (statistics.median(s for r in ref.rounds for s in r)
             / statistics.median(s for r in cand.rounds for s in r))
    if rounds < 2:
        return {"ratio": point, "low": point, "high": point}
    picks = np.random.default_rng(seed).integers(0, rounds, size=(resamples, rounds))
    ratios = _pooled_medians(ref, picks) / _pooled_medians(cand, picks)
    low, high = np.percentile(ratios, [2.5, 97.5])
    return {"ratio": point, "low": float(min(low, point)), "high": float(max(high, point))}


def within_noise(interval: dict) -> bool:
    """A ratio whose interval holds 1: the two variants cannot be told apart in this run."""
    return interval["low"] <= 1.0 <= interval["high"]


def against(interval: dict, what: str, itself: bool = False) -> str:
    """A speed-up in words that claim no more than its interval: "faster" only where the
    interval excludes 1 (the report had said "1.02x (0.96-1.09) faster"); ``itself``: the
    variant is ``what``."""
    if itself:
        return f"it is {what}"
    figure = f"{interval['ratio']:.2f}x ({interval['low']:.2f}–{interval['high']:.2f})"
    if within_noise(interval):
        return f"{figure} against {what}, within noise: not measurably faster"
    return f"{figure} {'faster' if interval['low'] > 1 else 'slower'} than {what}"


def narrow_enough(reference_names: set[str], target: float,
                  resamples: int = 400) -> Callable[[dict[str, Timing]], bool]:
    """A ``done`` test for interleaved: every variant's speed-up against the fastest of
    ``reference_names`` (the float variants) has an interval with high/low at most ``target``,
    or lies wholly below 1/``target``. A variant slower than the fastest float beyond that
    margin is not what a verdict hangs on, and at sub-millisecond calls its interval may never
    narrow: in the default chain's report on Zen 4 (batch 1), fp32-compiled's stayed 0.22-0.28x
    over 36 rounds, and the session ran out its 20 s budget."""

    def done(timings: dict[str, Timing]) -> bool:
        medians = {n: statistics.median(s for r in t.rounds for s in r)
                   for n, t in timings.items()}
        fastest = min((n for n in timings if n in reference_names), key=medians.get,
                      default=None)
        if fastest is None:
            return True
        for name, timing in timings.items():
            if name != fastest:
                interval = speedup(timings[fastest], timing, resamples=resamples)
                narrow = interval["high"] <= target * interval["low"]
                if not narrow and interval["high"] * target >= 1.0:
                    return False
        return True

    return done


def random_batch(shape: tuple[int, ...], seed: int = 0):
    """A batch of the real shape and dtype, random rather than zeros (zeros hit fast paths)."""
    import torch

    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
