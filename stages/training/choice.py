"""Which epoch's weights a training keeps: the last, unless an earlier epoch scored better on
validation beyond noise.

The schedule ends at its lowest rates, so the last epoch is the most annealed. The highest
validation score instead picks, among 20 to 40 epochs within a point or two of each other, the
one the noise of the validation images favoured. On photos10 (1,000 validation images, 2,000
test) the epochs so chosen scored 0.7 points below the last on test, averaged over 14 runs of
five families in --time 10m (from 0.5 above to 3.6 below); on notMNIST 0.2 below over six
(Zen 4, 2026-12-06: each run's model.pt, then the best epoch's weights, and its newest
checkpoint, the last epoch's, scored on the same splits). An earlier epoch is kept only where
its lead over the last, paired on the same validation images, has a 95% interval (Newcombe's)
wholly above zero.
"""
from __future__ import annotations

from stages.measure.stats import paired_difference_interval


def keep_best(totals, history: list[dict], best_hits, last_hits, have_best: bool = True) -> bool:
    """Set totals.chosen_epoch and totals.chosen (why, in words) from the best epoch's and the
    last epoch's hits on the validation images; True where the best epoch's weights are to be
    loaded, False where the model keeps the last epoch's (as where ``have_best`` is False: a
    resume found no best file of the epoch its checkpoint names)."""
    best = totals.best_epoch
    last = history[-1]["epoch"] if history else best
    if not have_best:
        totals.chosen_epoch = last
        totals.chosen = f"epoch {last}, the last: the best epoch's weights did not survive a resume"
        return False
    if best == last or best_hits is None or last_hits is None:
        # Checkpoints written before the hits were kept hold no last epoch's hits.
        totals.chosen_epoch = best
        totals.chosen = (f"epoch {best}, the last and best on validation" if best == last
                         else f"epoch {best}, best validation accuracy")
        return True
    lead = paired_difference_interval(last_hits.tolist(), best_hits.tolist())
    points = lambda share: f"{100 * share:+.1f}"  # noqa: E731
    interval = f"95% interval {points(lead['low'])} to {points(lead['high'])} points"
    if lead["low"] > 0:
        totals.chosen_epoch = best
        totals.chosen = (f"epoch {best}, best on validation: {points(lead['difference'])} "
                         f"points over the last epoch ({last}), beyond noise ({interval})")
        return True
    totals.chosen_epoch = last
    totals.chosen = (f"epoch {last}, the last: epoch {best} scored {points(lead['difference'])} "
                     f"points on validation, within noise ({interval})")
    return False
