"""Drafters: where the tokens a forward verifies come from, besides the Jacobi update itself.

A drafter proposes continuations of a row's history (`propose(context, width)`: a list of
drafts, each a list of at most `width` tokens, best first). Verification decides what is kept,
so a drafter can be wrong at no cost to the output: only speed depends on it. The engine uses
drafters in two ways, both built once from the settings (`Drafters.from_settings`):

- a block's **initial state** is a chain (`fill`): each drafter continues what the ones before
  it proposed until the block is full; the last one, a *guess*, always fills it:
  `CarriedDrafts` (the next-block drafts the previous forward already computed), `TableDrafter`
  (the model's own n-gram table), then the guess (`PromptGuess`, `RepeatGuess`, `RandomGuess`,
  `LookupGuess`);
- with recycling, extra **branches** verified beside the Jacobi tail in one tree forward
  (`branches`): `PoolDrafter` (the n-gram pool: prompt, output, earlier Jacobi states), then
  `TableDrafter`; when sampling, one pool draft *replaces* the tail's drafts instead (`swap`),
  as it does for greedy recycling on a runtime that verifies chains only (`chain`).

A new drafter is a class with `source` (where its tokens are credited, one of `rule.SOURCES`),
`most` (branches it may add) and `propose`, added to `Drafters.from_settings`; the loop that
feeds and verifies is not touched.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from cllm.decoding.draft_table import DraftTable
from cllm.decoding.settings import LOOKUP_NGRAM, JacobiConfig


@dataclass
class DraftContext:
    """What a drafter may look at for one row."""

    history: list[int]  # the prompt, the final tokens, then any drafts already chosen before this one
    prompt_tokens: torch.Tensor | None = None  # (T,) the row's prompt on the CPU (the "prompt" guess)
    generator: torch.Generator | None = None  # the row's generator (the random guesses)
    vocab_size: int = 0
    recent: Sequence[Sequence[int]] = ()  # recycling: recent Jacobi states, the latest last
    carried: Sequence[int] = ()  # next-block drafts the previous forward computed

    def after(self, drafted: Sequence[int]) -> DraftContext:
        """The same context with `drafted` appended to the history (a chain's next link)."""
        if not drafted:
            return self
        return DraftContext(self.history + list(drafted), self.prompt_tokens, self.generator, self.vocab_size,
                            self.recent, self.carried[len(drafted) :])


class Drafter(Protocol):
    source: str  # where the tokens it proposes are credited (rule.SOURCES)
    most: int  # as a tree branch: how many of its drafts are verified at most

    def propose(self, context: DraftContext, width: int) -> list[list[int]]:
        """Drafts (non-empty, at most `width` tokens each, width >= 1) for what follows
        `context.history`; [] when it has none."""
        ...


# ----------------------------------------------------------------------------------------------
# Guesses: a block's unknown tokens when nothing better is known (they always fill the width)


def _randint(high: int, width: int, generator: torch.Generator | None) -> torch.Tensor:
    device = generator.device if generator is not None else "cpu"
    return torch.randint(high, (width,), generator=generator, device=device)


@dataclass(frozen=True)
class PromptGuess:
    """Tokens drawn uniformly from the row's own prompt (the reference's guess)."""

    source: ClassVar[str] = "guess"
    most: ClassVar[int] = 1

    def propose(self, context: DraftContext, width: int) -> list[list[int]]:
        index = _randint(len(context.prompt_tokens), width, context.generator)
        return [context.prompt_tokens[index.cpu()].tolist()]


@dataclass(frozen=True)
class RepeatGuess:
    """The last known token, repeated."""

    source: ClassVar[str] = "guess"
    most: ClassVar[int] = 1

    def propose(self, context: DraftContext, width: int) -> list[list[int]]:
        return [[context.history[-1]] * width]


@dataclass(frozen=True)
class RandomGuess:
    """Tokens drawn uniformly from the vocabulary."""

    source: ClassVar[str] = "guess"
    most: ClassVar[int] = 1

    def propose(self, context: DraftContext, width: int) -> list[list[int]]:
        return [_randint(context.vocab_size, width, context.generator).tolist()]


@dataclass(frozen=True)
class LookupGuess:
    """What followed the history's last 1-3 tokens where they occurred before in the history
    (prompt lookup decoding's draft), the rest as `PromptGuess`."""

    source: ClassVar[str] = "guess"
    most: ClassVar[int] = 1

    def propose(self, context: DraftContext, width: int) -> list[list[int]]:
        found = lookup_continuation(context.history, width)
        if len(found) < width:
            found += PromptGuess().propose(context, width - len(found))[0]
        return [found]


GUESS_DRAFTERS = {"prompt": PromptGuess(), "repeat": RepeatGuess(), "random": RandomGuess(),
                  "lookup": LookupGuess()}


# ----------------------------------------------------------------------------------------------
# Drafters that may have nothing to propose


@dataclass(frozen=True)
class CarriedDrafts:
    """The next block's drafts that the previous forward computed (the outputs past the block's
    end, or the blocks in flight behind it): what Jacobi would have put there anyway."""

    source: ClassVar[str] = "jacobi"
    most: ClassVar[int] = 1

    def propose(self, context: DraftContext, width: int) -> list[list[int]]:
        return [list(context.carried[:width])] if context.carried else []


@dataclass(frozen=True)
class TableDrafter:
    """The chained continuation of the model's own n-gram table (`cllm.decoding.draft_table`), at most
    `max_width` tokens (None: the width asked for)."""

    table: DraftTable
    max_width: int | None = None
    source: ClassVar[str] = "table"
    most: ClassVar[int] = 1

    def propose(self, context: DraftContext, width: int) -> list[list[int]]:
        found = self.table.continuation(context.history, min(width, self.max_width or width))
        return [found] if found else []


@dataclass(frozen=True)
class PoolDrafter:
    """The n-gram pool: continuations of the history's last 3 (else 2, ...) tokens where they
    occurred before, in the history and in recent Jacobi states (`pool_candidates`).

    most: drafts verified at most.
    spare: drafts proposed beyond `most` (a tree branch equal to the tail's own drafts is dropped).
    halve_shorter: a shorter match drafts fewer tokens (greedy tree branches).
    skip_current: leave out the latest Jacobi state (sampling's swap: a draft chosen by looking
        at the drafts it replaces would break the law of the drafts after it)."""

    most: int
    min_ngram: int = 2
    spare: int = 1
    halve_shorter: bool = True
    skip_current: bool = False
    source: ClassVar[str] = "pool"

    def propose(self, context: DraftContext, width: int) -> list[list[int]]:
        recent = context.recent[:-1] if self.skip_current else context.recent
        return pool_candidates(context.history, recent, width, self.most + self.spare, min_ngram=self.min_ngram,
                               halve_shorter=self.halve_shorter)


def lookup_continuation(history: Sequence[int], count: int, max_ngram: int = LOOKUP_NGRAM) -> list[int]:
    """Up to `count` tokens that followed the latest earlier occurrence of the history's last
    `max_ngram` tokens (else of fewer, down to 1) in the history itself; [] when none occurred
    (prompt lookup decoding's draft, used here as a Jacobi initial guess)."""
    found = pool_candidates(history, (), count, 1, max_ngram)
    return found[0] if found else []


def pool_candidates(history: Sequence[int], recent: Sequence[Sequence[int]], width: int, count: int,
                    max_ngram: int = LOOKUP_NGRAM, min_ngram: int = 1,
                    halve_shorter: bool = False) -> list[list[int]]:
    """Up to `count` distinct drafts of up to `width` tokens for what follows `history`: the
    continuations of its last 3 (else 2, else 1, down to `min_ngram`) tokens where they occurred
    before, in the history itself (latest first), then in `recent` sequences (earlier Jacobi
    states, latest last): the n-gram pool that recycling verifies beside the Jacobi tail.
    `halve_shorter`: each token less of match halves the draft's width (a 3-token match may
    draft `width` tokens, a 2-token match width // 2): shorter matches are right less often."""
    h = list(history)
    found: list[list[int]] = []
    sources = [(seq, _token_bytes(seq)) for seq in (h, *reversed(recent))]
    for g in range(min(max_ngram, len(h)), min_ngram - 1, -1):
        key = _token_bytes(h[-g:])
        w = max(1, width >> (max_ngram - g)) if halve_shorter else width
        for seq, data in sources:  # an occurrence must be followed by a token (so not h's own end)
            for start in _occurrences(data, key, len(seq) - 1):
                cand = list(seq[start + g : start + g + w])
                if cand and cand not in found:
                    found.append(cand)
                    if len(found) >= count:
                        return found
    return found


def _token_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as fixed-width machine integers, so that an n-gram is a byte string to search."""
    return array("q", tokens).tobytes()


def _occurrences(data: bytes, key: bytes, before: int) -> Iterator[int]:
    """Token indices where the tokens `key` occur in the tokens `data`, ending before token
    `before`, latest first (bytes.rfind, keeping the matches aligned on whole tokens)."""
    size = _TOKEN_SIZE
    end = before * size
    while end >= 0 and (at := data.rfind(key, 0, end)) >= 0:
        if at % size == 0:
            yield at // size
        end = at + len(key) - 1


_TOKEN_SIZE = array("q").itemsize


# ----------------------------------------------------------------------------------------------
# How the engine composes them


def chained(chain: Sequence[Drafter], context: DraftContext, count: int) -> tuple[list[int], list[str]]:
    """Up to `count` tokens after `context.history`: each drafter of the chain continues what
    the ones before it proposed (its first draft), until `count` are known or the chain ends;
    with each token, where it came from. (vLLM's proposer, `cllm.serving.vllm`, drafts so.)"""
    tokens: list[int] = []
    sources: list[str] = []
    for drafter in chain:
        need = count - len(tokens)
        if need <= 0:
            break
        found = drafter.propose(context.after(tokens), need)
        if found:
            draft = found[0][:need]
            tokens += draft
            sources += [drafter.source] * len(draft)
    return tokens, sources


def fill(chain: Sequence[Drafter], context: DraftContext, count: int) -> tuple[list[int], list[str]]:
    """`count` tokens after `context.history` (`chained`): the chain ends with a guess, which
    always fills the rest."""
    tokens, sources = chained(chain, context, count)
    assert len(tokens) == count, "a fill chain ends with a guess"
    return tokens, sources


def branches(drafters: Sequence[Drafter], context: DraftContext, tail: Sequence[int],
             width: int) -> tuple[list[list[int]], list[str]]:
    """The drafts verified beside `tail` (a row's fed tokens, the first one final): up to `most`
    of each drafter's, leaving out any that the tail or an earlier draft already holds; with
    each draft, its drafter's source."""
    drafts: list[list[int]] = []
    kinds: list[str] = []
    for drafter in drafters:
        taken = 0
        for draft in drafter.propose(context, width):
            if taken == drafter.most:
                break
            if draft and draft != list(tail[1 : 1 + len(draft)]) and draft not in drafts:
                drafts.append(draft)
                kinds.append(drafter.source)
                taken += 1
    return drafts, kinds


@dataclass(frozen=True)
class Drafters:
    """The drafters one decoder uses, chosen once from its settings."""

    block: tuple[Drafter, ...]  # a new block's initial state (`fill`)
    ahead: tuple[Drafter, ...]  # multi-block: drafts of the blocks in flight behind it (`fill`)
    tree: tuple[Drafter, ...] = ()  # greedy recycling: branches beside the tail (`branches`)
    swap: Drafter | None = None  # sampling with recycling: the draft that replaces the tail's
    chain: Drafter | None = None  # greedy recycling where a runtime verifies no trees: the same

    @classmethod
    def from_settings(cls, config: JacobiConfig, draft_table: DraftTable | None, sampling: bool) -> Drafters:
        guess = GUESS_DRAFTERS[config.guess]
        table = (TableDrafter(draft_table),) if draft_table is not None else ()
        tree: tuple[Drafter, ...] = ()
        swap = chain = None
        if config.recycle and not sampling:
            tree = (PoolDrafter(config.recycle, config.recycle_min_ngram),)
            if draft_table is not None:  # one more branch: the table's chain, a block long
                tree += (TableDrafter(draft_table, max_width=config.block_size),)
            chain = PoolDrafter(1, config.recycle_min_ngram, spare=0, halve_shorter=False)
        elif config.recycle:
            swap = PoolDrafter(1, config.recycle_min_ngram, spare=0, halve_shorter=False, skip_current=True)
        return cls(block=(CarriedDrafts(), *table, guess), ahead=(guess,), tree=tree, swap=swap, chain=chain)
