"""Greedy Jacobi decoding with a KV cache and fast-forward commit (docs/method.md).

The next `n` tokens of a row form a *block*, solved as a fixed point: one forward over the block
state `y` gives `y'_{i+1} = argmax p(. | x, y_<=i)` at every position at once. The fixed point is
greedy's output, exactly.

How a row moves (`_advance`), with the cache holding every final token but the last one:

1. the block's first token is known before any update: it is the argmax at the last final
   position, which the previous forward computed anyway (so Jacobi never needs more forward
   passes than greedy);
2. each forward feeds the block's *tail*: its last known token, then the unverified guesses;
3. the fed tokens whose input equals the output predicted for them, from the left, are final:
   their KV entries stay, the rest are rolled back (fast-forward commit); the output after the
   last of them is final too, since it was predicted from an all-correct prefix;
4. when the tail was accepted whole, the output after the block's last token is the next
   block's first token, for free; when the block's last token became known only as such an
   output, the next forward feeds it alone to learn the next first token (an AR step; with
   recycling, pool drafts for the next block ride along in that forward).

Rows of a batch advance independently inside one batched forward per iteration: tails are
right-padded to the longest and the padding is masked (`cache.py` keeps the per-row bookkeeping).
Token ids only: the engine knows nothing of tokenizers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from cllm.decoding import cache as kv
from cllm.decoding.inputs import (
    eos_set,
    model_device,
    position_limit,
    prepare_prompt,
    row_generators,
)
from cllm.decoding.ngram import NgramTable
from cllm.decoding.sampling import Sampling, draw, make_sampling, verify_drafts
from cllm.decoding.settings import GUESSES, LOOKUP_NGRAM, JacobiConfig
from cllm.decoding.stats import DecodeOutput, DecodeStats

RECENT_STATES = 8  # recycling: the n-gram pool remembers this many recent Jacobi states


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


# Where a final token came from. Every forward makes one token final as greedy decoding would
# ("ar": the prediction after the last verified token); the others were drafts it verified:
# an earlier update's output ("jacobi"), a recycled n-gram ("pool"), the model's draft table
# ("table"), or the block's initial guess ("guess").
SOURCES = ("ar", "jacobi", "pool", "table", "guess")


# ----------------------------------------------------------------------------------------------
# The Jacobi update and acceptance rule (pure)


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
    for it (`outputs` are those of the tail `state[committed-1:]`; the last one points past the
    block and is not part of the state)."""
    return list(state[:committed]) + list(outputs[: len(state) - committed])


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
    sources = [h, *reversed(recent)]
    for g in range(min(max_ngram, len(h)), min_ngram - 1, -1):
        key = h[-g:]
        w = max(1, width >> (max_ngram - g)) if halve_shorter else width
        for seq in sources:  # an occurrence must be followed by a token (so not h's own end)
            for start in range(len(seq) - g - 1, -1, -1):
                if seq[start : start + g] == key:
                    cand = list(seq[start + g : start + g + w])
                    if cand and cand not in found:
                        found.append(cand)
                        if len(found) >= count:
                            return found
    return found


def make_guess(
    strategy: str,
    count: int,
    *,
    last_token: int,
    prompt_tokens: torch.Tensor,
    vocab_size: int,
    generator: torch.Generator | None,
    history: Sequence[int] = (),
) -> list[int]:
    """`count` guessed tokens to fill a block after its known first token. `history` (prompt +
    final tokens, ending with `last_token`) feeds the "lookup" guess."""
    if count == 0:
        return []
    device = generator.device if generator is not None else "cpu"
    if strategy == "repeat":
        return [last_token] * count
    if strategy == "lookup":  # copy what followed the same n-gram before; the rest as "prompt"
        found = lookup_continuation(history, count)
        return found + make_guess("prompt", count - len(found), last_token=last_token,
                                  prompt_tokens=prompt_tokens, vocab_size=vocab_size, generator=generator)
    if strategy == "prompt":  # the reference: uniform over the row's own prompt tokens
        index = torch.randint(len(prompt_tokens), (count,), generator=generator, device=device)
        return prompt_tokens[index.cpu()].tolist()
    if strategy == "random":
        return torch.randint(vocab_size, (count,), generator=generator, device=device).tolist()
    raise ValueError(f"unknown guess {strategy!r}; expected one of {', '.join(GUESSES)}")


