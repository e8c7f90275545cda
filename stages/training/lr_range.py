"""A learning rate found for the model: the range test of Smith (2017), as fastai's `lr_find`
and Lightning's `Tuner.lr_find` run it.

A fresh copy of the model (same seed, so the same initial weights as the training that
follows) takes up to MAX_STEPS optimizer steps on training batches while the learning rate
rises exponentially from START_LR to END_LR, under the precision and batch size training will
use. The loss is smoothed (an exponential moving average, bias-corrected); the test stops once
it passes DIVERGED times its lowest value. The peak learning rate chosen is a fifth
(BELOW_CLIMB) of the learning rate where, past its minimum, the smoothed loss first climbs CLIMB
times its lowest value, and at most CEILING_PER_256 per 256 images a step. Where the test would
take more than twice training's steps, or under --time more than a fifth of the budget (its
first steps' pace tells), Goyal et al.'s linear-scaling rule gives the peak instead.

A network that learns slowly from chance (efficientnet_b0, mobilenet_v2 and mnasnet0_5 on
photos10 in fp32, their residual blocks started as the identity) may not move its loss in
MAX_STEPS steps of one each per learning rate: where the loss never fell, the test runs once
more over LONG_STEPS, each learning rate held three times as long. Where that one cannot be
read either (mobilenet_v2 on photos10 before models/build.py started those blocks as the
identity: 2.33 to 2.31 in 150 steps, 2.32 to 2.23 in 450), PROBE_STEPS steps at Goyal et al.'s
linear-scaling rule and at quarters of it, each from the same weights, pick the rate with the
lowest validation loss, once that loss is below guessing the classes' shares beyond noise.
Where no rate gets there, the data decides (`pixels_predict_labels`): a slow starter on images
whose pixels predict their labels (mnasnet0_5 on photos10 on the AMX Xeon, before its blocks
started as the identity) trains at the lowest loss, and labels that do not belong to the images
(shuffled) are refused as such.

The steepest descent is recorded and plotted, not chosen: on networks whose loss falls at any
learning rate at first (a poor initial scale, or easy early progress), it sits at the test's
first steps. Measured on notMNIST (docs/measurements.md's git history), in a test from 1e-4:
efficientnet_b0's steepest descent was at 1.3e-4 and mnasnet0_5's at 2.8e-4, where their
hand-tuned peaks were 0.02; the lowest loss sat at 1 to 3.4 times the hand-tuned peaks of the
four families tried.
"""
from __future__ import annotations

import dataclasses
import json
import math
import time

from stages.data.loaders import endless_batches
from stages.run.errors import PipelineError
from stages.run.files import atomic_write_text
from stages.run.progress import say
from stages.training import distributed
from stages.training.loop import DeviceSums, build_parts, train_step
from stages.training.lr_probe import (  # where no range test can be read
    RULE_PER_256,
    NothingLearned,
    pixels_predict_labels,
    probed_rate,
)

