"""How many tokens a row feeds per forward: the width that makes the most tokens per second.

A forward feeding k tokens costs c(k) = t(k)/t(1) one-token forwards (the runtime's measured
step cost, `Runtime.step_costs`); it makes g(k) tokens final on average. Feeding k pays when
g(k)/c(k) beats plain decoding's 1/1. On a GPU c(k) stays near 1 and wide steps pay; on two CPU
cores a 24-token forward of a 135M model costs seven 1-token ones, and a model whose drafts are
rarely right decodes fastest one token at a time.

`Width` keeps, per row, a running estimate of g(k) for every k up to the widest fed, from what
each forward actually accepted: the fed tokens are a prefix-closed tree (`tree.Tree`, a chain
being one branch) whose nodes are numbered in the order a narrower feed would have kept them
(the tail first, then each draft's new nodes), so a feed of k tokens would have accepted exactly
the accepted nodes numbered below k. One wide forward thus tells every narrower width what it
would have made. Widths wider than any fed recently are unknown: now and then the row feeds
twice its width once (capped by the budget; as often as such probes, were they all wasted, cost
`PROBE_SHARE` of the time), so a prompt that starts paying is noticed, and one that stops
paying falls back within a few forwards (`SMOOTHING`).

Speed only: which tokens are fed never changes which become final (greedy verification), up to
the numerics of runtimes whose logits depend on a forward's width (`cllm.runtime.llamacpp`).
"""

from __future__ import annotations

from collections.abc import Sequence

SMOOTHING = 0.25  # weight of the newest forward in each width's running gain
PROBE_SHARE = 0.015 # probes of a wider width cost at most this share of the time, were they all wasted
PROBE_EVERY = 8  # forwards between probes at the least (when a wider forward costs little more)
FIRST_COST = 1.5  # a row's first forward feeds the widest k with c(k) at most this


def interpolate(costs: Sequence[float], k: int) -> float:
    """c(k) from `costs[i]` = c(i + 1); past the last measured width, proportional to k."""
    if k <= len(costs):
        return costs[k - 1]
    return costs[-1] * k / len(costs)


class Width:
    """One row's fed width: `choose()` before a forward, `observe(fed, accepted)` after it."""

    def __init__(self, costs: Sequence[float], most: int) -> None:
        if not costs or costs[0] <= 0:
            raise ValueError("step costs start with c(1) > 0")
        self.most = max(1, most)  # the widest a row may feed (its budget)
        self.cost = [interpolate(costs, k) / costs[0] for k in range(1, self.most + 1)]
        self.gain: list[float | None] = [None] * self.most  # g(k), k = 1..most; None: never fed that wide
        self.since_probe = 0
        # the first forward is as wide as costs 1.5 plain steps: it tells every narrower width at once
        self.width = max(k for k in range(1, self.most + 1) if k == 1 or self.cost[k - 1] <= FIRST_COST)

    def choose(self) -> int:
        """The width of the next forward: the best known gain per cost, or a probe of a wider one."""
        known = [k for k in range(1, self.most + 1) if self.gain[k - 1] is not None]
        if not known:
            return self.width
        best = max(known, key=lambda k: (self.gain[k - 1] / self.cost[k - 1], -k))
        self.since_probe += 1
        if best < self.most:
            probe = min(self.most, 2 * best)
            extra = (self.cost[probe - 1] - self.cost[best - 1]) / self.cost[best - 1]
            if self.since_probe >= max(PROBE_EVERY, extra / PROBE_SHARE):
                self.since_probe, best = 0, probe
        self.width = best
        return best

    def observe(self, fed: int, accepted: Sequence[int]) -> None:
        """After a forward that fed `fed` tokens (nodes 0..fed-1 in narrowing order) and kept the
        nodes `accepted` (root first): every width up to `fed` learns what it would have made."""
        for k in range(1, min(fed, self.most) + 1):
            made = sum(1 for node in accepted if node < k)
            old = self.gain[k - 1]
            self.gain[k - 1] = made if old is None else old + SMOOTHING * (made - old)

    def expected(self, k: int) -> float | None:
        """The running estimate of tokens made final by a forward of width k (None: unknown)."""
        return self.gain[k - 1]
