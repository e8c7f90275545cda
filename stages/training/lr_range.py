"""A learning rate found for the model: the range test of Smith (2017), as fastai's `lr_find`
and Lightning's `Tuner.lr_find` run it.

A fresh copy of the model (same seed, so the same initial weights as the training that
follows) takes up to MAX_STEPS optimizer steps on training batches while the learning rate
rises exponentially from START_LR to END_LR, under the precision and batch size training will
use. The loss is smoothed (an exponential moving average, bias-corrected); the test stops once
it passes DIVERGED times its lowest value. The peak learning rate chosen is a fifth
(BELOW_CLIMB) of the learning rate where, past its minimum, the smoothed loss first climbs CLIMB
times its lowest value, and at most CEILING_PER_256 per 256 images a step.

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
first steps. Measured on notMNIST (docs/measurements.md), in a test from 1e-4:
efficientnet_b0's steepest descent was at 1.3e-4 and mnasnet0_5's at 2.8e-4, where their
hand-tuned peaks were 0.02; the lowest loss sat at 1 to 3.4 times the hand-tuned peaks of the
four families tried.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import statistics

from stages.data.loaders import make_loader
from stages.run.errors import PipelineError
from stages.run.files import atomic_write_text
from stages.run.progress import say
from stages.training import distributed
from stages.training.loop import DeviceSums, build_parts, endless_batches, train_step

# 50 steps a decade: at 25 the loss of mobilenet_v2 on notMNIST had not fallen by the time it
# blew up. Starting at 1e-3 rather than 1e-4 moved the minima found 9 to 25% lower and
# saved a quarter to a third of the steps (docs/measurements.md).
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
RULE_PER_256 = 0.1
RANGE_TEST = "range test"
LINEAR_SCALING = "linear-scaling rule (0.1 per 256 images a step; a range test would take more " \
                 "than twice the training's steps)"
SKIPPED_START = 5  # the first steps' smoothed loss stands on too few batches to judge a slope
PROBE_STEPS = LONG_STEPS  # as long as the longer test: a slow starter gets its time
# mobilenet_v2 on photos10 in fp32: 2.3026 to 2.2338 in 450 steps, within noise (2.1152 in bf16)
PROBE_ROUNDS = 3
# Where no range test can be read, the rule's rate is not always one a network trains at:
# mobilenet_v2 on photos10 in fp32, after 450 steps from the same weights, scored a validation
# loss of 2.2338 at 0.025 (its training at that peak rose above chance and stopped on a plateau
# at 29%), 1.8061 at 0.00625 and 1.8495 at 0.00156.
RATE_STEP = 4
CANDIDATES = 3
PROBED = "rates probed ("
PROBE_IMAGES = 2000  # validation images the probe scores before and after its steps
PIXEL_IMAGES = 4000  # training images whose class means the pixel check compares against
NOISE_SE = 2.0  # the validation loss must fall by this many standard errors of its change
LEAST_FALL = 0.05  # the loss must fall by this share of its start for a choice to exist


class NothingLearned(PipelineError):
    """Neither range test's loss fell, and training at the linear-scaling rule did not lower
    the validation loss: the data cannot be learned as labelled."""


class NeverFell(PipelineError):
    """The range test's loss did not fall enough for a learning rate to be read from it."""

    def __init__(self, lrs: list[float], detail: str):
        tried = f"{lrs[0]:.1e} to {lrs[-1]:.1e}" if lrs else f"from {START_LR:.0e}"
        super().__init__(f"--lr auto: the training loss never fell while the learning rate "
                         f"rose over {tried} in {len(lrs)} steps ({detail}); check the data "
                         "and labels, or give --lr yourself")
        self.detail = detail


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
    try:
        curve = range_test(config, splits, precision, device)
    except NeverFell as exc:
        if planned is not None and LONG_STEPS > 2 * planned:  # the second test would outrun it
            return _rule_after_one_test(config, splits, batch, planned, exc)
        say(f"--lr auto: the first test chose no learning rate ({exc.detail}); trying again "
            f"over {LONG_STEPS} steps, each learning rate held longer ...", quiet=config.quiet)
        try:
            curve = range_test(config, splits, precision, device, LONG_STEPS)
        except NeverFell as again:
            return probed_rate(config, splits, precision, device, again)
    world = distributed.current()
    curve["ceiling"] = CEILING_PER_256 * batch / 256
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


