"""The step-cost model: what a forward feeding k tokens costs, in AR steps, and what that predicts.

Jacobi decoding's wall-clock speedup over AR is TPF x t(1) / t(k) (tokens per forward times the
cost ratio of a 1-token step and a k-token step). Everything here is a pure function of measured
ratios t(k)/t(1) at a few k (`cllm profile` measures them; `COST_2_THREADS` are the development
CPU's): no clock, no model. `choose_defaults` is the rule `cllm tune` picks a machine's block
size and fed-token budget by.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# t(k)/t(1) of the embedded 5.3M target's shape, 2 threads, 200 cached tokens, float32, on the
# 2-core development CPU (`benchmarks/engine_step_profile.md`)
COST_K = (1, 2, 4, 8, 16, 32)
COST_2_THREADS = (1.0, 1.09, 1.24, 1.38, 1.73, 2.13)

# `choose_defaults`: a block's tail is fed by every forward, so it must be cheap; drafts ride
# only when the n-gram pool finds some, so the budget may cost more. With the development CPU's
# ratios these give block 4 and budget 26, beside the measured-fastest 4 and 24 (RECOMMENDED).
BLOCK_MAX_COST = 1.3  # t(n)/t(1) of the block size n at most
BUDGET_MAX_COST = 2.0  # t(b)/t(1) of the fed-token budget b at most
MAX_BLOCK = 16  # plain Jacobi's tokens per forward stop growing well before (the paper's n)


def step_cost(k: float, ratios: Sequence[float], ks: Sequence[int] = COST_K) -> float:
    """t(k) / t(1): linear between the measured `ks`, proportional to k past the last one."""
    if len(ratios) != len(ks):
        raise ValueError(f"{len(ratios)} ratios for {len(ks)} measured k")
    if k >= ks[-1]:
        return ratios[-1] * k / ks[-1]
    if k <= ks[0]:
        return ratios[0]
    for (k0, r0), (k1, r1) in zip(zip(ks, ratios), zip(ks[1:], ratios[1:])):
        if k <= k1:
            return r0 + (r1 - r0) * (k - k0) / (k1 - k0)
    raise AssertionError("unreachable")


def tokens_per_second(tpf: float, step_seconds: float) -> float:
    """Predicted throughput of a method making `tpf` tokens final per forward of that cost."""
    return tpf / step_seconds


def speedup_vs_ar(tpf: float, t1: float, tk: float) -> float:
    """TPF x t(1) / t(k): the method's predicted tokens/s over AR's (1 token per t(1))."""
    return tpf * t1 / tk


@dataclass(frozen=True)
class Defaults:
    """Decode settings chosen from a machine's t(k)/t(1), and the ratios that chose them."""

    block_size: int
    recycle_budget: int
    block_cost: float  # t(block_size)/t(1)
    budget_cost: float  # t(recycle_budget)/t(1)
    why: str


def _largest_under(limit: float, ratios: Sequence[float], ks: Sequence[int], candidates: Sequence[int]) -> int:
    """The largest candidate k such that every candidate up to it costs at most `limit` (a noisy
    dip after a step over the limit does not count); 1 when none does."""
    best = 1
    for k in sorted(candidates):
        if step_cost(k, ratios, ks) > limit:
            break
        best = k
    return best


def choose_defaults(ks: Sequence[int], ratios: Sequence[float], *, block_max_cost: float = BLOCK_MAX_COST,
                    budget_max_cost: float = BUDGET_MAX_COST, max_block: int = MAX_BLOCK) -> Defaults:
    """Block size n: the largest measured k (at most `max_block`) whose t(k)/t(1) stays within
    `block_max_cost`; fed-token budget: the largest k up to the largest measured one whose
    interpolated t(k)/t(1) stays within `budget_max_cost` (never below n)."""
    if not ks or ks[0] != 1:
        raise ValueError("the measured k must start at 1 (the AR step every ratio is against)")
    block = _largest_under(block_max_cost, ratios, ks, [k for k in ks if k <= max_block])
    budget = max(block, _largest_under(budget_max_cost, ratios, ks, range(1, ks[-1] + 1)))
    block_cost, budget_cost = step_cost(block, ratios, ks), step_cost(budget, ratios, ks)
    why = (f"block size {block}: the largest measured k <= {max_block} with t(k)/t(1) <= {block_max_cost} "
           f"(t({block})/t(1) = {block_cost:.2f}); budget {budget}: the largest k <= {ks[-1]} with "
           f"t(k)/t(1) <= {budget_max_cost} (t({budget})/t(1) = {budget_cost:.2f})")
    return Defaults(block, budget, block_cost, budget_cost, why)
