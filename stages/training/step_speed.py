"""--precision auto on a CPU with bf16 instructions: bf16 unless its training steps are clearly
slower than fp32's, measured on the model, batch size and images training will use.

bf16 autocast does not always pay on a CPU. Under training's AMX cap (precision.py) the Xeon
here took 161 ms a step for mobilenet_v2 at 32x32 and batch 64 in bf16 against 81 ms in fp32,
and 115 against 109 ms for resnet18 (benchmarks/memory_format.py, docs/measurements.md); at
224x224 mobilenet_v2 was the other way round (2.6 s against 3.2 s). Under --time a slower step
is fewer epochs, so under --time the choice is measured, not assumed: one model of each
precision takes the same batches in turn, and bf16 is kept unless its median step is
BF16_SLOWER_BY times fp32's. The margin keeps a near tie (resnet18 above) where it was, in mixed
precision. With fixed epochs auto stays bf16: a timing near the margin would flip from run to
run, and the same seed must give the same weights (smallcnn's did not, once it was timed).
"""
from __future__ import annotations

import dataclasses
import statistics
import time

from stages.data.loaders import endless_batches
from stages.run.progress import say
from stages.training import distributed
from stages.training.loop import DeviceSums, build_parts, train_step
from stages.training.precision import Precision, auto_precision_note

BF16_SLOWER_BY = 1.25
WARMUP_STEPS = 1  # the first step of each allocates gradients, momentum and oneDNN's kernels
TIMED_STEPS = 3  # a gap of 1.25x or more stands out of three steps on a busy machine
PROBE_LR = 1e-3  # the steps' updates are thrown away; a small rate keeps them finite


def choose_precision(config, splits, precision: Precision, device) -> tuple[Precision, str]:
    """(the precision `amp` trains in, how it was chosen): what --precision gave or auto
    resolved to, or, where auto resolved to bf16 on a CPU under --time, the faster of bf16 and
    fp32 with bf16 given BF16_SLOWER_BY of room. Rank 0's measurement holds on every rank."""
    if config.precision != "auto":
        return precision, "--precision"
    quiet = config.quiet or not distributed.current().is_main
    if precision.name != "bf16" or device.type != "cpu":
        note = auto_precision_note(precision, config.precision, device)
        if note:
            say(note, quiet=quiet)
        return precision, note or "auto"
    if config.time is None:  # with fixed epochs a seed must give the same model every run
        return precision, "auto (timed against fp32 under --time only)"
    bf16, fp32 = distributed.broadcast(step_seconds(config, splits, device))
    measured = f"a training step at {bf16 * 1e3:.0f} ms in bf16 and {fp32 * 1e3:.0f} ms in fp32"
    if bf16 <= BF16_SLOWER_BY * fp32:
        return precision, f"auto, measured: {measured}"
    say(f"--precision auto: {measured} ({bf16 / fp32:.2f}x); `amp` trains in fp32 "
        "(--precision bf16 trains in bf16 anyway)", quiet=quiet)
    return Precision("fp32"), f"auto, measured: {measured}"


def step_seconds(config, splits, device) -> tuple[float, float]:
    """The median seconds of a training step in bf16 and in fp32 (TIMED_STEPS each, after
    WARMUP_STEPS), the two models taking the same batches in turn so that a burst of load on
    the machine falls on both."""
    probe = dataclasses.replace(config, lr=PROBE_LR, time=None)
    precisions = (Precision("bf16"), Precision("fp32"))
    models = [build_parts(probe, splits, precision, device) for precision in precisions]
    times: list[list[float]] = [[], []]
    for step, (images, labels) in zip(range(WARMUP_STEPS + TIMED_STEPS),
                                      endless_batches(models[0].sampler, models[0].loader)):
        for parts, precision, taken in zip(models, precisions, times):
            parts.trained.train()
            started = time.perf_counter()
            train_step(parts, precision, device, 0.0, images, labels, DeviceSums(device), step)
            if step >= WARMUP_STEPS:
                taken.append(time.perf_counter() - started)
    return statistics.median(times[0]), statistics.median(times[1])
