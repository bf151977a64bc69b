"""Greedy Jacobi decoding with a KV cache and fast-forward commit (REFERENCE.md).

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
   output, the next forward feeds it alone to learn the next first token (an AR step).

Rows of a batch advance independently inside one batched forward per iteration: tails are
right-padded to the longest and the padding is masked (`cache.py` keeps the per-row bookkeeping).
Token ids only: the engine knows nothing of tokenizers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from cllm.decoding import cache as kv
from cllm.decoding.inputs import eos_set, prepare_prompt
from cllm.decoding.stats import DecodeOutput, DecodeStats

GUESSES = ("prompt", "repeat", "random")


@dataclass(frozen=True)
class IterationEvent:
    """One state of one block's Jacobi trajectory (passed to `on_iteration`)."""

    row: int  # batch row
    block_index: int  # 0-based block counter of this row
    iteration: int  # 0 = the initial guess, j = the block state after j Jacobi updates
    state: tuple[int, ...]  # the whole block state; length = this block's size (<= block_size)
    committed: int  # how many leading tokens of `state` are final
    converged: bool  # True on the block's last event: state[:committed] is the fixed point


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


def make_guess(
    strategy: str,
    count: int,
    *,
    last_token: int,
    prompt_tokens: torch.Tensor,
    vocab_size: int,
    generator: torch.Generator | None,
) -> list[int]:
    """`count` guessed tokens to fill a block after its known first token."""
    if count == 0:
        return []
    device = generator.device if generator is not None else "cpu"
    if strategy == "repeat":
        return [last_token] * count
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
    trajectory: list[tuple[int, ...]] = field(default_factory=list)


@dataclass
class _Row:
    index: int  # batch row
    prompt_tokens: torch.Tensor  # (T_r,) on the CPU, for the "prompt" guess
    generator: torch.Generator | None
    known: list[int] = field(default_factory=list)  # final new tokens; the cache lacks the last
    block: _Block | None = None
    next_block_start: int = 0
    blocks_opened: int = 0
    done: bool = False


@dataclass(frozen=True)
class _Settings:
    block_size: int
    max_new_tokens: int
    eos: frozenset[int]
    guess: str
    vocab_size: int
    device: torch.device
    on_iteration: Callable[[IterationEvent], None] | None


def _tail(row: _Row) -> list[int]:
    """What this row feeds next: its block's tail, or (between blocks) its last known token."""
    if row.block is None:
        return [row.known[-1]]
    return row.block.state[row.block.committed - 1 :]


def _make_final(row: _Row, tokens: Sequence[int], cfg: _Settings) -> int:
    """Append newly final tokens, cut at EOS and at the budget; returns how many were kept."""
    kept = 0
    for token in tokens:
        if row.done:
            break
        row.known.append(token)
        kept += 1
        row.done = token in cfg.eos or len(row.known) >= cfg.max_new_tokens
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
        )
        cfg.on_iteration(event)
    if converged:
        stats.add_block(block.trajectory, block.state[: block.committed])
        row.block = None


def _open_blocks(row: _Row, cfg: _Settings, stats: DecodeStats) -> None:
    """Start the next block(s) whose first token is known: guess the rest, log iteration 0."""
    while row.block is None and len(row.known) > row.next_block_start:
        start = row.next_block_start
        size = min(cfg.block_size, cfg.max_new_tokens - start)
        first = row.known[start]
        guess = make_guess(
            cfg.guess,
            size - 1,
            last_token=first,
            prompt_tokens=row.prompt_tokens,
            vocab_size=cfg.vocab_size,
            generator=row.generator,
        )
        row.block = _Block(index=row.blocks_opened, start=start, state=[first, *guess], committed=1)
        row.blocks_opened += 1
        row.next_block_start = start + size
        _record(row, cfg, stats)  # closes at once when size == 1 or `first` is EOS


def _advance(row: _Row, outputs: list[int], cfg: _Settings, stats: DecodeStats) -> int:
    """Apply one forward's argmax outputs for this row's tail; returns the fed tokens to keep."""
    tail = _tail(row)
    # 1. fast-forward: the leading fed tokens that equal their predictions are final, and so is
    #    the output after the last of them
    accepted = accepted_length(tail, outputs)
    stats.accepted.append(_make_final(row, outputs[:accepted], cfg))
    # 2. Jacobi update of the block, then log it (a carry step between blocks has no block)
    block = row.block
    if block is not None:
        block.state = jacobi_update(block.state, block.committed, outputs)
        block.committed = min(len(row.known) - block.start, len(block.state))
        _record(row, cfg, stats)
    # 3. a finished block may have handed over the next block's first token
    _open_blocks(row, cfg, stats)
    return accepted


# ----------------------------------------------------------------------------------------------
# The batched loop