# 50 steps a decade: at 25 the loss of mobilenet_v2 on notMNIST had not fallen by the time it
# blew up. Starting at 1e-3 rather than 1e-4 moved the minima found 9 to 25% lower and
# saved a quarter to a third of the steps (docs/measurements.md's git history).
START_LR, END_LR = 1e-3, 1.0
MAX_STEPS = 150
LONG_STEPS = 3 * MAX_STEPS  # efficientnet_b0's loss: 2.36 to 2.25 in 150 steps, to 1.18 in 500
SMOOTHING = 0.98
DIVERGED = 3.0
# The edge where the loss turns up is read, not the minimum: on hard data the curve from
# scratch is a flat valley whose lowest point noise places. resnet18 on photos10 (bf16): lowest
# at 0.0111, within 5% of it up to 0.08, 10% above it at 0.136; its minimum over 2
# (0.00557, the rule before) trained to 60.60% on test in --time 10m, 0.025 to 66.00%, 0.05 to
# 64.70%; the edge over 5 is 0.0272. On notMNIST (this test's curves on the AMX Xeon) the edge
# over 5 is 0.6 to 1.9 times the minimum over 2 (resnet18 0.0226 against 0.034, 94.85% on test
# in --time 5m; mnasnet0_5 0.013-0.021 against 0.015, mobilenet_v2 0.021-0.033 against 0.025,
# efficientnet_b0 0.021-0.033 against 0.018; mobilenet_v3_large held to the ceiling by both).
# SGD's cosine holds its peak for many steps where the test held each rate for one, hence a
# fifth.
CLIMB = 1.1
BELOW_CLIMB = 5.0
# The peak is at most twice Goyal et al.'s linear-scaling rule for SGD with momentum (0.1 per
# 256 images a step, "Accurate, Large Minibatch SGD", 2017). The range test holds each learning
# rate for one step: mobilenet_v3_large's loss still fell at 0.36 there, and 0.18 made its
# training diverge in the fourth epoch (87.25% on notMNIST test; 94.50% at 0.05, same budget).
CEILING_PER_256 = 0.2
# Where the test would take more than twice the optimizer steps of the training it serves (one
# epoch at 224x224: resnet18's test took 11 minutes on the Xeon here, its epoch 1.5), the peak
# is Goyal et al.'s linear-scaling rule itself. Twice: the default chain on a CPU without bf16
# trains one model for 100 steps, and keeps its test.
RANGE_TEST = "range test"
LINEAR_SCALING = "linear-scaling rule (0.1 per 256 images a step; a range test would take more " \
                 "than twice the training's steps)"
# Under --time the tests may take a fifth of the budget, judged from their first steps' pace. A
# tenth had left the second test out for efficientnet_b0 and mobilenet_v2 on photos10
# (efficientnet_b0's "would take about 80 s, over the 29 s left"), and the linear-scaling rule's
# 0.025 then trained them to 58.65% and 58.15% in --time 10m; with a fifth the second test
# reads 0.0131 and 0.0071 and they reach 59.20% and 60.65% (docs/measurements.md, Zen 4).
TIME_SHARE = 0.2
PACE_STEPS = 6  # the first step (warm-up) left out, the pace of the next five
SKIPPED_START = 5  # the first steps' smoothed loss stands on too few batches to judge a slope
LEAST_FALL = 0.05  # the loss must fall by this share of its start for a choice to exist


class TooLong(PipelineError):
    """Under --time, a range test whose pace says it would take more than its share."""

    def __init__(self, seconds: float, steps: int, allowed: float):
        super().__init__(f"a range test of {steps} steps would take about {seconds:.0f} s, "
                         f"over the {max(allowed, 0.0):.0f} s left of its {TIME_SHARE:.0%} of "
                         "--time")


class NeverFell(PipelineError):
    """The range test's loss did not fall enough for a learning rate to be read from it."""

    def __init__(self, lrs: list[float], detail: str):
        tried = f"{lrs[0]:.1e} to {lrs[-1]:.1e}" if lrs else f"from {START_LR:.0e}"
        super().__init__(f"--lr auto: the training loss never fell while the learning rate "
                         f"rose over {tried} in {len(lrs)} steps ({detail}); check the data "
                         "and labels, or give --lr yourself")
        self.detail = detail


def ceiling(batch: int) -> float:
    """The highest peak learning rate --lr auto takes at ``batch`` images a step."""
    return CEILING_PER_256 * batch / 256