def _rule_after_one_test(config, splits, batch: int, planned: int, never: NeverFell):
    """(the linear-scaling rule's rate, why) where the first test could not be read and a
    second would take more than twice the training's steps, once the pixels show the labels
    belong to the images (the probes that check it elsewhere would outrun training too)."""
    pixels, learnable = distributed.broadcast(pixels_predict_labels(splits, config.seed))
    if not learnable:
        raise NothingLearned(f"--lr auto: nothing was learned: the training loss never fell in "
                             f"the range test ({never.detail}), and {pixels}; check that the "
                             "labels belong to the images (shuffled labels look like this), or "
                             "give --lr yourself")
    lr = RULE_PER_256 * batch / 256
    say(f"--lr auto: the first test chose no learning rate ({never.detail}); {lr:.3g}, by the "
        f"linear-scaling rule: a second test takes {LONG_STEPS} steps, training {planned}",
        quiet=config.quiet)
    return lr, (f"linear-scaling rule (0.1 per 256 images a step; the range test's loss fell "
                f"too little to read ({never.detail}), and a second test would take more than "
                f"twice the training's {planned} steps; {pixels})")


def probed_rate(config, splits, precision, device, never: NeverFell) -> tuple[float, str]:
    """(the peak, why) where no range test could be read: of the linear-scaling rule's rate and
    quarters of it (down while a quarter does better, CANDIDATES at most), each trained
    PROBE_STEPS from the same initial weights, the one with the lowest validation loss, once
    it beats guessing the classes' shares beyond noise; NothingLearned where it does not. A
    fall within noise earns another PROBE_STEPS, up to PROBE_ROUNDS in all: a slow starter
    gets there, shuffled labels do not. Rank 0's choices hold on every rank."""
    rule = RULE_PER_256 * config.batch_size * distributed.current().world_size / 256
    say(f"--lr auto: no range test could be read ({never.detail}); {PROBE_STEPS} steps at the "
        f"linear-scaling rule's {rule:.3g} and at quarters of it decide the peak, and whether "
        "the data can be learned ...", quiet=config.quiet)
    rates, probes, results = _descend(config, splits, precision, device, rule)
    lr = distributed.broadcast(min(rates, key=lambda rate: _mean_loss(results[rate])))
    for other in set(rates) - {lr}:
        probes[other].close()
    tried = ", ".join(f"{rate:.3g}: {_mean_loss(results[rate]):.4f}" for rate in rates)
    before, after, guessing = results[lr]
    for rounds in range(1, PROBE_ROUNDS + 1):
        if rounds > 1:
            before, after, guessing = next(probes[lr])
        if not all(map(math.isfinite, after)):
            raise PipelineError(f"--lr auto: no range test could be read ({never.detail}), and "
                                f"every rate from the linear-scaling rule's {rule:.3g} down made "
                                "the loss diverge; give a lower --lr yourself")
        gain = [g - a for g, a in zip(guessing, after)]
        spread = statistics.stdev(gain) if len(gain) > 1 else 0.0
        learned = statistics.fmean(gain) > NOISE_SE * spread / math.sqrt(len(gain))
        losses = (f"the validation loss went from {statistics.fmean(before):.4f} to "
                  f"{statistics.fmean(after):.4f} over {len(gain)} images in "
                  f"{rounds * PROBE_STEPS} steps, where guessing the classes' shares scores "
                  f"{statistics.fmean(guessing):.4f}")
        settled = learned or statistics.fmean(gain) <= 0
        learned, losses, settled = distributed.broadcast((learned, losses, settled))
        if settled:
            break
    probes[lr].close()
    why = (f"{PROBED}the linear-scaling rule's {rule:.3g}, 0.1 per 256 images a step, and "
           f"quarters of it, {PROBE_STEPS} steps each from the same weights, as the range tests' "
           f"loss fell too little to read ({never.detail})): validation loss at each {tried}; at "
           f"{lr:.3g}, {losses}")
    if learned:
        say(f"--lr auto: {lr:.3g} (validation loss after {PROBE_STEPS} steps at each rate: "
            f"{tried}; {losses})", quiet=config.quiet)
        return lr, why
    pixels, learnable = distributed.broadcast(pixels_predict_labels(splits, config.seed))
    if not learnable:
        raise NothingLearned(
            f"--lr auto: nothing was learned: the training loss never fell in the range tests "
            f"({never.detail}), steps at {lr:.3g} (the best of the linear-scaling rule's "
            f"{rule:.3g} and quarters of it) did not beat guessing beyond noise ({losses}), and "
            f"{pixels}; check that the labels belong to the images (shuffled labels look like "
            "this), or give --lr yourself")
    say(f"--lr auto: {lr:.3g}, the lowest validation loss of the rates probed ({tried}), though "
        f"none beat guessing beyond noise ({losses}): {pixels}, so the labels belong to the "
        "images and the network starts slowly", quiet=config.quiet)
    return lr, f"{why}; none beat guessing beyond noise, but {pixels}"


