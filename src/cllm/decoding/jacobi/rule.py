"""The Jacobi update and its acceptance rule: pure functions on token lists (docs/method.md).

A block of `n` future tokens is a fixed-point problem: one forward over the block state `y`
gives `y'_{i+1} = argmax p(. | x, y_<=i)` at every position at once, and the fixed point is
greedy decoding's output. Each forward feeds a block's *tail* (its last final token, then its
unverified drafts); `accepted_length` says how many fed tokens that forward made final and
`jacobi_update` gives the next state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Where a final token came from. Every forward makes one token final as greedy decoding would
# ("ar": the prediction after the last verified token); the others were drafts it verified:
# an earlier update's output ("jacobi"), a recycled n-gram ("pool"), the model's draft table
# ("table"), or the block's initial guess ("guess").
SOURCES = ("ar", "jacobi", "pool", "table", "guess")


@dataclass(frozen=True)
class IterationEvent:
    """One state of one block's Jacobi trajectory (passed to `on_iteration`)."""

    row: int  # batch row
    block_index: int  # 0-based block counter of this row
    iteration: int  # 0 = the initial guess, j = the block state after j Jacobi updates
    state: tuple[int, ...]  # the whole block state; length = this block's size (<= block_size)
    committed: int  # how many leading tokens of `state` are final
    converged: bool  # True on the block's last event: state[:committed] is the fixed point
    # where each final token (state[:committed]) came from, one of SOURCES
    sources: tuple[str, ...] = ()


def accepted_length(tail: Sequence[int], outputs: Sequence[int]) -> int:
    """How many leading fed tokens are final after one forward.

    `tail[0]` is known correct; `outputs[i]` is the argmax after `tail[:i+1]`. Token `tail[i]`
    is final when every token before it is and it equals the output predicted for it.
    """
    accepted = 1
    while accepted < len(tail) and tail[accepted] == outputs[accepted - 1]:
        accepted += 1
    return accepted


def jacobi_update(state: Sequence[int], committed: int, outputs: Sequence[int]) -> list[int]:
    """The next block state: final tokens stay, every later position takes the output predicted
    for it (`outputs` are those of the tail `state[committed-1:]`, or of its first
    len(outputs) tokens when a narrower forward fed only those: the positions past them keep
    their drafts; the last output points past the block and is not part of the state)."""
    room = len(state) - committed
    return list(state[:committed]) + list(outputs[:room]) + list(state[committed + len(outputs) :])
