"""One row's decoding state and how one forward's outputs move it (docs/method.md).

How a row moves (`advance`), with the cache holding every final token but the last one:

1. the block's first token is known before any update: it is the argmax at the last final
   position, which the previous forward computed anyway (so Jacobi never needs more forward
   passes than greedy);
2. each forward feeds the block's *tail* (`tail`): its last known token, then the unverified
   drafts;
3. the fed tokens whose input equals the output predicted for them, from the left, are final:
   their KV entries stay, the rest are rolled back (fast-forward commit); the output after the
   last of them is final too, since it was predicted from an all-correct prefix;
4. when the tail was accepted whole, the output after the block's last token is the next
   block's first token, for free; when the block's last token became known only as such an
   output, the next forward feeds it alone to learn the next first token (an AR step; with
   recycling, pool drafts for the next block ride along in that forward).

A new block's initial state comes from the drafters (`drafters.fill`); nothing here draws or
looks up tokens itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cllm.decoding.draft_table import DraftTable
from cllm.decoding.inputs import finalize
from cllm.decoding.jacobi.drafters import DraftContext, Drafters, fill
from cllm.decoding.jacobi.rule import IterationEvent, accepted_length, jacobi_update
from cllm.decoding.jacobi.width import Width
from cllm.decoding.logprobs import TokenLogprob, token_logprobs
from cllm.decoding.sampling import Sampling
from cllm.decoding.settings import JacobiConfig
from cllm.decoding.stats import DecodeStats

RECENT_STATES = 8  # recycling: the n-gram pool remembers this many recent Jacobi states


@dataclass(frozen=True)
class Settings(JacobiConfig):
    """The engine's settings (`JacobiConfig`, validated) plus what a run knows of its model."""

    eos: frozenset[int] = frozenset()
    vocab_size: int = 0  # the runtime's
    on_iteration: Callable[[IterationEvent], None] | None = None
    sampling: Sampling | None = None  # None: greedy
    draft_table: DraftTable | None = None  # the model's own n-gram continuations (guesses, drafts)
    drafters: Drafters | None = None  # chosen from the above by the decoder
    step_costs: tuple[float, ...] | None = None  # c(k), k = 1.. (the runtime's), when `adaptive` uses them


@dataclass
class Block:
    index: int  # block counter of the row
    start: int  # index of its first token among the row's new tokens
    state: list[int]
    committed: int  # leading tokens of `state` that are final
    origin: list[str] = field(default_factory=list)  # per state position: where its token came from
    trajectory: list[tuple[int, ...]] = field(default_factory=list)
    # sampling only: per state position, the law its draft was drawn from (None: a guess)
    laws: list[torch.Tensor | None] = field(default_factory=list)


@dataclass
class Row:
    index: int  # batch row
    prompt_tokens: torch.Tensor  # (T_r,) on the CPU, for the "prompt" guess
    generator: torch.Generator | None
    max_new_tokens: int  # this row's budget (rows of a batch may differ)
    prompt_list: list[int] = field(default_factory=list)  # the same as a list, for the drafters
    recent: list[list[int]] = field(default_factory=list)  # recycling: recent Jacobi states
    # drafts of the tokens after the block's end: the blocks in flight (multi-block), or the
    # outputs past a block accepted whole; fed behind the tail and handed to the next block
    ahead: list[int] = field(default_factory=list)
    known: list[int] = field(default_factory=list)  # final new tokens; the cache lacks the last
    sources: list[str] = field(default_factory=list)  # per final new token: where it came from
    block: Block | None = None
    next_block_start: int = 0
    blocks_opened: int = 0
    forwards: int = 0  # forward passes this row took part in, its prefill included
    done: bool = False
    error: Exception | None = None  # what stopped this row alone (`isolated`); its batch mates go on
    logprobs: int | None = None  # None: none kept; k: each final token's log-probability and its top k
    width: Width | None = None  # `adaptive`: how many tokens it feeds per forward (None: the budget's)
    scores: list[TokenLogprob] = field(default_factory=list)  # per final new token, when `logprobs` is set

    def history(self) -> list[int]:
        """The prompt then the final new tokens."""
        return self.prompt_list + self.known

    def context(self, cfg: Settings, history: list[int] | None = None, carried: Sequence[int] = ()) -> DraftContext:
        """What the drafters see of this row."""
        return DraftContext(self.history() if history is None else history, self.prompt_tokens, self.generator,
                            cfg.vocab_size, self.recent, carried)