def pixels_predict_labels(splits, seed: int) -> tuple[str, bool]:
    """(what it found, whether the labels depend on the images): a nearest-class-mean
    classifier on 8x8-pooled pixels, fitted on up to PIXEL_IMAGES unaugmented training images,
    scored on up to PROBE_IMAGES validation images against always guessing the commonest class.
    A check of the data, not of the network: a slow starter (mnasnet0_5 on photos10 left the
    validation loss at chance after 450 steps at each rate) trains, shuffled labels do not."""
    import torch

    def sample(dataset, count: int):
        order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))
        pairs = [dataset[i] for i in order[:count].tolist()]
        pooled = torch.nn.functional.adaptive_avg_pool2d(
            torch.stack([image for image, _ in pairs]).float(), 8).flatten(1)
        return pooled, torch.as_tensor([int(label) for _, label in pairs])

    train_x, train_y = sample(splits.calibration, PIXEL_IMAGES)
    val_x, val_y = sample(splits.val, PROBE_IMAGES)
    classes = train_y.unique()
    means = torch.stack([train_x[train_y == c].mean(0) for c in classes])
    accuracy = (classes[torch.cdist(val_x, means).argmin(1)] == val_y).double().mean().item()
    commonest = torch.bincount(val_y).max().item() / len(val_y)
    noise = NOISE_SE * math.sqrt(commonest * (1 - commonest) / len(val_y))
    return (f"a nearest-class-mean classifier on the pixels scored {accuracy:.1%} on "
            f"{len(val_y)} validation images, where guessing the commonest class scores "
            f"{commonest:.1%}"), accuracy > commonest + noise


def _descend(config, splits, precision, device, rule: float) -> tuple[list, dict, dict]:
    """The rates probed, from ``rule`` down in quarters while a quarter does better, with each
    one's probe and its first round."""
    rates, probes, results = [], {}, {}
    for k in range(CANDIDATES):
        rates.append(rule / RATE_STEP ** k)
        probes[rates[-1]] = validation_probe(config, splits, precision, device, rates[-1])
        results[rates[-1]] = next(probes[rates[-1]])
        lower_did_better = k == 0 or _mean_loss(results[rates[-1]]) < _mean_loss(
            results[rates[-2]])
        if not distributed.broadcast(lower_did_better):
            break
    return rates, probes, results


def _mean_loss(probed: tuple) -> float:
    """A probe's mean validation loss; infinite where it diverged."""
    after = probed[1]
    return statistics.fmean(after) if all(map(math.isfinite, after)) else math.inf


def validation_probe(config, splits, precision, device, lr: float, steps: int = PROBE_STEPS):
    """Each validation image's loss (at most PROBE_IMAGES) before training, after each round
    of ``steps`` steps at a constant ``lr`` from the initial weights training starts from, and
    what guessing the classes' shares among those images would score on each (the bar a model
    that learned anything clears; a loss that only fell from a poor initial scale does not):
    yields (before, after, guessing) per round, for as long as asked."""
    import torch

    probe = dataclasses.replace(config, lr=lr, time=None)
    parts = build_parts(probe, splits, precision, device)
    parts.scheduler = torch.optim.lr_scheduler.LambdaLR(parts.optimizer, lambda step: 1.0)
    # A seeded sample, not the first images: an image folder lists its classes in order.
    order = torch.randperm(len(splits.val), generator=torch.Generator().manual_seed(config.seed))
    images = torch.utils.data.Subset(splits.val, order[:PROBE_IMAGES].tolist())
    before, labels = _image_losses(parts.model, images, device)
    shares = torch.bincount(torch.tensor(labels)).double() / len(labels)
    guessing = [-math.log(shares[label]) for label in labels]
    batches, done = endless_batches(parts), 0
    while True:
        parts.trained.train()
        for batch, targets in itertools.islice(batches, steps):
            train_step(parts, precision, device, probe.grad_clip, batch, targets,
                       DeviceSums(device), done)
            done += 1
        after, _ = _image_losses(parts.model, images, device)
        yield before, after, guessing


def _image_losses(model, images, device) -> tuple[list[float], list[int]]:
    import torch

    model.eval()
    losses, labels = [], []
    with torch.no_grad():
        for batch, targets in make_loader(images, 256):
            logits = model(batch.to(device)).float()
            losses += torch.nn.functional.cross_entropy(
                logits, targets.to(device), reduction="none").tolist()
            labels += targets.tolist()
    return losses, labels


def planned_steps(config, splits, precision) -> int | None:
    """The optimizer steps training will take in all (each model's epochs; the fp32 baseline
    is a second model where amp is not fp32), or None where --time plans them."""
    if config.time:
        return None
    batch = config.batch_size * distributed.current().world_size
    models = 2 if config.baseline and precision.name != "fp32" else 1
    return models * config.epochs * math.ceil(len(splits.train) / batch)  # the last batch too


def range_test(config, splits, precision, device, steps: int = MAX_STEPS) -> dict:
    """The curve (lrs, smoothed losses) and the learning rates read from it; NeverFell where
    the loss never fell."""
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
    for images, labels in endless_batches(parts):
        if len(lrs) >= steps:
            break
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
