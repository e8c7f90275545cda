"""Where no learning-rate range test can be read (stages/training/lr_range.py): a few rates
probed from the same initial weights on validation loss, and a check of whether the labels
belong to the images at all (`pixels_predict_labels`), so that a slow starter trains and
shuffled labels are refused as such."""
from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from typing import TYPE_CHECKING

from stages.data.loaders import endless_batches, make_loader
from stages.run.errors import PipelineError
from stages.run.progress import say
from stages.training import batchnorm, distributed
from stages.training.loop import DeviceSums, build_parts, train_step

if TYPE_CHECKING:
    from stages.training.lr_range import NeverFell

RULE_PER_256 = 0.1  # Goyal et al.'s linear-scaling rule for SGD with momentum
PROBE_STEPS = 450  # as long as the longer range test: a slow starter gets its time
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


class NothingLearned(PipelineError):
    """Neither range test's loss fell, and training at the linear-scaling rule did not lower
    the validation loss: the data cannot be learned as labelled."""


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
    before, labels = _image_losses(parts.model, images, device, splits, config.batch_size)
    shares = torch.bincount(torch.tensor(labels)).double() / len(labels)
    guessing = [-math.log(shares[label]) for label in labels]
    batches, done = endless_batches(parts.sampler, parts.loader), 0
    while True:
        parts.trained.train()
        for batch, targets in itertools.islice(batches, steps):
            train_step(parts, precision, device, probe.grad_clip, batch, targets,
                       DeviceSums(device), done)
            done += 1
        after, _ = _image_losses(parts.model, images, device, splits, config.batch_size)
        yield before, after, guessing


def _image_losses(model, images, device, splits, batch_size: int) -> tuple[list, list[int]]:
    """Each image's loss, with BatchNorm's statistics recomputed first, as every score does:
    running averages with MNASNet's momentum of 0.0003 keep 87% of their initial values after
    450 steps, and the losses had measured those, not what the steps learned."""
    import torch

    batchnorm.recompute_module(model, splits.calibration, batch_size, device)
    model.eval()
    losses, labels = [], []
    with torch.no_grad():
        for batch, targets in make_loader(images, 256):
            logits = model(batch.to(device)).float()
            losses += torch.nn.functional.cross_entropy(
                logits, targets.to(device), reduction="none").tolist()
            labels += targets.tolist()
    return losses, labels