def isolated(rows: Sequence[Row], work: Callable[[int, Row], Any], fallback: Callable[[Row], Any]) -> list[Any]:
    """`work(r, row)` for each row r; a row whose work raises stops there (done, its error
    kept) and gets `fallback(row)` instead, as does a row that failed earlier in the step: one
    bad row (a drafter's bug, a law that is no distribution) fails alone while its batch mates
    go on exactly as they would alone."""
    results = []
    for r, row in enumerate(rows):
        if row.error is None:
            try:
                results.append(work(r, row))
                continue
            except Exception as exc:  # noqa: BLE001 - the caller reports the row's failure
                row.error, row.done = exc, True
        results.append(fallback(row))
    return results


def scored(row: Row, cfg: Settings, dist: torch.Tensor, move: Callable[[], Any],
           positions: Callable[[Any], Sequence[int]] | None = None) -> Any:
    """`move()` (a forward's outputs applied to the row), then the log-probabilities of the
    tokens it made final, when the row keeps them: final token j came from fed position
    `positions(result)[j]` (by default j) of `dist` (L, V), the forward's logits for this row
    (greedy) or the probabilities it sampled from."""
    before = len(row.known)
    result = move()
    made = len(row.known) - before
    if row.logprobs is not None and made:
        at = list(range(made)) if positions is None else list(positions(result))[:made]
        row.scores += token_logprobs(dist[at], row.known[before:], row.logprobs, probs=cfg.sampling is not None)
    return result


def last_token(row: Row) -> list[int]:
    """A failed row's filler for the forward it still shares: its last token (never kept)."""
    return (row.known or row.prompt_list)[-1:]


def tail(row: Row) -> list[int]:
    """What this row feeds next: its block's tail (then the drafts of the blocks in flight behind
    it), or (between blocks) its last known token."""
    if row.block is None:
        return [row.known[-1]]
    return row.block.state[row.block.committed - 1 :] + row.ahead


def draft_origins(row: Row) -> list[str]:
    """Where each draft of `tail(row)` (all but its first token) came from, as `advance` credits
    them when no branch's `draft_source` is given: the block's origins, then "jacobi"."""
    block = row.block
    if block is None:
        return []
    return block.origin[block.committed :] + ["jacobi"] * len(row.ahead)


def set_drafts(row: Row, drafts: Sequence[int], source: str = "pool") -> None:
    """Overwrite the first len(drafts) draft positions of the tail (block, then ahead)."""
    block = row.block
    c, room = block.committed, len(block.state) - block.committed
    merged = list(drafts) + (block.state[c:] + row.ahead)[len(drafts) :]
    for i, token in enumerate(merged[: min(room, len(drafts))]):  # a token the draft changed is the draft's
        if token != block.state[c + i]:
            block.origin[c + i] = source
    block.state = block.state[:c] + merged[:room]
    row.ahead = merged[room:]


def swap_in_draft(row: Row, cfg: Settings) -> None:
    """Sampling with recycling: the swap drafter's first draft (chosen from final tokens and
    earlier states only, never the current one, so independent of the drafts it replaces) takes
    the tail's draft positions, with a point mass as its law; verification stays exact."""
    block = row.block
    if block is None or block.committed == len(block.state):
        return
    width = min(len(block.state) - block.committed, cfg.recycle_width)
    found = cfg.drafters.swap.propose(row.context(cfg), width)
    if found:
        d = found[0]
        set_drafts(row, d, cfg.drafters.swap.source)
        c = block.committed
        block.laws[c : c + len(d)] = [None] * len(d)


def make_final(row: Row, tokens: Sequence[int], cfg: Settings, sources: Sequence[str] = ("ar",)) -> int:
    """Append newly final tokens, cut at EOS and at the budget; returns how many were kept.
    `sources[i]`: where tokens[i] came from (`rule.SOURCES`)."""
    assert len(sources) == len(tokens)
    if row.done:
        return 0
    kept, row.done = finalize(row.known, tokens, cfg.eos, row.max_new_tokens)
    row.sources += sources[:kept]
    return kept


def record(row: Row, cfg: Settings, stats: DecodeStats) -> None:
    """Log the current block state; close the block when its fixed point is known."""
    block = row.block
    block.trajectory.append(tuple(block.state))
    converged = block.committed == len(block.state) or row.done
    if cfg.on_iteration is not None:
        event = IterationEvent(
            row=row.index,
            block_index=block.index,
            iteration=len(block.trajectory) - 1,
            state=tuple(block.state),
            committed=block.committed,
            converged=converged,
            sources=tuple(row.sources[block.start : block.start + block.committed]),
        )
        cfg.on_iteration(event)
    if converged:
        stats.add_block(block.trajectory, block.state[: block.committed])
        row.block = None