# ----------------------------------------------------------------------------------------------
# Per-row state (state only; the functions below move it)


@dataclass
class _Block:
    index: int  # block counter of the row
    start: int  # index of its first token among the row's new tokens
    state: list[int]
    committed: int  # leading tokens of `state` that are final
    origin: list[str] = field(default_factory=list)  # per state position: where its token came from
    trajectory: list[tuple[int, ...]] = field(default_factory=list)
    # sampling only: per state position, the law its draft was drawn from (None: a guess)
    laws: list[torch.Tensor | None] = field(default_factory=list)


@dataclass
class _Row:
    index: int  # batch row
    prompt_tokens: torch.Tensor  # (T_r,) on the CPU, for the "prompt" guess
    generator: torch.Generator | None
    max_new_tokens: int  # this row's budget (rows of a batch may differ)
    prompt_list: list[int] = field(default_factory=list)  # the same as a list, for "lookup"
    recent: list[list[int]] = field(default_factory=list)  # recycling: recent Jacobi states
    ahead: list[int] = field(default_factory=list)  # multi-block: drafts of the blocks after this one
    known: list[int] = field(default_factory=list)  # final new tokens; the cache lacks the last
    sources: list[str] = field(default_factory=list)  # per final new token: where it came from
    block: _Block | None = None
    next_block_start: int = 0
    blocks_opened: int = 0
    forwards: int = 0  # forward passes this row took part in, its prefill included
    done: bool = False


@dataclass(frozen=True)
class _Settings(JacobiConfig):
    """The engine's settings (`JacobiConfig`, validated) plus what a run knows of its model."""

    eos: frozenset[int] = frozenset()
    vocab_size: int = 0  # known from the first prefill's logits
    device: torch.device = torch.device("cpu")
    on_iteration: Callable[[IterationEvent], None] | None = None
    sampling: Sampling | None = None  # None: greedy
    draft_table: NgramTable | None = None  # the model's own n-gram continuations (guesses, drafts)


def _tail(row: _Row) -> list[int]:
    """What this row feeds next: its block's tail (then the drafts of the blocks in flight behind
    it), or (between blocks) its last known token."""
    if row.block is None:
        return [row.known[-1]]
    return row.block.state[row.block.committed - 1 :] + row.ahead


def _set_drafts(row: _Row, drafts: Sequence[int], source: str = "pool") -> None:
    """Overwrite the first len(drafts) draft positions of the tail (block, then ahead)."""
    block = row.block
    c, room = block.committed, len(block.state) - block.committed
    merged = list(drafts) + (block.state[c:] + row.ahead)[len(drafts) :]
    for i, token in enumerate(merged[: min(room, len(drafts))]):  # a token the draft changed is the draft's
        if token != block.state[c + i]:
            block.origin[c + i] = source
    block.state = block.state[:c] + merged[:room]
    row.ahead = merged[room:]


def _make_final(row: _Row, tokens: Sequence[int], cfg: _Settings, sources: Sequence[str] = ("ar",)) -> int:
    """Append newly final tokens, cut at EOS and at the budget; returns how many were kept.
    `sources[i]`: where tokens[i] came from (`SOURCES`)."""
    kept = 0
    for token, source in zip(tokens, sources, strict=True):
        if row.done:
            break
        row.known.append(token)
        row.sources.append(source)
        kept += 1
        row.done = token in cfg.eos or len(row.known) >= row.max_new_tokens
    return kept


def _record(row: _Row, cfg: _Settings, stats: DecodeStats) -> None:
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


