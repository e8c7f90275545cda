"""Time boxes: the epochs that fit a budget at the pace measured so far, planned again after
each epoch, with the learning-rate schedule's cosine cut to end with them. train's --time
(planned_end) and qat's --tuning-time (fitted_plan, which scales qat's freezes alike) share the
arithmetic."""
from __future__ import annotations

from typing import NamedTuple

from stages.run.progress import say
from stages.training import distributed
from stages.training.loop import Loop


def epochs_that_fit(budget: float, done: int, seconds: float, asked: int) -> int:
    """The epochs that fit ``budget`` seconds at the pace of the ``done`` epochs so far (which
    took ``seconds``): never fewer than those done, never more than asked."""
    return max(done, min(asked, int(budget * done / max(seconds, 1e-9))))


def cut(loop: Loop, epochs: int) -> None:
    """Plan ``epochs`` in all, the schedule's cosine ending with them from the rate reached."""
    loop.totals.planned_epochs = epochs
    scheduler = loop.parts.scheduler
    scheduler.lr_lambdas[0].replan(scheduler.last_epoch, epochs * loop.parts.steps_per_epoch)


def planned_end(loop: Loop, epoch: int, budget: float | None) -> str:
    """train --time, after ``epoch``'s steps and scoring (before its checkpoint, which then
    holds the plan): why training ends with this epoch, or "" to go on. Under a budget the
    epochs that fit at the pace so far (steps, and the scoring and checkpoints of the epochs
    before) are planned again: never past --epochs, never before the epochs done, longer as
    well as shorter (the cosine goes on from the rate reached, so it never rises). Planned only
    ever shorter, a first epoch slowed by warm-up or a busy hour left resnet18 on photos10 with
    23 epochs of 18 s in --time 10m, and 92 of its 574 s unused."""
    totals, planned = loop.totals, loop.planned_epochs
    if budget is not None:
        fits = epochs_that_fit(budget, epoch, totals.wall, loop.epochs)
        fits = distributed.broadcast(fits)  # ranks timed apart must still stop together
        # Shorter whenever the pace says so; longer by two epochs or more, so that a pace on
        # the edge between two plans (mobilenet_v2 on photos10: 28.9 epochs) does not change it
        # after every epoch; never past a plateau's end, nor once the plan has run out: its
        # cosine has reached zero, and epochs added at a rate of zero change no weight.
        growing = fits >= planned + 2 and epoch < planned and not totals.plateau
        if fits < planned or growing:
            planned = fits
            cut(loop, fits)
            say(f"{loop.name}: --time {budget:.0f}s for this model fits {fits} of "
                f"{loop.epochs} epochs at {totals.wall / epoch:.1f} s each; the "
                "learning-rate schedule ends with them", quiet=loop.quiet)
    if epoch < planned:
        return ""
    if totals.plateau:
        return totals.plateau
    if planned < loop.epochs:
        return (f"time: {planned} epoch{'s' * (planned != 1)} planned in --time ({budget:.0f} s "
                "for this model)")
    return f"epochs: all {loop.epochs} of --epochs ran"


def anneal_on_plateau(loop: Loop, epoch: int, patience: int) -> None:
    """train --patience, after ``epoch``: where validation accuracy has not improved for
    ``patience`` epochs, the schedule is cut to end ``patience`` epochs on, so that training
    ends at the cosine's lowest rates rather than on a plateau at a high one (mobilenet_v3_large
    on photos10 stopped at epoch 12 of 28, its rate still 0.68 of the peak). Within the plan's
    last ``patience`` epochs nothing changes: the schedule already ends there. Nor in its first
    half, where the rate is above half its peak: mobilenet_v2 on photos10 at the linear-scaling
    rule's 0.025 stalled after epoch 7 and, cut there, scored 46.60%; the whole cosine at that
    rate, 58.15% (seed 0, Zen 4, 2026-12-07)."""
    totals = loop.totals
    if totals.plateau or epoch - totals.best_epoch < patience or 2 * epoch < loop.planned_epochs:
        return
    if epoch + patience < loop.planned_epochs:
        cut(loop, epoch + patience)
        totals.plateau = (f"plateau: validation accuracy did not improve for {patience} epochs "
                          f"after epoch {totals.best_epoch}; the schedule was cut to end "
                          f"{patience} epochs later")
        say(f"{loop.name}: {totals.plateau}", quiet=loop.quiet)


class Plan(NamedTuple):
    """qat's epochs and the epochs after which it freezes BatchNorm and the observers."""

    epochs: int
    freeze_bn_after: int
    freeze_observers_after: int


def fitted_plan(config, done: int, seconds: float) -> Plan:
    """qat --tuning-time: the epochs that fit config.tuning_time at the pace of the ``done``
    epochs so far (which took ``seconds``), with each freeze scaled alike so that a cut run
    still trains, then freezes BatchNorm, then the ranges."""
    asked = Plan(config.epochs, config.freeze_bn_after, config.freeze_observers_after)
    if config.tuning_time is None:
        return asked
    fits = epochs_that_fit(config.tuning_time, done, seconds, config.epochs)

    def scaled(after: int) -> int:
        return after if after == 0 else max(1, after * fits // config.epochs)

    return Plan(fits, scaled(config.freeze_bn_after), scaled(config.freeze_observers_after))


def replanned(current: Plan, cut: Plan, done: int) -> Plan:
    """``cut`` (fitted_plan's, after ``done`` epochs) with each freeze as it can still be: one
    the current plan has made already stays where it was, and one still to come cannot come
    before now (a cut to 4 epochs after 4 had recorded BatchNorm "frozen after 2", never done)."""
    def freeze(planned: int, scaled: int) -> int:
        return planned if planned <= done else max(done, scaled)

    return Plan(cut.epochs, freeze(current.freeze_bn_after, cut.freeze_bn_after),
                freeze(current.freeze_observers_after, cut.freeze_observers_after))
