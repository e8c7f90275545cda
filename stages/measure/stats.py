"""Confidence intervals for accuracies measured on one split, so that noise reads as noise.

Wilson's score interval for one accuracy comes from scipy. The change in accuracy between two
models scored on the same images uses Newcombe's (1998) method 10 for paired proportions: the
two Wilson intervals combined through the correlation of the paired outcomes, with his
continuity correction of that correlation. Neither scipy nor statsmodels provides the paired
interval (statsmodels has only the unpaired one, method 10 of his other 1998 paper, which is
this formula with no correlation), so it is written out here and tested against the paper's
worked examples.
"""
from __future__ import annotations

import math

CONFIDENCE = 0.95


def wilson_interval(hits: int, total: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    if total <= 0:
        return (float("nan"), float("nan"))
    from scipy.stats import binomtest

    interval = binomtest(int(hits), int(total)).proportion_ci(confidence_level=confidence,
                                                              method="wilson")
    return (float(interval.low), float(interval.high))


def _combine(p1: float, p2: float, limits1: tuple[float, float], limits2: tuple[float, float],
             phi: float) -> dict:
    """Newcombe's hybrid score interval for p1 - p2 from each proportion's Wilson limits."""
    (l1, u1), (l2, u2) = limits1, limits2
    theta = p1 - p2
    delta = math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    epsilon = math.sqrt(max(0.0, (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2)
                            + (p2 - l2) ** 2))
    return {"difference": theta, "low": max(-1.0, theta - delta),
            "high": min(1.0, theta + epsilon)}


def newcombe_unpaired(hits_a: int, total_a: int, hits_b: int, total_b: int) -> dict:
    """p_a - p_b of two independent samples (Newcombe 1998, method 10)."""
    return _combine(hits_a / total_a, hits_b / total_b, wilson_interval(hits_a, total_a),
                    wilson_interval(hits_b, total_b), phi=0.0)


def newcombe_paired(both: int, only_first: int, only_second: int, neither: int) -> dict:
    """p_first - p_second when both were measured on the same n items (Newcombe 1998, paired,
    method 10). The cells count items right for both, for the first only, for the second
    only, and for neither."""
    n = both + only_first + only_second + neither
    if n == 0:
        return {"difference": float("nan"), "low": float("nan"), "high": float("nan")}
    margins = ((both + only_first) * (only_second + neither) * (both + only_second)
               * (only_first + neither))
    phi = 0.0
    if margins > 0:
        d = both * neither - only_first * only_second
        corrected = max(d - n / 2, 0.0) if d > 0 else d  # the continuity correction
        phi = corrected / math.sqrt(margins)
    first, second = both + only_first, both + only_second
    return _combine(first / n, second / n, wilson_interval(first, n),
                    wilson_interval(second, n), phi)


# "Within the accuracy budget" is a one-sided claim (it loses at most that much), made at 95%.
ONE_SIDED_Z = 1.645


def paired_difference_interval(reference_hits, candidate_hits) -> dict:
    """Candidate accuracy minus reference accuracy on the same images, with a 95% interval,
    and ``worst``: the one-sided 95% bound below which the change is unlikely to lie.

    ``reference_hits`` and ``candidate_hits`` are sequences of booleans: whether each model got
    each image right. Pairing narrows the interval when the two models agree a lot.
    """
    pairs = list(zip(reference_hits, candidate_hits, strict=True))
    both = sum(1 for r, c in pairs if r and c)
    only_candidate = sum(1 for r, c in pairs if c and not r)
    only_reference = sum(1 for r, c in pairs if r and not c)
    result = newcombe_paired(both, only_candidate, only_reference,
                             len(pairs) - both - only_candidate - only_reference)
    return result | {"worst": worst_change(only_candidate, only_reference, len(pairs))}


def worst_change(only_candidate: int, only_reference: int, n: int) -> float:
    """The paired change in accuracy minus 1.645 standard errors: what a quantized model may
    lose, at worst, at 95% confidence. Only the images where exactly one model was right carry
    the noise, so two models that never disagree get their measured change itself (Newcombe's
    interval keeps a width even then: +-0.46 points on 925 images, which would refuse an
    identical model under a budget below that)."""
    if n == 0:
        return float("nan")
    change = (only_candidate - only_reference) / n
    variance = max((only_candidate + only_reference) / n - change ** 2, 0.0)
    return change - ONE_SIDED_Z * math.sqrt(variance / n)
