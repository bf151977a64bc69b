"""The batched loop: `BatchDecoder` (rows join and leave between steps) and `jacobi_decode`.

Each `step` is one batched forward: finished rows leave the batch and the cache, then the
verifier (`verifiers.py`) feeds every running row and moves it. `steps()` is the same loop as a
generator, one `StepEvent` per forward: `jacobi_decode` runs it to the end; a caller that
streams text (`cllm generate`) reads each event and stops with `break`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from cllm.decoding.argmax import argmax
from cllm.decoding.draft_table import DraftTable
from cllm.decoding.inputs import eos_set, prepare_prompt, row_generators
from cllm.decoding.jacobi.drafters import Drafters
from cllm.decoding.jacobi.rule import SOURCES, IterationEvent
from cllm.decoding.jacobi.state import Row, Settings, isolated, make_final, open_blocks, scored
from cllm.decoding.jacobi.verifiers import choose_verifier
from cllm.decoding.jacobi.width import Width
from cllm.decoding.logprobs import TokenLogprob
from cllm.decoding.sampling import draw, make_sampling
from cllm.decoding.settings import JacobiConfig
from cllm.decoding.stats import DecodeOutput, DecodeStats
from cllm.runtime import Runtime, as_runtime

GUESS_SEED = 0  # greedy decoding's guesses, when no generator is given


@dataclass(frozen=True)
class StepEvent:
    """What one forward of `BatchDecoder.steps()` did: per row it advanced, the tokens it made
    final (possibly none, EOS included when produced)."""

    new_tokens: dict[int, list[int]]


@torch.inference_mode()
def jacobi_decode(
    model: torch.nn.Module | Runtime,
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
    draft_table: DraftTable | None = None,
    **settings: Any,
) -> DecodeOutput:
    """Greedy Jacobi decoding; `new_tokens` equals `greedy_decode`'s, token for token. With
    `temperature` > 0, lossless Jacobi sampling: the output is distributed exactly as
    `sample_decode`'s (speculative-sampling acceptance, `cllm.decoding.sampling`).

    Args:
        model: a causal LM (any transformers `*ForCausalLM`, decoded on its "auto" runtime), or a
            runtime (`cllm.runtime`: `open_runtime`, or `load_for_decoding(...).model`).
        input_ids: (B, T) prompt token ids, left-padded when rows differ in length.
        attention_mask: (B, T), 0 on the left padding; None means no padding.
        config, **settings: the engine's settings, a `JacobiConfig` (block_size, guess,
            recycle, recycle_width, recycle_min_ngram, recycle_budget, blocks_in_flight; see
            it for what each does) and/or its fields as keywords, which override the config's.
        max_new_tokens: at most this many new tokens per row (the last block may be shorter).
        eos_token_id: a row stops after producing it (or any of them); it is included.
        generator: seeds the guesses: None (greedy: a generator per row seeded with
            `GUESS_SEED`, so the same call verifies the same drafts every time; sampling: torch's
            global RNG), one torch.Generator, or one per row (a row's guesses then do not depend
            on its batch mates).
        on_iteration: called with every state of every block of every row (IterationEvent).
        temperature: 0 (greedy, the default) or > 0 to sample; `top_k` / `top_p` restrict the
            sampled distribution as in `sample_decode`. `generator` then also seeds the draws:
            the same seed gives the same output.
        draft_table: an n-gram table of the model's own greedy continuations
            (`cllm.decoding.draft_table`, built by `cllm drafts`): a block's unknown tokens start from
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
    prompt = prepare_prompt(decoder.runtime, input_ids, attention_mask, max_new_tokens)
    if max_new_tokens == 0:  # nothing to decode: no prefill
        row_generators(generator, prompt.batch_size)
        return DecodeOutput(new_tokens=[[] for _ in range(prompt.batch_size)], forward_passes=0,
                            stats=DecodeStats())
    # 1. prefill: the prompt's last logits give every row its first block's first token
    rows = decoder.add(input_ids, attention_mask, max_new_tokens=max_new_tokens, generator=generator)
    decoder.raise_error(rows)
    # 2. iterate: one batched forward per step; finished rows leave the batch (and the cache)
    for _ in decoder.steps():
        decoder.raise_error(rows)
    out = decoder.finish(rows)
    decoder.session.close(rows)  # the entries leave the runtime now, not when the session is collected
    return out


