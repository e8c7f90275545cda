"""Intervals against published worked examples (Newcombe 1998, both papers) and Wilson's."""
import pytest

from stages.measure.stats import (
    newcombe_paired,
    newcombe_unpaired,
    paired_difference_interval,
    wilson_interval,
    worst_change,
)


@pytest.mark.parametrize("hits, total, low, high", [
    (50, 100, 0.4038, 0.5962),   # textbook values of Wilson's interval
    (0, 10, 0.0, 0.2775),
    (10, 10, 0.7225, 1.0),
    (81, 263, 0.2553, 0.3662),
])
def test_wilson_interval_known_cases(hits, total, low, high):
    got = wilson_interval(hits, total)
    assert got[0] == pytest.approx(low, abs=1e-4) and got[1] == pytest.approx(high, abs=1e-4)


@pytest.mark.parametrize("a, n_a, b, n_b, diff, low, high", [
    # Newcombe (1998), Stat Med 17:873, method 10, worked examples.
    (56, 70, 48, 80, 0.2000, 0.0524, 0.3339),
    (9, 10, 3, 10, 0.6000, 0.1705, 0.8090),
])
def test_unpaired_newcombe_reproduces_the_published_examples(a, n_a, b, n_b, diff, low, high):
    result = newcombe_unpaired(a, n_a, b, n_b)
    assert result["difference"] == pytest.approx(diff, abs=1e-4)
    assert result["low"] == pytest.approx(low, abs=1e-4)
    assert result["high"] == pytest.approx(high, abs=1e-4)


@pytest.mark.parametrize("cells, diff, low, high", [
    # Newcombe (1998), Stat Med 17:2635, method 10 (continuity-corrected phi), worked examples.
    ((36, 12, 2, 0), 0.2, 0.0569, 0.3404),
    ((18, 12, 2, 18), 0.2, 0.0562, 0.3290),
    ((53, 0, 0, 1), 0.0, -0.0729, 0.0729),
    ((0, 30, 0, 0), 1.0, 0.8395, 1.0),
])
def test_paired_newcombe_reproduces_the_published_examples(cells, diff, low, high):
    result = newcombe_paired(*cells)
    assert result["difference"] == pytest.approx(diff, abs=1e-4)
    assert result["low"] == pytest.approx(low, abs=1e-4)
    assert result["high"] == pytest.approx(high, abs=1e-4)


def test_the_continuity_correction_changes_the_interval():
    # (18, 12, 2, 18): the uncorrected phi is 0.5 and would give method 9's narrower interval,
    # 0.0618 to 0.3239; method 10 corrects phi to 0.458.
    result = newcombe_paired(18, 12, 2, 18)
    assert result["low"] < 0.0618 - 5e-3 and result["high"] > 0.3239 + 5e-3


def test_paired_difference_counts_the_cells_from_hits():
    reference = [True] * 36 + [False] * 12 + [True] * 2 + [False] * 0
    candidate = [True] * 36 + [True] * 12 + [False] * 2
    result = paired_difference_interval(reference, candidate)  # candidate minus reference
    assert result["difference"] == pytest.approx(10 / 50)
    assert result["low"] == pytest.approx(0.0569, abs=1e-4)


def test_paired_difference_detects_a_real_loss_and_tolerates_noise():
    base = [True] * 300 + [False] * 60
    lost_30 = [True] * 270 + [False] * 90  # 30 images that the reference got right now wrong
    assert paired_difference_interval(base, lost_30)["high"] < 0
    swapped = [False] + [True] * 299 + [True] + [False] * 59  # one flip each way
    noisy = paired_difference_interval(base, swapped)
    assert noisy["low"] < 0 < noisy["high"]


def test_worst_change_is_the_change_less_1645_standard_errors_of_the_pairs():
    # 1,000 images, 10 gained and 30 lost: change -0.02, variance of one pair 0.04 - 0.0004.
    assert worst_change(10, 30, 1000) == pytest.approx(-0.02 - 1.645 * (0.0396 / 1000) ** 0.5)
    assert worst_change(0, 0, 925) == 0.0  # never disagreeing, nothing more is possible
    assert worst_change(3, 0, 925) < 3 / 925  # a gain measured is not a gain for sure
    reference = [True] * 900 + [False] * 100
    candidate = [False] * 30 + [True] * 870 + [True] * 10 + [False] * 90
    result = paired_difference_interval(reference, candidate)
    assert result["worst"] == pytest.approx(worst_change(10, 30, 1000))
    assert result["low"] < result["worst"] < result["difference"]  # one-sided: nearer
