"""Confidence intervals for accuracies measured on one test split, so noise reads as noise.

Wilson's score interval for one accuracy; Newcombe's method 10 for the difference between two
models scored on the same images (paired), which uses the correlation between their hits and is
well-behaved near 0 and 1 where the textbook Wald interval is not.
"""
from __future__ import annotations

import math

Z95 = 1.959963984540054


def wilson_interval(hits: int, total: int, z: float = Z95) -> tuple[float, float]:
    if total <= 0:
        return (float("nan"), float("nan"))
    p = hits / total
    denominator = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / denominator
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / denominator
    return (max(0.0, centre - half), min(1.0, centre + half))


def newcombe_interval(hits_a: int, total_a: int, hits_b: int, total_b: int, phi: float = 0.0,
                      z: float = Z95) -> dict:
    """p_a - p_b with Newcombe's hybrid score interval built from the two Wilson intervals;
    ``phi`` is the correlation of paired outcomes (0 for independent samples)."""
    p_a, p_b = hits_a / total_a, hits_b / total_b
    l_a, u_a = wilson_interval(hits_a, total_a, z)
    l_b, u_b = wilson_interval(hits_b, total_b, z)
    theta = p_a - p_b
    delta = math.sqrt(max(0.0, (p_a - l_a) ** 2 - 2 * phi * (p_a - l_a) * (u_b - p_b)
                          + (u_b - p_b) ** 2))
    epsilon = math.sqrt(max(0.0, (u_a - p_a) ** 2 - 2 * phi * (u_a - p_a) * (p_b - l_b)
                            + (p_b - l_b) ** 2))
    return {"difference": theta, "low": max(-1.0, theta - delta), "high": min(1.0, theta + epsilon)}


def paired_difference_interval(reference_hits, candidate_hits, z: float = Z95) -> dict:
    """Candidate accuracy minus reference accuracy on the same images, with a 95% interval.

    ``reference_hits`` and ``candidate_hits`` are sequences of booleans: whether each model got
    each test image right. Pairing narrows the interval when the two models agree a lot.
    """
    pairs = list(zip(reference_hits, candidate_hits, strict=True))
    n = len(pairs)
    if n == 0:
        return {"difference": float("nan"), "low": float("nan"), "high": float("nan")}
    both = sum(1 for r, c in pairs if r and c)
    only_reference = sum(1 for r, c in pairs if r and not c)
    only_candidate = sum(1 for r, c in pairs if c and not r)
    neither = n - both - only_reference - only_candidate
    margins = ((both + only_reference) * (only_candidate + neither) * (both + only_candidate)
               * (only_reference + neither))
    phi = 0.0
    if margins > 0:
        phi = (both * neither - only_reference * only_candidate) / math.sqrt(margins)
    return newcombe_interval(both + only_candidate, n, both + only_reference, n, phi, z)