def _open_blocks(row: _Row, cfg: _Settings, stats: DecodeStats) -> None:
    """Start the next block(s) whose first token is known: its tokens already final (several,
    when drafts in flight were accepted across the block boundary), then the drafts in flight,
    then guesses; log iteration 0."""
    while row.block is None and len(row.known) > row.next_block_start:
        start = row.next_block_start
        size = min(cfg.block_size, row.max_new_tokens - start)
        final = row.known[start : start + size]
        # `ahead` drafted the new tokens from `start` on; the final ones replace their drafts
        drafted = row.ahead[len(final) : size] if row.ahead else []
        row.ahead = row.ahead[size:]
        need = size - len(final) - len(drafted)
        from_ahead = len(drafted)
        if cfg.draft_table is not None and need:  # the table's continuation first, then `guess`
            drafted += cfg.draft_table.continuation(row.prompt_list + row.known[: start + len(final)] + drafted, need)
        guess = make_guess(
            cfg.guess,
            size - len(final) - len(drafted),
            last_token=final[-1],
            prompt_tokens=row.prompt_tokens,
            vocab_size=cfg.vocab_size,
            generator=row.generator,
            history=row.prompt_list + row.known[: start + len(final)] if cfg.guess == "lookup" else (),
        )
        origin = (["ar"] * len(final) + ["jacobi"] * from_ahead + ["table"] * (len(drafted) - from_ahead)
                  + ["guess"] * len(guess))  # the final ones' sources are in row.sources already
        row.block = _Block(index=row.blocks_opened, start=start, state=[*final, *drafted, *guess],
                           committed=len(final), origin=origin, laws=[None] * size)
        row.blocks_opened += 1
        row.next_block_start = start + size
        if cfg.blocks_in_flight > 1:  # keep (blocks_in_flight - 1) blocks of drafts behind it
            want = min((cfg.blocks_in_flight - 1) * cfg.block_size, row.max_new_tokens - start - size)
            row.ahead = row.ahead[:want]
            row.ahead += make_guess(cfg.guess, want - len(row.ahead), last_token=row.block.state[-1],
                                    prompt_tokens=row.prompt_tokens, vocab_size=cfg.vocab_size,
                                    generator=row.generator, history=())
        else:
            row.ahead = []
        _record(row, cfg, stats)  # closes at once when every token is final or `first` is EOS


def _swap_in_pool_draft(row: _Row, cfg: _Settings) -> None:
    """Sampling with recycling: the first pool draft (chosen from final tokens and earlier states
    only, never the current one, so independent of the drafts it replaces) takes the tail's draft
    positions, with a point mass as its law; verification stays exact. (Greedy verifies several
    drafts in a tree.)"""
    block = row.block
    if block is None or block.committed == len(block.state):
        return
    width = min(len(block.state) - block.committed, cfg.recycle_width)
    # not row.recent[-1], the current state: a draft copied from the very drafts it replaces would be
    # chosen by looking at them, and the laws of the drafts after it would no longer be theirs
    found = pool_candidates(row.prompt_list + row.known, row.recent[:-1], width, 1, min_ngram=cfg.recycle_min_ngram)
    if found:
        d = found[0]
        _set_drafts(row, d)
        c = block.committed
        block.laws[c : c + len(d)] = [None] * len(d)


def _sampled_outputs(row: _Row, probs: torch.Tensor) -> tuple[list[int], list[torch.Tensor]]:
    """Sampling's outputs for this row's tail (`verify_drafts`) and the laws of its fresh drafts."""
    tail, block = _tail(row), row.block
    laws = block.laws[block.committed :] if block is not None else []
    outputs, _, fresh = verify_drafts(tail, laws, probs, row.generator)
    return outputs, fresh


