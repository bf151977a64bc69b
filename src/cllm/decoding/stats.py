"""What a decode run counts, and the pure functions that count it.

Definitions follow docs/method.md#counting exactly:

- forward passes: every model call, prefill included;
- tokens per forward: new tokens / forward passes (for a batch, per row: all rows' new tokens
  over all rows' forwards, so a batch reads like batch 1);
- fast-forwarded tokens of one Jacobi update: how many tokens that update newly made correct
  (equal to the fixed point) in a contiguous run from the left;
- stationary tokens of a block: positions that became correct, and stayed unchanged through
  every later state, while some token before them was still wrong. Each position counts once.

A block's trajectory is the list of its states, first = the initial guess, last = the fixed point
(possibly followed by tokens after an EOS, which are ignored: the fixed point is then shorter).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from itertools import pairwise


def correct_prefix_length(state: Sequence[int], fixed_point: Sequence[int]) -> int:
    """Length of the leading run of `state` that equals the fixed point."""
    n = 0
    for token, target in zip(state, fixed_point, strict=False):
        if token != target:
            break
        n += 1
    return n


def fast_forwarded_per_update(
    trajectory: Sequence[Sequence[int]], fixed_point: Sequence[int]
) -> list[int]:
    """Tokens each update (state j -> j+1) newly made correct from the left; len = len(trajectory) - 1."""
    prefix = [correct_prefix_length(state, fixed_point) for state in trajectory]
    return [after - before for before, after in pairwise(prefix)]


def stationary_count(trajectory: Sequence[Sequence[int]], fixed_point: Sequence[int]) -> int:
    """Positions that were already correct and stayed unchanged while a token before them was wrong.

    A position i is stationary when, at the first state from which it stays correct for good,
    the correct prefix is still shorter than i (so some earlier token is wrong). The correct
    prefix never shrinks under Jacobi iteration, so this one state decides.
    """
    count = 0
    for i, target in enumerate(fixed_point):
        # the first state j from which position i is correct in every later state
        j = len(trajectory)
        while j > 0 and trajectory[j - 1][i] == target:
            j -= 1
        if j < len(trajectory) and correct_prefix_length(trajectory[j], fixed_point) < i:
            count += 1
    return count


@dataclass
class DecodeStats:
    """Counters of one decode call (greedy, Jacobi or speculative); lists are flat over rows
    and blocks."""

    forward_passes: int = 0  # model calls for the whole batch, prefill included
    # speculative decoding only: the draft model's calls (its prefill included), apart from
    # `forward_passes`, which counts the target's (docs/method.md#counting)
    draft_forward_passes: int = 0
    new_tokens: int = 0  # over all rows
    # per (row, forward the row took part in): how many tokens that forward made final for it
    accepted: list[int] = field(default_factory=list)
    # the batch row of each entry of `accepted` (so per-row counts survive batching)
    accepted_rows: list[int] = field(default_factory=list)
    # Jacobi only, per block: updates it took (0 when its only token came for free)
    iterations_per_block: list[int] = field(default_factory=list)
    # Jacobi only, per update: fast-forwarded tokens (docs/method.md#counting)
    fast_forwarded: list[int] = field(default_factory=list)
    # Jacobi only, per block: stationary tokens (docs/method.md#counting)
    stationary: list[int] = field(default_factory=list)
    # per forward after the prefill: tokens fed per row (the batch's width, padding included);
    # a step's cost grows with it (t(k) in the bound of docs/method.md#counting)
    fed: list[int] = field(default_factory=list)
    # Jacobi only: new tokens by where they came from (`jacobi.rule.SOURCES`: "ar", "jacobi", "pool",
    # "table", "guess"); what makes a method fast
    sources: dict[str, int] = field(default_factory=dict)
    # Jacobi only: draft tokens by source ("ar" is no draft), per row and forward as they are fed
    # to be verified (a trie's shared node once) and as they are made final; counted as they go,
    # so a long-running decoder's `take_stats` hands them on step by step
    drafted: dict[str, int] = field(default_factory=dict)
    drafts_accepted: dict[str, int] = field(default_factory=dict)

    @property
    def row_forwards(self) -> int:
        return len(self.accepted)

    def count(self, row: int, tokens: int) -> None:
        """One forward of batch row `row` made `tokens` tokens final."""
        self.accepted.append(tokens)
        self.accepted_rows.append(row)

    def count_drafts(self, counts: dict[str, int], sources: Sequence[str]) -> None:
        """Add one draft token per entry of `sources` to `counts` (`drafted` or `drafts_accepted`)."""
        for source in sources:
            counts[source] = counts.get(source, 0) + 1

    def forwards_per_row(self, rows: int) -> list[int]:
        """Forward passes each of `rows` batch rows took part in (prefill included)."""
        counts = [0] * rows
        for r in self.accepted_rows:
            counts[r] += 1
        return counts

    @property
    def tokens_per_forward(self) -> float:
        """New tokens per forward pass of a row (at batch 1: new tokens / forward passes)."""
        return self.new_tokens / self.row_forwards if self.accepted else 0.0

    @property
    def mean_fast_forwarded(self) -> float:
        """Fast-forwarded tokens per update, averaged over updates, blocks and rows (the reference's figure)."""
        return sum(self.fast_forwarded) / len(self.fast_forwarded) if self.fast_forwarded else 0.0

    @property
    def mean_fed(self) -> float:
        """Tokens fed per forward after the prefill (1.0 for greedy decoding)."""
        return sum(self.fed) / len(self.fed) if self.fed else 0.0

    @property
    def stationary_tokens(self) -> int:
        return sum(self.stationary)

    @property
    def mean_iterations_per_block(self) -> float:
        blocks = self.iterations_per_block
        return sum(blocks) / len(blocks) if blocks else 0.0

    def accepted_histogram(self) -> dict[int, int]:
        """{tokens made final by one forward: how many forwards}, sorted by the count of tokens."""
        return dict(sorted(Counter(self.accepted).items()))

    def add_block(self, trajectory: Sequence[Sequence[int]], fixed_point: Sequence[int]) -> None:
        """Record one finished block from its trajectory (first state = guess) and fixed point."""
        self.iterations_per_block.append(len(trajectory) - 1)
        self.fast_forwarded.extend(fast_forwarded_per_update(trajectory, fixed_point))
        self.stationary.append(stationary_count(trajectory, fixed_point))

    def summary(self) -> dict[str, float | int | dict[int, int]]:
        """Scalars for logs and JSON reports."""
        return {
            "forward_passes": self.forward_passes,
            "draft_forward_passes": self.draft_forward_passes,
            "new_tokens": self.new_tokens,
            "tokens_per_forward": self.tokens_per_forward,
            "mean_iterations_per_block": self.mean_iterations_per_block,
            "mean_fast_forwarded": self.mean_fast_forwarded,
            "stationary_tokens": self.stationary_tokens,
            "mean_fed": self.mean_fed,
            "accepted_histogram": self.accepted_histogram(),
        }

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class DecodeOutput:
    """What the decoders (greedy_decode, jacobi_decode, speculative_decode...) return."""

    new_tokens: list[list[int]]  # per row: generated tokens, EOS included when produced
    forward_passes: int  # model calls for the whole batch, prefill included
    stats: DecodeStats