def open_blocks(row: Row, cfg: Settings, stats: DecodeStats) -> None:
    """Start the next block(s) whose first token is known: its tokens already final (several,
    when drafts in flight were accepted across the block boundary), then the block drafters'
    chain (the drafts in flight, the draft table, the guess); log iteration 0."""
    while row.block is None and len(row.known) > row.next_block_start:
        start = row.next_block_start
        size = min(cfg.block_size, row.max_new_tokens - start)
        final = row.known[start : start + size]
        # `ahead` drafted the new tokens from `start` on; the final ones replace their drafts
        carried = row.ahead[len(final) : size]
        row.ahead = row.ahead[size:]
        context = row.context(cfg, row.prompt_list + row.known[: start + len(final)], carried)
        drafted, origin = fill(cfg.drafters.block, context, size - len(final))
        # the final tokens' sources are in row.sources already
        row.block = Block(index=row.blocks_opened, start=start, state=[*final, *drafted], committed=len(final),
                          origin=["ar"] * len(final) + origin, laws=[None] * size)
        row.blocks_opened += 1
        row.next_block_start = start + size
        if cfg.blocks_in_flight > 1:  # keep (blocks_in_flight - 1) blocks of drafts behind it
            want = min((cfg.blocks_in_flight - 1) * cfg.block_size, row.max_new_tokens - start - size)
            row.ahead = row.ahead[:want]
            if want > len(row.ahead):
                behind = context.after(drafted).after(row.ahead)
                row.ahead += fill(cfg.drafters.ahead, behind, want - len(row.ahead))[0]
        else:
            row.ahead = []
        record(row, cfg, stats)  # closes at once when every token is final or `first` is EOS


def advance(row: Row, outputs: list[int], cfg: Settings, stats: DecodeStats,
            fresh_laws: list[torch.Tensor] | None = None, accepted: int | None = None,
            draft_source: str | None = None) -> int:
    """Apply one forward's outputs (argmax, or sampling's `verify_drafts`) for this row's tail;
    returns the fed tokens to keep. `accepted`, when given, caps what is final (a tree branch's
    outputs are valid only along its own path); `draft_source`: where that draft came from, when
    it was verified between blocks (no block holds its tokens)."""
    fed = tail(row)
    block = row.block
    # 1. fast-forward: the leading fed tokens that equal their predictions are final, and so is
    #    the output after the last of them (the one token a forward always makes final)
    if accepted is None:  # a narrower forward fed the tail's first len(outputs) tokens only
        accepted = accepted_length(fed[: len(outputs)], outputs)
    c = block.committed if block is not None else 0
    # fed[j + 1] is state[c + j], then the drafts past the block (a branch's, else Jacobi's)
    beyond = draft_source or "jacobi"
    sources = [draft_source if block is None else block.origin[c + j] if c + j < len(block.state) else beyond
               for j in range(accepted - 1)] + ["ar"]
    kept = make_final(row, outputs[:accepted], cfg, sources)
    stats.count(row.index, kept)
    stats.count_drafts(stats.drafts_accepted, sources[: min(kept, accepted - 1)])  # the last, "ar", is no draft
    # 2. Jacobi update of the block, then log it (a carry step between blocks has no block)
    if block is not None:
        old_committed = block.committed
        room = len(block.state) - old_committed  # outputs[room + j] is predicted for ahead[j]
        fresh = outputs[room:]  # what a narrower forward did not feed keeps its draft (and origin)
        row.ahead = list(fresh[: len(row.ahead)]) + row.ahead[len(fresh) :]
        block.state = jacobi_update(block.state, block.committed, outputs)
        updated = min(room, len(outputs))
        block.origin = block.origin[:old_committed] + ["jacobi"] * updated + block.origin[old_committed + updated :]
        block.committed = min(len(row.known) - block.start, len(block.state))
        if cfg.blocks_in_flight == 1 and block.committed < len(block.state):
            row.ahead = []  # a recycled draft's surplus waits only for the next block, not fed again
        if fresh_laws is not None:  # position old_committed + k holds outputs[k]
            first_fresh = old_committed + len(outputs) - len(fresh_laws)
            laws = [None] * first_fresh + list(fresh_laws) + [None] * len(block.state)
            block.laws = laws[: len(block.state)]
        record(row, cfg, stats)
    # 3. a finished block may have handed over the next block's first token
    open_blocks(row, cfg, stats)
    # 4. recycling: the pool learns the (new) block's drafts, after its last final token
    if cfg.recycle and row.block is not None:
        row.recent = [*row.recent[1 - RECENT_STATES :], [row.known[-1], *row.block.state[row.block.committed :]]]
    return accepted