def _advance(row: _Row, outputs: list[int], cfg: _Settings, stats: DecodeStats,
             fresh_laws: list[torch.Tensor] | None = None, accepted: int | None = None,
             draft_source: str | None = None) -> int:
    """Apply one forward's outputs (argmax, or sampling's `verify_drafts`) for this row's tail;
    returns the fed tokens to keep. `accepted`, when given, caps what is final (a recycled
    draft's outputs are valid only along its own branch); `draft_source`: where that draft came
    from, when it was verified between blocks (no block holds its tokens)."""
    tail = _tail(row)
    block = row.block
    # 1. fast-forward: the leading fed tokens that equal their predictions are final, and so is
    #    the output after the last of them (the one token a forward always makes final)
    if accepted is None:
        accepted = accepted_length(tail, outputs)
    c = block.committed if block is not None else 0
    sources = [draft_source if block is None else block.origin[c + j] if c + j < len(block.state) else "jacobi"
               for j in range(accepted - 1)] + ["ar"]  # tail[j + 1] is state[c + j], then blocks in flight
    stats.count(row.index, _make_final(row, outputs[:accepted], cfg, sources))
    # 2. Jacobi update of the block, then log it (a carry step between blocks has no block)
    if block is not None:
        old_committed = block.committed
        room = len(block.state) - old_committed  # outputs[room + j] is predicted for ahead[j]
        row.ahead = list(outputs[room : room + len(row.ahead)])
        block.state = jacobi_update(block.state, block.committed, outputs)
        block.origin = block.origin[:old_committed] + ["jacobi"] * room
        block.committed = min(len(row.known) - block.start, len(block.state))
        if cfg.blocks_in_flight == 1 and block.committed < len(block.state):
            row.ahead = []  # a recycled draft's surplus waits only for the next block, not fed again
        if fresh_laws is not None:  # position old_committed + k holds outputs[k]
            first_fresh = old_committed + len(outputs) - len(fresh_laws)
            laws = [None] * first_fresh + list(fresh_laws) + [None] * len(block.state)
            block.laws = laws[: len(block.state)]
        _record(row, cfg, stats)
    # 3. a finished block may have handed over the next block's first token
    _open_blocks(row, cfg, stats)
    # 4. recycling: the pool learns the (new) block's drafts, after its last final token
    if cfg.recycle and row.block is not None:
        row.recent = [*row.recent[1 - RECENT_STATES :], [row.known[-1], *row.block.state[row.block.committed :]]]
    return accepted


# ----------------------------------------------------------------------------------------------
# The batched loop


def _step(
    model: torch.nn.Module, rc: kv.RowCache, rows: list[_Row], cfg: _Settings, stats: DecodeStats
) -> None:
    """One batched forward: every active row feeds its tail and advances."""
    if cfg.recycle and cfg.sampling is not None:  # sampling: a pool draft replaces the Jacobi drafts
        for row in rows:
            _swap_in_pool_draft(row, cfg)
    # 1. right-pad the tails to the longest (the pad repeats a real token and is masked)
    tails = [_tail(row) for row in rows]
    fed = [len(t) for t in tails]
    width = max(fed)
    ids = torch.tensor([t + t[-1:] * (width - len(t)) for t in tails], device=cfg.device)  # (B, L)
    # 2. forward, argmax at every fed position: the one device sync of the iteration
    logits = kv.feed(model, rc, ids, fed)  # (B, L, V)
    stats.forward_passes += 1
    stats.fed.append(width)
    if cfg.sampling is None:
        outputs = logits.argmax(dim=-1).tolist()
        # 3. each row accepts what it can; the cache keeps exactly the accepted entries
        keep = [
            _advance(row, out[:f], cfg, stats) for row, out, f in zip(rows, outputs, fed, strict=True)
        ]
    else:
        probs = cfg.sampling.probs(logits)  # (B, L, V)
        keep = []
        for r, (row, f) in enumerate(zip(rows, fed, strict=True)):
            outputs, fresh = _sampled_outputs(row, probs[r, :f])
            keep.append(_advance(row, outputs, cfg, stats, fresh))
    kv.commit(rc, keep, fed=width)