def peak_lr(config, splits, precision, device, run, saved: dict) -> tuple[float, str]:
    """(the peak learning rate, how it was found): --lr as given, or found by a range test
    under the precision and batch size training will use, once per run (a resume reads both
    back from ``saved``, the recorded train config), or, where the test's steps are more than
    twice training's (`planned_steps`), the linear-scaling rule; where no test can be read,
    the best of the rates probed once the data is shown to be learnable (`probed_rate`). The
    curve is kept in the run (train/lr-range.json) for the report."""
    if config.lr != "auto":
        return config.lr, "--lr"
    if "resolved_lr" in saved:
        return saved["resolved_lr"], saved.get("lr_found_by", RANGE_TEST)
    batch = config.batch_size * distributed.current().world_size
    planned = planned_steps(config, splits, precision)
    if planned is not None and MAX_STEPS > 2 * planned:
        lr = RULE_PER_256 * batch / 256
        say(f"--lr auto: {lr:.3g}, by the linear-scaling rule (0.1 per 256 images a step): a "
            f"range test takes up to {MAX_STEPS} steps, training {planned}",
            quiet=config.quiet)
        return lr, LINEAR_SCALING
    say(f"--lr auto: a learning-rate range test of up to {MAX_STEPS} steps ({START_LR:g} to "
        f"{END_LR:g}) ...", quiet=config.quiet)
    share = TIME_SHARE * config.time if config.time else None
    started = time.perf_counter()
    try:
        curve = range_test(config, splits, precision, device, seconds=share)
    except TooLong as exc:
        lr = RULE_PER_256 * batch / 256
        say(f"--lr auto: {lr:.3g}, by the linear-scaling rule: {exc}", quiet=config.quiet)
        return lr, f"linear-scaling rule (0.1 per 256 images a step; {exc})"
    except NeverFell as exc:
        if planned is not None and LONG_STEPS > 2 * planned:  # the second test would outrun it
            return _rule_after_one_test(config, splits, batch, exc, "a second test would take "
                                        f"more than twice the training's {planned} steps")
        say(f"--lr auto: the first test chose no learning rate ({exc.detail}); trying again "
            f"over {LONG_STEPS} steps, each learning rate held longer ...", quiet=config.quiet)
        left = share - (time.perf_counter() - started) if share is not None else None
        try:
            curve = range_test(config, splits, precision, device, LONG_STEPS, seconds=left)
        except TooLong as slow:
            return _rule_after_one_test(config, splits, batch, exc, str(slow))
        except NeverFell as again:
            if share is not None:  # the probes train 450 steps a rate: past the test's share
                return _rule_after_one_test(config, splits, batch, again, "under --time no "
                                            "rates are probed")
            return probed_rate(config, splits, precision, device, again)
    world = distributed.current()
    curve["ceiling"] = ceiling(batch)
    curve["uncapped"], curve["capped"] = curve["chosen"], curve["chosen"] > curve["ceiling"]
    curve["chosen"] = min(curve["chosen"], curve["ceiling"])
    if world.is_main:
        path = run.root / "train" / "lr-range.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(curve) + "\n")
        run.register("lr-range", path, kind="metrics", stage="train")
    capped = f", at most {curve['ceiling']:.3g} at batch {batch}" if curve["capped"] else ""
    say(f"--lr auto: {curve['chosen']:.3g} (lowest loss at {curve['minimum']:.3g}, "
        f"{CLIMB - 1:.0%} above it at {curve['climbed']:.3g}, {curve['steps']} steps{capped})",
        quiet=config.quiet)
    return curve["chosen"], RANGE_TEST


def _rule_after_one_test(config, splits, batch: int, never: NeverFell, too_long: str):
    """(the linear-scaling rule's rate, why) where ``never``'s test could not be read and
    going on would take too long (``too_long``: a second test of more than twice the training's
    steps or past its share of --time, or the probes under --time), once the pixels show the
    labels belong to the images (the probes that check it elsewhere would take too long)."""
    pixels, learnable = distributed.broadcast(pixels_predict_labels(splits, config.seed))
    if not learnable:
        raise NothingLearned(f"--lr auto: nothing was learned: the training loss never fell in "
                             f"the range test ({never.detail}), and {pixels}; check that the "
                             "labels belong to the images (shuffled labels look like this), or "
                             "give --lr yourself")
    lr = RULE_PER_256 * batch / 256
    say(f"--lr auto: the first test chose no learning rate ({never.detail}); {lr:.3g}, by the "
        f"linear-scaling rule: {too_long}", quiet=config.quiet)
    return lr, (f"linear-scaling rule (0.1 per 256 images a step; the range test's loss fell "
                f"too little to read ({never.detail}), and {too_long}; {pixels})")


