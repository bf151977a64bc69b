"""Pearson's chi-square test of a sample against an exact law, for the tests of sampling laws.

`counts` are N independent draws over outcomes, `law` the exact probability of every outcome.
An outcome the law gives probability 0 is not a cell: draws there are counted apart
(`impossible`) and a correct sampler has none. Cells whose expected count is below
`min_expected` are pooled into one, smallest first, so that the statistic's chi-square
approximation holds in the far tail we read (Cochran's rule asks for 5 per cell; we ask for 20).

The tail probability is the regularized upper incomplete gamma function (torch's `gammaincc`,
float64): P(chi2_df >= x) = Q(df / 2, x / 2).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass

import torch

# A test rejects a sample whose p-value is below ALPHA: a correct sampler fails one such test
# with probability about 1e-6 (for a new seed, or a change that reorders the random draws).
ALPHA = 1e-6


@dataclass(frozen=True)
class ChiSquare:
    statistic: float
    df: int
    p_value: float
    impossible: int  # draws of outcomes whose probability is 0
    n: int  # draws in all

    def rejects(self, alpha: float = ALPHA) -> bool:
        return self.impossible > 0 or self.p_value < alpha

    def __str__(self) -> str:
        return (f"X2 = {self.statistic:.1f} on {self.df} df, p = {self.p_value:.3g}, "
                f"{self.impossible} impossible draws of {self.n}")


def chi_square_tail(statistic: float, df: int) -> float:
    """P(X >= statistic) for X ~ chi-square with `df` degrees of freedom."""
    a = torch.tensor(df / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(a, torch.tensor(statistic / 2, dtype=torch.float64)))


def chi_square(counts: Mapping[Hashable, int], law: Mapping[Hashable, float],
               min_expected: float = 20.0) -> ChiSquare:
    """Pearson's statistic of `counts` against `law` (probabilities summing to 1)."""
    total = sum(law.values())
    assert abs(total - 1) < 1e-9, f"the law sums to {total}, not 1"
    n = sum(counts.values())
    impossible = sum(c for outcome, c in counts.items() if law.get(outcome, 0) == 0)
    cells = sorted((n * p, counts.get(outcome, 0)) for outcome, p in law.items() if p > 0)
    # pool the rarest cells until the pool itself is no longer rare
    pooled_expected, pooled_observed, i = 0.0, 0, 0
    while i < len(cells) and (cells[i][0] < min_expected or 0 < pooled_expected < min_expected):
        pooled_expected += cells[i][0]
        pooled_observed += cells[i][1]
        i += 1
    cells = cells[i:] + ([(pooled_expected, pooled_observed)] if i else [])
    assert len(cells) >= 2, "too few draws for this law: every cell was pooled"
    statistic = sum((observed - expected) ** 2 / expected for expected, observed in cells)
    df = len(cells) - 1
    return ChiSquare(statistic, df, chi_square_tail(statistic, df), impossible, n)