@dataclass
class _Trie:
    """The tokens one row feeds in a recycling step, as a token trie rooted at the tail's first
    token: the Jacobi tail is the first branch, each pool draft shares the longest prefix it can
    with the branches before it and adds only the rest. Node i's parent is ``parent[i]`` (< i),
    its depth the position offset; a node attends to its ancestors (itself included)."""

    tokens: list[int]
    parent: list[int]
    depth: list[int]
    children: list[dict[int, int]]
    leaves: list[int]  # per branch (tail first, then each draft): its last node

    @classmethod
    def build(cls, tail: Sequence[int], drafts: Sequence[Sequence[int]], budget: int | None = None) -> _Trie:
        """The tail whole, then each draft's new tokens while the trie holds at most `budget`
        tokens (a draft's nodes past it are cut; None: no limit)."""
        trie = cls(tokens=[tail[0]], parent=[-1], depth=[0], children=[{}], leaves=[])
        for b, branch in enumerate((tail[1:], *drafts)):
            node = 0
            for token in branch:
                child = trie.children[node].get(token)
                if child is None:
                    if b > 0 and budget is not None and len(trie.tokens) >= budget:
                        break
                    child = len(trie.tokens)
                    trie.tokens.append(token)
                    trie.parent.append(node)
                    trie.depth.append(trie.depth[node] + 1)
                    trie.children.append({})
                    trie.children[node][token] = child
                node = child
            trie.leaves.append(node)
        return trie

    def ancestor_rows(self, width: int) -> list[list[bool]]:
        """The tree attention mask, `width` x `width`: row i marks node i's ancestors and itself;
        rows and columns past the trie (padding) are all False."""
        rows: list[list[bool]] = []
        for i, p in enumerate(self.parent):
            row = list(rows[p]) if p >= 0 else [False] * width
            row[i] = True
            rows.append(row)
        return rows + [[False] * width for _ in range(width - len(rows))]

    def path(self, node: int) -> list[int]:
        """The nodes from the root to `node`, in order (increasing indices)."""
        nodes = []
        while node >= 0:
            nodes.append(node)
            node = self.parent[node]
        return nodes[::-1]

    def accepted_path(self, outputs: Sequence[int]) -> list[int]:
        """Greedy verification: from the root, descend to the child holding the token predicted
        at the current node while there is one; the nodes walked (root first) are final."""
        nodes = [0]
        while (child := self.children[nodes[-1]].get(outputs[nodes[-1]])) is not None:
            nodes.append(child)
        return nodes


def _step_recycling(
    model: torch.nn.Module, rc: kv.RowCache, rows: list[_Row], cfg: _Settings, stats: DecodeStats
) -> None:
    """One batched forward that verifies, per row, the Jacobi tail and up to `cfg.recycle` pool
    drafts as branches of one token trie (shared prefixes fed once); the longest path whose
    tokens all equal their predictions is final, its KV entries are kept, and the branch it
    lies on becomes the block's new tail."""
    tries, branch_kinds, plain = [], [], True
    for row in rows:
        tail = _tail(row)
        drafts, kinds = [], ["jacobi"]  # per branch: where its tokens came from
        # a draft may reach past the tail (its surplus rides as drafts of the next block); between
        # blocks (the tail is the last final token alone) drafts start the next block, unless
        # blocks in flight already hold its drafts; none are looked for when the budget has no
        # room left after the tail (the trie would add none of their tokens)
        room = cfg.recycle_budget is None or len(tail) < cfg.recycle_budget
        if room and (row.block is not None or cfg.blocks_in_flight == 1):
            width = min(cfg.recycle_width, row.max_new_tokens - len(row.known))
            history = row.prompt_list + row.known
            drafts = [d for d in pool_candidates(history, row.recent, width, cfg.recycle + 1,
                                                 min_ngram=cfg.recycle_min_ngram, halve_shorter=True)
                      if d != tail[1 : 1 + len(d)]][: cfg.recycle]
            kinds += ["pool"] * len(drafts)
            if cfg.draft_table is not None:  # one more branch: the table's chain, a block long
                d = cfg.draft_table.continuation(history, min(width, cfg.block_size))
                if d and d != tail[1 : 1 + len(d)] and d not in drafts:
                    drafts.append(d)
                    kinds.append("table")
        tries.append(_Trie.build(tail, drafts, cfg.recycle_budget))
        branch_kinds.append(kinds)
        plain = plain and len(tries[-1].tokens) == len(tail)
    if plain:  # no draft added a token: a plain Jacobi step (causal, no tree mask to build)
        _step(model, rc, rows, cfg, stats)
        return
    L = max(len(t.tokens) for t in tries)
    # padding repeats a row's last token and offset, sees only itself, and is never kept
    ids = torch.tensor([t.tokens + t.tokens[-1:] * (L - len(t.tokens)) for t in tries])  # (B, L)
    offsets = torch.tensor([t.depth + t.depth[-1:] * (L - len(t.depth)) for t in tries])  # (B, L)
    tree = torch.tensor([t.ancestor_rows(L) for t in tries])  # (B, L, L)
    logits = kv.feed_tree(model, rc, ids.to(cfg.device), offsets, tree)
    out = logits.argmax(dim=-1).tolist()
    stats.forward_passes += 1
    stats.fed.append(L)
    kept = []
    for r, (row, trie) in enumerate(zip(rows, tries, strict=True)):
        accepted = trie.accepted_path(out[r])
        # the first branch (the tail's, else a draft's) the accepted path lies on: its tokens
        # become the tail, its outputs the next state
        tail_path = trie.path(trie.leaves[0])
        b, branch = next((b, p) for b, p in enumerate((tail_path, *map(trie.path, trie.leaves[1:])))
                         if accepted[-1] in p)
        outputs = [out[r][i] for i in branch] + [out[r][i] for i in tail_path[len(branch) :]]
        if row.block is None:  # between blocks: the branch's outputs draft the next block
            row.ahead = outputs
        elif b > 0:
            _set_drafts(row, [trie.tokens[i] for i in branch[1:]], branch_kinds[r][b])
        _advance(row, outputs, cfg, stats, accepted=len(accepted), draft_source=branch_kinds[r][b])
        kept.append(accepted)
    kv.commit_kept(rc, kept, fed=L)