def _generators(
    generator: torch.Generator | Sequence[torch.Generator] | None, batch_size: int
) -> list[torch.Generator | None]:
    if generator is None or isinstance(generator, torch.Generator):
        return [generator] * batch_size
    generators = list(generator)
    if len(generators) != batch_size or not all(isinstance(g, torch.Generator) for g in generators):
        raise ValueError(
            f"generator must be None, a torch.Generator or a list of {batch_size} of them"
        )
    return generators


def _step(
    model: torch.nn.Module, rc: kv.RowCache, rows: list[_Row], cfg: _Settings, stats: DecodeStats
) -> None:
    """One batched forward: every active row feeds its tail and advances."""
    # 1. right-pad the tails to the longest (the pad repeats a real token and is masked)
    tails = [_tail(row) for row in rows]
    fed = [len(t) for t in tails]
    width = max(fed)
    ids = torch.tensor([t + t[-1:] * (width - len(t)) for t in tails], device=cfg.device)  # (B, L)
    # 2. forward, argmax at every fed position: the one device sync of the iteration
    logits = kv.feed(model, rc, ids, fed)  # (B, L, V)
    outputs = logits.argmax(dim=-1).tolist()
    stats.forward_passes += 1
    # 3. each row accepts what it can; the cache keeps exactly the accepted entries
    keep = [
        _advance(row, out[:f], cfg, stats) for row, out, f in zip(rows, outputs, fed, strict=True)
    ]
    kv.commit(rc, keep, fed=width)


@torch.inference_mode()
def jacobi_decode(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    block_size: int = 16,
    max_new_tokens: int = 128,
    eos_token_id: int | Iterable[int] | None = None,
    guess: str = "prompt",
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    on_iteration: Callable[[IterationEvent], None] | None = None,
) -> DecodeOutput:
    """Greedy Jacobi decoding; `new_tokens` equals `greedy_decode`'s, token for token.

    Args:
        model: a causal LM (any transformers `*ForCausalLM`), on its own device and dtype.
        input_ids: (B, T) prompt token ids, left-padded when rows differ in length.
        attention_mask: (B, T), 0 on the left padding; None means no padding.
        block_size: n, the tokens solved together (>= 1; 1 is greedy decoding).
        max_new_tokens: at most this many new tokens per row (the last block may be shorter).
        eos_token_id: a row stops after producing it (or any of them); it is included.
        guess: how a block's unknown tokens start: "prompt" (uniform over the row's own prompt
            tokens, the reference's default), "repeat" (the block's first token), "random"
            (uniform over the vocabulary).
        generator: seeds the guesses: None (torch's global RNG), one torch.Generator, or one
            per row (a row's guesses then do not depend on its batch mates).
        on_iteration: called with every state of every block of every row (IterationEvent).

    Returns:
        DecodeOutput with Jacobi statistics (accepted tokens per forward, iterations per block,
        fast-forwarded and stationary tokens).
    """
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    if guess not in GUESSES:
        raise ValueError(f"unknown guess {guess!r}; expected one of {', '.join(GUESSES)}")
    prompt = prepare_prompt(model, input_ids, attention_mask, max_new_tokens)
    B = prompt.batch_size
    generators = _generators(generator, B)
    stats = DecodeStats()
    if max_new_tokens == 0:
        return DecodeOutput(new_tokens=[[] for _ in range(B)], forward_passes=0, stats=stats)

    # 1. prefill: the prompt's last logits give every row its first block's first token
    rc, logits = kv.prefill(model, prompt.input_ids, prompt.attention_mask)
    stats.forward_passes = 1
    cfg = _Settings(
        block_size=block_size,
        max_new_tokens=max_new_tokens,
        eos=eos_set(eos_token_id),
        guess=guess,
        vocab_size=logits.shape[-1],
        device=prompt.input_ids.device,
        on_iteration=on_iteration,
    )
    rows = [
        _Row(index=r, prompt_tokens=prompt.row_tokens(r).cpu(), generator=generators[r])
        for r in range(B)
    ]
    for row, token in zip(rows, logits.argmax(dim=-1).tolist(), strict=True):
        stats.accepted.append(_make_final(row, [token], cfg))
        _open_blocks(row, cfg, stats)

    # 2. iterate: one batched forward per step; finished rows leave the batch (and the cache)
    active = rows
    while True:
        still = [i for i, row in enumerate(active) if not row.done]
        if not still:
            break
        if len(still) < len(active):
            kv.select_rows(rc, still)
            active = [active[i] for i in still]
        else:
            kv.maybe_compact(rc)
        _step(model, rc, active, cfg, stats)

    new_tokens = [row.known for row in rows]
    stats.new_tokens = sum(len(t) for t in new_tokens)
    return DecodeOutput(new_tokens=new_tokens, forward_passes=stats.forward_passes, stats=stats)
