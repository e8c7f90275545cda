"""train --time: the epochs planned again after each one at the pace so far, with the cosine
going on from the rate reached."""
from types import SimpleNamespace

import pytest
import torch

from stages.training.loop import Loop
from stages.training.plans import anneal_on_plateau, planned_end
from stages.training.schedule import CosineSchedule

STEPS = 10  # a loader's batches an epoch


def _loop(epochs: int = 200) -> Loop:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = CosineSchedule(epochs * STEPS, warmup_steps=2 * STEPS)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    parts = SimpleNamespace(optimizer=optimizer, scheduler=scheduler, steps_per_epoch=STEPS)
    return Loop("amp", parts, precision=None, device=None, epochs=epochs, batch_size=64,
                quiet=True)


def _train(loop: Loop, paces: list[float], budget: float, patience: int = 0):
    """Epochs that took ``paces`` seconds each, as train's epoch end plans them: the rate of
    every step, the plan after every epoch, and why training ended."""
    rates, plans, epoch = [], [], 0
    while True:
        epoch += 1
        for _ in range(STEPS):
            rates.append(loop.parts.optimizer.param_groups[0]["lr"])
            loop.parts.optimizer.step()
            loop.parts.scheduler.step()
        loop.totals.wall += paces[epoch - 1]
        stopped = planned_end(loop, epoch, budget)
        if patience and not stopped:
            anneal_on_plateau(loop, epoch, patience)
        plans.append(loop.planned_epochs)
        if stopped:
            return rates, plans, stopped


def test_a_plan_grows_when_epochs_get_faster_and_the_rate_never_rises_after_warm_up():
    """A first epoch of 25 s (warm-up, a busy hour), then 10 s each, in 100 s: 4 epochs fit at
    first, 6 after epoch 3 (the plan grows by two epochs at a time). The 4-epoch plan's warm-up
    (a tenth) is over after epoch 1, so the rate falls from the one reached to nearly zero at
    the last step. After epoch 6 the pace says 8 fit, but the plan has run out: its cosine is at
    zero, and two more epochs would have trained at a rate of zero."""
    rates, plans, stopped = _train(_loop(), [25.0] + [10.0] * 20, budget=100.0)
    assert plans == [4, 4, 6, 6, 6, 6]
    assert stopped == "time: 6 epochs planned in --time (100 s for this model)"
    cosine = rates[STEPS:]
    assert all(later <= earlier for earlier, later in zip(cosine, cosine[1:]))
    assert rates[STEPS] == (STEPS + 1) / (2 * STEPS) and 0 < rates[-1] < 0.01


@pytest.mark.parametrize("paces, plan, peak_at", [
    ([10.0] * 3, 2, None),  # a plan of two: its warm-up had filled it, ending at the peak
    ([10.0] * 40, 30, 2 * STEPS - 1),  # long enough for the whole two epochs of warm-up
    ([10.0] * 20, 15, 15 - 1)])  # a tenth of 15 epochs: one and a half
def test_the_warm_up_is_a_tenth_of_the_plan_at_most_two_epochs(paces, plan, peak_at):
    rates, plans, _ = _train(_loop(), paces, budget=10.0 * plan)
    assert plans[-1] == plan and rates[-1] < 0.03
    if peak_at is None:
        assert max(rates) < 1.0
    else:
        assert rates[peak_at] == 1.0 and rates[peak_at - 1] < 1.0


def test_a_pace_on_the_edge_between_two_plans_does_not_change_the_plan_each_epoch():
    """At the pace so far 29 epochs fit, then 28, then 29 again, and so on: one cut, after
    which the plan holds (it had changed every one to three epochs)."""
    paces = [10.0] * 3 + [10.2, 9.6, 10.2] * 20
    rates, plans, stopped = _train(_loop(), paces, budget=290.0)
    assert plans == [29] * 3 + [28] * 25 and stopped.startswith("time: 28 epochs planned")


def test_a_plan_shrinks_when_epochs_get_slower_without_a_step_in_the_rate():
    rates, plans, stopped = _train(_loop(), [10.0] * 3 + [30.0] * 20, budget=120.0)
    assert plans == [12, 12, 12, 8, 6, 6]
    # Re-planned after epochs 4 and 5: the rate of the step after (whose rate was set before
    # the plan changed) is the first of the new plan, and falls about as the one before did.
    for first in (4 * STEPS + 1, 5 * STEPS + 1):
        fall = rates[first - 1] - rates[first]
        assert 0 <= fall < 1.5 * (rates[first - 2] - rates[first - 1])


def test_a_plateau_ends_training_where_it_said_whatever_the_pace():
    """Validation never improves after epoch 1 (patience 2): not in the plan's first half (the
    rate above half its peak, the plan growing with the pace), but at epoch 15 of 29 the
    plateau cuts the schedule to end at epoch 17, and a pace that fits more does not stretch
    it."""
    loop = _loop()
    loop.totals.best_epoch = 1
    rates, plans, stopped = _train(loop, [30.0] + [5.0] * 20, budget=200.0, patience=2)
    assert plans == [6, 11, 15, 17, 20, 20, 23, 23, 25, 25, 27, 27, 27, 29, 17, 17, 17]
    assert stopped.startswith("plateau: ")
    assert rates[-1] < 0.05


def test_a_plan_cut_after_a_resumed_epoch_counts_whole_epochs():
    """A run resumed 3 batches into an epoch has 7 of its 10 batches left in the loader; the
    plan cut after that epoch still ends the cosine after 5 whole epochs (50 steps), not 35."""
    from stages.data.loaders import EpochSampler, make_loader
    from stages.training.loop import Parts
    from stages.training.plans import cut

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, CosineSchedule(8 * STEPS, 0))
    sampler = EpochSampler(STEPS * 64, seed=0, batch_size=64)
    loader = make_loader(torch.utils.data.TensorDataset(torch.zeros(STEPS * 64)), 64, sampler)
    parts = Parts(None, None, optimizer, scheduler, None, None, sampler, loader, [])
    sampler.set_epoch(3, start=3 * 64)
    assert len(loader) == STEPS - 3 and parts.steps_per_epoch == STEPS
    cut(Loop("amp", parts, None, None, epochs=8, batch_size=64, quiet=True), 5)
    assert scheduler.lr_lambdas[0].total_steps == 5 * STEPS
