import pytest

from stages.stats import newcombe_interval, paired_difference_interval, wilson_interval


@pytest.mark.parametrize("hits, total, low, high", [
    (50, 100, 0.4038, 0.5962),   # textbook values of Wilson's interval
    (0, 10, 0.0, 0.2775),
    (10, 10, 0.7225, 1.0),
    (81, 263, 0.2553, 0.3662),
])
def test_wilson_interval_known_cases(hits, total, low, high):
    got = wilson_interval(hits, total)
    assert got[0] == pytest.approx(low, abs=1e-4) and got[1] == pytest.approx(high, abs=1e-4)


def test_paired_difference_of_identical_predictions_is_zero_and_narrow():
    hits = [True] * 340 + [False] * 20
    result = paired_difference_interval(hits, hits)
    assert result["difference"] == 0.0
    assert -0.02 < result["low"] < 0 < result["high"] < 0.02


def test_newcombe_interval_known_case():
    # Newcombe (1998), independent samples 56/70 against 48/80: 0.2000 (0.0524, 0.3339).
    result = newcombe_interval(56, 70, 48, 80)
    assert result["difference"] == pytest.approx(0.2)
    assert result["low"] == pytest.approx(0.0524, abs=1e-4)
    assert result["high"] == pytest.approx(0.3339, abs=1e-4)


def test_paired_difference_detects_a_real_loss_and_tolerates_noise():
    base = [True] * 300 + [False] * 60
    lost_30 = [True] * 270 + [False] * 90  # 30 images that the reference got right now wrong
    assert paired_difference_interval(base, lost_30)["high"] < 0
    swapped = [False] + [True] * 299 + [True] + [False] * 59  # one flip each way
    noisy = paired_difference_interval(base, swapped)
    assert noisy["low"] < 0 < noisy["high"]