class BatchDecoder:
    """Jacobi decoding of a batch that rows join and leave between steps (continuous batching).

    `add` prefills new prompts (one forward for all of them) and appends them to the running
    batch; `step` is one batched forward in which every unfinished row advances by its own
    acceptance; `remove` takes a row out (finished or not), `finish` collects rows' outputs.
    A row never sees its batch mates: its own cache entries, positions, budget and generator,
    so its tokens are the ones it gets decoded alone (greedy: `greedy_decode`'s; sampling: the
    same draws from the same seed). `jacobi_decode` is this object with every row added at once.

    The settings are `jacobi_decode`'s (a `JacobiConfig` and/or its fields as keywords, then
    EOS, the hook, sampling and the draft table; `drafters` replaces the drafters those choose,
    `jacobi.drafters.Drafters`) and hold for every row: a server groups
    requests that differ in them (greedy vs sampled, block size) into separate decoders.

        decoder = BatchDecoder(model, block_size=4, eos_token_id=eos)
        a, = decoder.add(prompt_a, max_new_tokens=64)
        decoder.step()
        b, = decoder.add(prompt_b, max_new_tokens=16)  # joins at the next step
        for event in decoder.steps():  # one StepEvent per forward, until no row is running
            ...
        decoder.tokens(a), decoder.tokens(b)
    """

    def __init__(
        self,
        model: torch.nn.Module | Runtime,
        config: JacobiConfig | None = None,
        *,
        eos_token_id: int | Iterable[int] | None = None,
        on_iteration: Callable[[IterationEvent], None] | None = None,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        draft_table: DraftTable | None = None,
        drafters: Drafters | None = None,
        **settings: Any,
    ) -> None:
        engine = replace(config or JacobiConfig(), **settings)  # validated by JacobiConfig
        sampling = make_sampling(temperature, top_k, top_p)
        if engine.blocks_in_flight > 1 and sampling is not None:
            raise ValueError("blocks_in_flight is for greedy decoding")
        self.runtime = as_runtime(model)
        if engine.exact and sampling is None and not self.runtime.batch_invariant:
            # a wide forward would round differently from greedy's one-token forwards: decode as greedy does
            engine = replace(engine, block_size=1, recycle=0, blocks_in_flight=1, adaptive=False)
            draft_table = drafters = None
        self.session = self.runtime.session()  # this decoder's rows, on the runtime's forward
        if drafters is None:
            drafters = Drafters.from_settings(engine, draft_table, sampling is not None)
        elif sampling is not None and drafters.tree:
            raise ValueError("tree drafters verify greedily; with sampling use a swap drafter")
        vocab = self.runtime.vocab_size
        if draft_table is not None and draft_table.max_token_id >= vocab:
            raise ValueError(f"the draft table holds token id {draft_table.max_token_id}, outside the model's "
                             f"vocabulary of {vocab}")
        costs = self.runtime.step_costs if engine.adaptive and sampling is None else None
        self.cfg = Settings(**engine.as_kwargs(), eos=eos_set(eos_token_id), vocab_size=vocab,
                            on_iteration=on_iteration, sampling=sampling, draft_table=draft_table, drafters=drafters,
                            step_costs=costs)
        self._verifier = choose_verifier(self.cfg)
        self.stats = DecodeStats()  # the counters since the last `take_stats`
        self._active: list[Row] = []  # the running rows, in the session's order
        self._rows: dict[int, Row] = {}  # every row added and not yet finished / removed

    # -- rows in and out

    @torch.inference_mode()
    def add(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        max_new_tokens: int | Sequence[int] = 128,
        generator: torch.Generator | Sequence[torch.Generator] | None = None,
        logprobs: int | Sequence[int | None] | None = None,
    ) -> list[int]:
        """Prefill these prompts (B, T) (left-padded when they differ in length) in one forward
        and append them to the batch; returns their row ids. Each row may have its own budget
        (>= 1) and generator; they run from the next `step`. `logprobs` (k, or one per row;
        None: none) keeps each final token's log-probability and its position's top k
        (`BatchDecoder.logprobs`), read off the forwards that verify them."""
        budgets = [max_new_tokens] * input_ids.shape[0] if isinstance(max_new_tokens, int) else list(max_new_tokens)
        if len(budgets) != input_ids.shape[0] or not all(isinstance(m, int) and m >= 1 for m in budgets):
            raise ValueError(f"max_new_tokens must be an int >= 1 or one per row, got {max_new_tokens!r}")
        keeps = [logprobs] * len(budgets) if logprobs is None or isinstance(logprobs, int) else list(logprobs)
        if len(keeps) != len(budgets) or not all(k is None or (isinstance(k, int) and k >= 0) for k in keeps):
            raise ValueError(f"logprobs must be None, an int >= 0 or one per row, got {logprobs!r}")
        prompt = prepare_prompt(self.runtime, input_ids, attention_mask, 0)
        limit = self.runtime.position_limit
        for n, m in zip(prompt.lengths, budgets, strict=True):
            if limit is not None and n + m > limit:
                raise ValueError(f"prompt length {n} + max_new_tokens {m} exceeds the model's position limit {limit}")
        B = prompt.batch_size
        cfg = self.cfg
        generators = row_generators(generator, B)
        if cfg.sampling is None:  # greedy: unseeded guesses draw from a row's own seeded generator, so that
            # which tokens a forward verifies (and on a runtime whose numerics follow the forward's width, the
            # text) never depends on what ran before in the process
            generators = [torch.Generator().manual_seed(GUESS_SEED) if g is None else g for g in generators]
        ids, out = self.session.open(prompt.rows)
        logits = out.logits[:, -1]  # (B, V)
        self.stats.forward_passes += 1
        rows = [
            Row(index=ids[r], prompt_tokens=prompt.row_tokens(r), generator=generators[r],
                max_new_tokens=budgets[r], prompt_list=list(prompt.rows[r]), logprobs=keeps[r], width=self._width())
            for r in range(B)
        ]
        greedy = argmax(logits).tolist() if cfg.sampling is None else None

        def first(r: int, row: Row) -> None:  # the prefill's logits give the first new token
            if greedy is not None:
                dist, token = logits[r : r + 1], greedy[r]
            else:  # the distribution it is drawn from (its log-probabilities are read off it)
                dist = cfg.sampling.probs(logits[r : r + 1])
                token = draw(dist[0], row.generator)
            scored(row, cfg, dist, lambda: self.stats.count(row.index, make_final(row, [token], cfg)))
            open_blocks(row, cfg, self.stats)

        isolated(rows, first, lambda row: None)  # a row that fails here is done, its error kept
        for row in rows:
            row.forwards = 1
            self._rows[row.index] = row
        self._active += rows  # the session keeps the newcomers after the running rows
        return [row.index for row in rows]

    def remove(self, row_id: int) -> None:
        """Take a row out now (e.g. its client went away): it stops decoding, its entries leave
        the session at the next step, and its tokens are forgotten."""
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

    def _width(self) -> Width | None:
        """A new row's fed width (`adaptive`, greedy, step costs known): up to the budget, or to
        the tail alone when nothing is recycled."""
        cfg = self.cfg
        if cfg.step_costs is None:
            return None
        most = cfg.block_size * cfg.blocks_in_flight
        if cfg.recycle:
            most = cfg.recycle_budget or max(most, len(cfg.step_costs))
        return Width(cfg.step_costs, most)

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

    def logprobs(self, row_id: int) -> list[TokenLogprob]:
        """Per final new token so far, its log-probability and top alternatives (a row added
        with `logprobs`; else empty)."""
        return self._rows[row_id].scores

    def done(self, row_id: int) -> bool:
        """The row has its last token (EOS or its budget), or failed (`error`)."""
        return self._rows[row_id].done

    def error(self, row_id: int) -> Exception | None:
        """What stopped the row alone (its drafter, its sampler...), or None: a failed row is
        done, its batch mates decode on unharmed; the batched forward itself failing raises."""
        return self._rows[row_id].error

    def raise_error(self, row_ids: Sequence[int]) -> None:
        """Raise the first error of these rows, if any (a caller that wants the exception rather
        than the row's failure alone: `jacobi_decode`)."""
        for row_id in row_ids:
            if (exc := self._rows[row_id].error) is not None:
                raise exc

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
        done = [row.index for row in self._active if row.done]
        if done:  # finished rows leave the session (it may reorder the rows that stay)
            self.session.close(done)
            by_id = {row.index: row for row in self._active}
            self._active = [by_id[r] for r in self.session.rows()]
        if not self._active:
            return False
        for row in self._active:  # `adaptive`: each row's width for this forward
            if row.width is not None:
                row.width.choose()
        self._verifier.step(self.session, self._active, self.cfg, self.stats)
        for row in self._active:
            row.forwards += 1
        return True

    def steps(self) -> Iterator[StepEvent]:
        """`step` until no row is running, yielding after each forward what it made final per
        row. Rows may be added or removed between events; a caller that has what it needs
        stops with `break` (the decoder stays usable)."""
        while True:
            stepped = [row for row in self._active if not row.done]
            before = [len(row.known) for row in stepped]
            if not self.step():
                return
            yield StepEvent({row.index: row.known[n:] for row, n in zip(stepped, before, strict=True)})