def planned_steps(config, splits, precision) -> int | None:
    """The optimizer steps training will take in all (each model's epochs; the fp32 baseline
    is a second model where amp is not fp32), or None where --time plans them."""
    if config.time:
        return None
    batch = config.batch_size * distributed.current().world_size
    models = 2 if config.baseline and precision.name != "fp32" else 1
    return models * config.epochs * math.ceil(len(splits.train) / batch)  # the last batch too


def range_test(config, splits, precision, device, steps: int = MAX_STEPS,
               seconds: float | None = None) -> dict:
    """The curve (lrs, smoothed losses) and the learning rates read from it; NeverFell where
    the loss never fell; TooLong where its first steps' pace says all of them would take more
    than ``seconds`` (rank 0's pace decides for every rank)."""
    import torch

    probe = dataclasses.replace(config, lr=1.0, time=None)  # the schedule below sets the lr
    parts = build_parts(probe, splits, precision, device)
    growth = (END_LR / START_LR) ** (1.0 / max(1, steps - 1))
    parts.scheduler = torch.optim.lr_scheduler.LambdaLR(
        parts.optimizer, lambda step: START_LR * growth ** step)
    parts.trained.train()
    if not len(parts.loader):
        raise PipelineError("--lr auto: the training split holds no batch to test on")
    lrs, losses, average, lowest = [], [], 0.0, math.inf
    for images, labels in endless_batches(parts.sampler, parts.loader):
        if len(lrs) >= steps:
            break
        if len(lrs) == 1:
            paced = time.perf_counter()
        elif len(lrs) == PACE_STEPS and seconds is not None:
            projected = (time.perf_counter() - paced) / (PACE_STEPS - 1) * steps
            if distributed.broadcast(projected > seconds):
                raise TooLong(projected, steps, seconds)
        lr = parts.optimizer.param_groups[0]["lr"]
        sums = DeviceSums(device)
        train_step(parts, precision, device, probe.grad_clip, images, labels, sums, len(lrs))
        seen = sums.read()
        loss = seen.loss / max(seen.seen, 1)
        if seen.first_bad >= 0 or not math.isfinite(loss):
            break
        average = SMOOTHING * average + (1 - SMOOTHING) * loss
        smoothed = average / (1 - SMOOTHING ** (len(lrs) + 1))
        lrs.append(lr)
        losses.append(smoothed)
        lowest = min(lowest, smoothed)
        if len(lrs) > SKIPPED_START and smoothed > DIVERGED * lowest:
            break
    return {"lrs": lrs, "losses": losses, "steps": len(lrs), "start_lr": START_LR,
            "end_lr": END_LR} | choose(lrs, losses)


def choose(lrs: list[float], losses: list[float]) -> dict:
    """The learning rates read from a smoothed curve: `steepest` (the most negative slope of
    the loss against log(lr) before its minimum, for the plot), `minimum` (where the loss was
    lowest), `climbed` (past the minimum, where the loss first rose above `climb`, CLIMB, times
    its lowest; the test's last rate where it never did) and `chosen` (`climbed` over
    BELOW_CLIMB)."""
    if len(losses) <= SKIPPED_START + 2:
        raise NeverFell(lrs, "too few steps ran before the loss blew up")
    lowest_at = min(range(len(losses)), key=losses.__getitem__)
    start = losses[SKIPPED_START]
    if lowest_at <= SKIPPED_START or losses[lowest_at] > (1 - LEAST_FALL) * start:
        raise NeverFell(lrs, f"the smoothed loss went from {start:.3g} to at best "
                             f"{losses[lowest_at]:.3g}")
    slopes = [(losses[i + 1] - losses[i - 1]) / math.log(lrs[i + 1] / lrs[i - 1])
              for i in range(SKIPPED_START, lowest_at)]
    steepest = lrs[SKIPPED_START + min(range(len(slopes)), key=slopes.__getitem__)]
    climbed = next((lr for lr, loss in zip(lrs[lowest_at:], losses[lowest_at:])
                    if loss > CLIMB * losses[lowest_at]), lrs[-1])
    return {"steepest": steepest, "minimum": lrs[lowest_at], "climb": CLIMB, "climbed": climbed,
            "chosen": climbed / BELOW_CLIMB}