@torch.inference_mode()
def jacobi_decode(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    config: JacobiConfig | None = None,
    max_new_tokens: int = 128,
    eos_token_id: int | Iterable[int] | None = None,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    on_iteration: Callable[[IterationEvent], None] | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    draft_table: NgramTable | None = None,
    **settings: Any,
) -> DecodeOutput:
    """Greedy Jacobi decoding; `new_tokens` equals `greedy_decode`'s, token for token. With
    `temperature` > 0, lossless Jacobi sampling: the output is distributed exactly as
    `sample_decode`'s (speculative-sampling acceptance, `cllm.decoding.sampling`).

    Args:
        model: a causal LM (any transformers `*ForCausalLM`), on its own device and dtype.
        input_ids: (B, T) prompt token ids, left-padded when rows differ in length.
        attention_mask: (B, T), 0 on the left padding; None means no padding.
        config, **settings: the engine's settings, a `JacobiConfig` (block_size, guess,
            recycle, recycle_width, recycle_min_ngram, recycle_budget, blocks_in_flight; see
            it for what each does) and/or its fields as keywords, which override the config's.
        max_new_tokens: at most this many new tokens per row (the last block may be shorter).
        eos_token_id: a row stops after producing it (or any of them); it is included.
        generator: seeds the guesses: None (torch's global RNG), one torch.Generator, or one
            per row (a row's guesses then do not depend on its batch mates).
        on_iteration: called with every state of every block of every row (IterationEvent).
        temperature: 0 (greedy, the default) or > 0 to sample; `top_k` / `top_p` restrict the
            sampled distribution as in `sample_decode`. `generator` then also seeds the draws:
            the same seed gives the same output.
        draft_table: an n-gram table of the model's own greedy continuations
            (`cllm.decoding.ngram`, built by `cllm drafts`): a block's unknown tokens start from
            its chained continuation (then `guess`), and with recycling its continuation (up
            to a block long) is verified as one more draft. Speed only: the output is unchanged.

    `JacobiConfig()`'s defaults are the paper's plain Jacobi decoding. The CLI's faster setting (n = 4, 8
    recycled drafts, the model's draft table) is `jacobi_decode(model, ids, **RECOMMENDED,
    draft_table=table)`, or in one call from a model's name, `fast = load_for_decoding(name)`
    then `jacobi_decode(fast.model, ids, **fast.settings)` (`cllm.models`).

    Returns:
        DecodeOutput with Jacobi statistics (accepted tokens per forward, iterations per block,
        fast-forwarded and stationary tokens, where the tokens came from).
    """
    decoder = BatchDecoder(
        model, config, eos_token_id=eos_token_id, on_iteration=on_iteration, temperature=temperature,
        top_k=top_k, top_p=top_p, draft_table=draft_table, **settings,
    )
    prompt = prepare_prompt(model, input_ids, attention_mask, max_new_tokens)
    if max_new_tokens == 0:  # nothing to decode: no prefill
        row_generators(generator, prompt.batch_size)
        return DecodeOutput(new_tokens=[[] for _ in range(prompt.batch_size)], forward_passes=0,
                            stats=DecodeStats())
    # 1. prefill: the prompt's last logits give every row its first block's first token
    rows = decoder.add(input_ids, attention_mask, max_new_tokens=max_new_tokens, generator=generator)
    # 2. iterate: one batched forward per step; finished rows leave the batch (and the cache)
    while decoder.step():
        pass
    return decoder.finish(rows)


