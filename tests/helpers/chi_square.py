"""Pearson's chi-square goodness-of-fit test, for the sampling tests (no scipy here)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def chi_square_p_value(counts: Sequence[int], probs: Sequence[float]) -> float:
    """The p-value of observing `counts` if each draw fell in cell i with probability
    probs[i] (cells with no expected mass must be empty: a draw there gives 0)."""
    total = sum(counts)
    stat, cells = 0.0, 0
    for count, p in zip(counts, probs, strict=True):
        expected = total * p
        if expected == 0:
            if count:
                return 0.0
            continue
        stat += (count - expected) ** 2 / expected
        cells += 1
    dof = cells - 1
    # Survival function of chi-square(dof): the regularized upper incomplete gamma.
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))