class BatchDecoder:
    """Jacobi decoding of a batch that rows join and leave between steps (continuous batching).

    `add` prefills new prompts (one forward for all of them) and appends them to the running
    batch; `step` is one batched forward in which every unfinished row advances by its own
    acceptance; `remove` takes a row out (finished or not), `finish` collects rows' outputs.
    A row never sees its batch mates: its own cache entries, positions, budget and generator,
    so its tokens are the ones it gets decoded alone (greedy: `greedy_decode`'s; sampling: the
    same draws from the same seed). `jacobi_decode` is this object with every row added at once.

    The settings are `jacobi_decode`'s (a `JacobiConfig` and/or its fields as keywords, then
    EOS, the hook, sampling and the draft table) and hold for every row: a server groups
    requests that differ in them (greedy vs sampled, block size) into separate decoders.

        decoder = BatchDecoder(model, block_size=4, eos_token_id=eos)
        a, = decoder.add(prompt_a, max_new_tokens=64)
        decoder.step()
        b, = decoder.add(prompt_b, max_new_tokens=16)  # joins at the next step
        while decoder.step(): ...
        decoder.tokens(a), decoder.tokens(b)
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: JacobiConfig | None = None,
        *,
        eos_token_id: int | Iterable[int] | None = None,
        on_iteration: Callable[[IterationEvent], None] | None = None,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        draft_table: NgramTable | None = None,
        **settings: Any,
    ) -> None:
        engine = replace(config or JacobiConfig(), **settings)  # validated by JacobiConfig
        sampling = make_sampling(temperature, top_k, top_p)
        if engine.blocks_in_flight > 1 and sampling is not None:
            raise ValueError("blocks_in_flight is for greedy decoding")
        self.model = model
        self.cfg = _Settings(**engine.as_kwargs(), eos=eos_set(eos_token_id), device=model_device(model),
                             on_iteration=on_iteration, sampling=sampling, draft_table=draft_table)
        self.stats = DecodeStats()  # the counters since the last `take_stats`
        self._rc: kv.RowCache | None = None  # the running batch's cache, rows as in `_active`
        self._active: list[_Row] = []
        self._rows: dict[int, _Row] = {}  # every row added and not yet finished / removed
        self._next_id = 0

    # -- rows in and out

    @torch.inference_mode()
    def add(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        max_new_tokens: int | Sequence[int] = 128,
        generator: torch.Generator | Sequence[torch.Generator] | None = None,
    ) -> list[int]:
        """Prefill these prompts (B, T) (left-padded when they differ in length) in one forward
        and append them to the batch; returns their row ids. Each row may have its own budget
        (>= 1) and generator; they run from the next `step`."""
        budgets = [max_new_tokens] * input_ids.shape[0] if isinstance(max_new_tokens, int) else list(max_new_tokens)
        if len(budgets) != input_ids.shape[0] or not all(isinstance(m, int) and m >= 1 for m in budgets):
            raise ValueError(f"max_new_tokens must be an int >= 1 or one per row, got {max_new_tokens!r}")
        prompt = prepare_prompt(self.model, input_ids, attention_mask, 0)
        limit = position_limit(self.model)
        for n, m in zip(prompt.lengths, budgets, strict=True):
            if limit is not None and n + m > limit:
                raise ValueError(f"prompt length {n} + max_new_tokens {m} exceeds the model's position limit {limit}")
        B = prompt.batch_size
        generators = row_generators(generator, B)
        cfg = self.cfg
        rc, logits = kv.prefill(self.model, prompt.input_ids, prompt.attention_mask)
        self.stats.forward_passes += 1
        if not cfg.vocab_size:
            cfg = self.cfg = replace(cfg, vocab_size=logits.shape[-1])
        keep_list = cfg.guess == "lookup" or cfg.recycle or cfg.draft_table is not None
        rows = [
            _Row(index=self._next_id + r, prompt_tokens=prompt.row_tokens(r).cpu(), generator=generators[r],
                 max_new_tokens=budgets[r], prompt_list=prompt.row_tokens(r).tolist() if keep_list else [])
            for r in range(B)
        ]
        self._next_id += B
        if cfg.sampling is None:
            firsts = logits.argmax(dim=-1).tolist()
        else:
            firsts = [draw(p, row.generator) for p, row in zip(cfg.sampling.probs(logits), rows, strict=True)]
        for row, token in zip(rows, firsts, strict=True):
            self.stats.count(row.index, _make_final(row, [token], cfg))
            row.forwards = 1
            _open_blocks(row, cfg, self.stats)
            self._rows[row.index] = row
        if self._rc is None:
            self._rc, self._active = rc, rows
        else:  # the newcomers' cache goes under the running rows' (left-padded to one length)
            kv.append_rows(self._rc, rc)
            self._active += rows
        return [row.index for row in rows]

    def remove(self, row_id: int) -> None:
        """Take a row out now (e.g. its client went away): it stops decoding, its cache entries
        go at the next step, and its tokens are forgotten."""
        row = self._rows.pop(row_id)
        row.done = True

    def finish(self, row_ids: Sequence[int]) -> DecodeOutput:
        """The finished rows' outputs (their new tokens, in order) with the counters since the
        last `take_stats`; the rows are forgotten."""
        rows = [self._rows.pop(r) for r in row_ids]
        stats = self.take_stats()
        stats.new_tokens = sum(len(row.known) for row in rows)
        stats.sources = {s: n for s in SOURCES if (n := sum(row.sources.count(s) for row in rows))}
        return DecodeOutput(new_tokens=[row.known for row in rows], forward_passes=stats.forward_passes, stats=stats)

    def set_recycle_budget(self, recycle_budget: int | None) -> None:
        """Change how many tokens a row feeds per forward at most with recycling (the tail
        whole, then drafts until spent; None: no limit), from the next step on. Speed only: the
        output is unchanged. A server shrinks it as its batch grows, so that a forward stays
        about as wide (on a CPU its cost grows with every token fed)."""
        self.cfg = replace(self.cfg, recycle_budget=recycle_budget)  # validated by JacobiConfig

    # -- what a caller reads between steps

    def tokens(self, row_id: int) -> list[int]:
        """The row's final new tokens so far (EOS included when produced); they never change."""
        return self._rows[row_id].known

    def done(self, row_id: int) -> bool:
        """The row has its last token (EOS or its budget)."""
        return self._rows[row_id].done

    def forward_passes(self, row_id: int) -> int:
        """Forwards the row took part in, its prefill included (its cost, were it alone)."""
        return self._rows[row_id].forwards

    @property
    def running(self) -> int:
        """Rows still decoding."""
        return sum(not row.done for row in self._active)

    def take_stats(self) -> DecodeStats:
        """The counters since the last call, and start new ones (a long-running decoder would
        otherwise keep growing them)."""
        stats, self.stats = self.stats, DecodeStats()
        return stats

    # -- the batched loop

    @torch.inference_mode()
    def step(self) -> bool:
        """One batched forward for every unfinished row; False (and no forward) when none is
        left. Finished and removed rows leave the batch and the cache first."""
        still = [i for i, row in enumerate(self._active) if not row.done]
        if not still:
            self._rc, self._active = None, []  # nothing running: the cache goes
            return False
        if len(still) < len(self._active):
            kv.select_rows(self._rc, still)
            self._active = [self._active[i] for i in still]
        else:
            kv.maybe_compact(self._rc)
        if self.cfg.recycle and self.cfg.sampling is None:
            _step_recycling(self.model, self._rc, self._active, self.cfg, self.stats)
        else:
            _step(self.model, self._rc, self._active, self.cfg, self.stats)
        for row in self._active:
            row.forwards += 1
        return True
