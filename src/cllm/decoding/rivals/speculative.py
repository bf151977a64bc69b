"""Speculative decoding with a draft model (Leviathan et al. 2023, Chen et al. 2023; the shape of
gpt-fast's `speculative_decode` and transformers' assisted generation), on our KV caches.

Each step a small draft model proposes the next `n` tokens one by one from its own KV cache; the
target verifies them all in one forward over ``[last final token, d1 .. dn]`` and keeps the
longest prefix of drafts it agrees with, plus one token of its own (so every target forward
makes at least one token final, as a greedy step does).

- Greedy: a draft is kept only where it equals the target's argmax, so the output is
  `greedy_decode`'s on the target, token for token, whatever the draft proposes.
- Sampling (temperature > 0): drafts are drawn from the draft's processed law q and accepted
  with the speculative-sampling rule against the target's p (`sampling.verify_drafts`, which
  Jacobi sampling uses too), so the text has exactly the law of `sample_decode` on the target.

Sessions (each model on its runtime, `cllm.runtime`): the target's rows hold every final token
but the last, as in Jacobi decoding; the draft's hold a prefix of the final tokens, and each
step first feeds the final tokens it lacks (one; two after a step whose drafts were all
accepted). After verification both hold exactly the final tokens again (`keep`, `rewind`).

Batches: the rows of a left-padded batch advance together, one draft forward per draft token and
one target forward per step, each row accepting its own prefix; finished rows leave both
sessions. Every row drafts the same `n`: at most k, and at most
the tokens the row nearest its budget still needs, minus one, so no row feeds past its budget.

Token ids only: the draft must share the target's tokenizer (and vocabulary size).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from cllm.decoding.argmax import argmax
from cllm.decoding.inputs import eos_set, finalize, prepare_prompt, row_generators
from cllm.decoding.sampling import Sampling, draw, make_sampling, pick_tokens, verify_drafts
from cllm.decoding.stats import DecodeOutput, DecodeStats
from cllm.runtime import Runtime, Session, as_runtime

# How the draft length changes between steps: "constant" keeps k; "heuristic" is transformers'
# assisted-generation schedule (k + 2 after a step whose drafts were all accepted, else k - 1).
SCHEDULES = ("constant", "heuristic")


# ----------------------------------------------------------------------------------------------
# The acceptance rule and the schedule (pure)


def accepted_drafts(drafts: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
    """Greedy acceptance for a whole batch in one comparison: `drafts` (B, n), `outputs`
    (B, n + 1) the target's argmax after each prefix of ``[last, d1 .. dn]``. Per row, how many
    leading drafts equal the target's prediction for them (B,)."""
    return (drafts == outputs[:, :-1]).int().cumprod(dim=1).sum(dim=1)


def next_draft_tokens(k: int, all_accepted: bool, schedule: str) -> int:
    """The next step's draft length (`SCHEDULES`)."""
    if schedule == "constant":
        return k
    return k + 2 if all_accepted else max(1, k - 1)


# ----------------------------------------------------------------------------------------------
# The drafter: a small model and its own cache


@dataclass
class Drafts:
    """One step's proposals."""

    tokens: torch.Tensor  # (B, n) on the draft's device
    laws: list[list[torch.Tensor]] | None = None  # sampling: laws[r][i], the law tokens[r, i] was drawn from


class ModelDrafter:
    """Proposes drafts with a small causal LM in its own session: its argmax, or draws from its
    processed law when sampling. Holds state only: the session, its rows (in the decoder's row
    order), how many of each row's final tokens they hold, and its forward count."""

    def __init__(self, model: torch.nn.Module | Runtime, prompts: list[list[int]], sampling: Sampling | None) -> None:
        self.runtime = as_runtime(model)
        self.sampling = sampling
        self.prompts = prompts  # per row: its unpadded prompt tokens
        self.session: Session | None = None  # opened by the first proposal
        self.rows: list[int] = []  # the session's row of each decoder row
        self.cached = [0] * len(prompts)  # per row: its final new tokens in the session
        self.forward_passes = 0
        self._fed_drafts = 0  # drafts of the last proposal that went into the session

    def propose(self, known: list[list[int]], count: int,
                generators: Sequence[torch.Generator | None]) -> Drafts:
        """`count` drafts per row after its final new tokens `known[r]`: one forward feeding
        what the session lacks of them (the first one opens the rows on prompt + them), then one
        forward per draft but the last (which only the target reads)."""
        B = len(known)
        self._fed_drafts = max(count - 1, 0)
        if count == 0:
            none = torch.zeros(B, 0, dtype=torch.long)
            return Drafts(none, None if self.sampling is None else [[] for _ in range(B)])
        # 1. the final tokens the session lacks; logits (B, V) after each row's last of them
        if self.session is None:
            self.session = self.runtime.session()
            self.rows, out = self.session.open([p + k for p, k in zip(self.prompts, known, strict=True)])
            logits = out.logits[:, -1]
        else:
            missing = [k[c:] for k, c in zip(known, self.cached, strict=True)]
            logits = self.session.feed(self.rows, missing).logits  # (B, width, V)
            self.session.keep(self.rows, [range(len(m)) for m in missing])
            last = torch.tensor([len(m) - 1 for m in missing], device=logits.device)
            logits = logits[torch.arange(B, device=logits.device), last]
        self.cached = [len(k) for k in known]
        self.forward_passes += 1
        # 2. draft token by token
        tokens, laws = [], []
        for i in range(count):
            token, law = self._choose(logits, generators)
            tokens.append(token)
            laws.append(law)
            if i + 1 < count:
                logits = self.session.feed(self.rows, [[t] for t in token]).logits[:, -1]  # (B, V)
                self.session.keep(self.rows, [[0]] * B)
                self.forward_passes += 1
        by_row = None if self.sampling is None else [[law[r] for law in laws] for r in range(B)]
        return Drafts(torch.tensor(tokens).t().reshape(B, count), by_row)

    def _choose(self, logits: torch.Tensor, generators: Sequence[torch.Generator | None]
                ) -> tuple[list[int], list[torch.Tensor] | None]:
        """The next draft of every row and, when sampling, the law each was drawn from."""
        if self.sampling is None:
            return argmax(logits).tolist(), None
        probs = self.sampling.probs(logits)  # (B, V)
        return [draw(p, g) for p, g in zip(probs, generators, strict=True)], list(probs)

    def accept(self, accepted: list[int]) -> None:
        """Row r's first `accepted[r]` drafts of the last proposal became final: the session keeps
        those it holds and forgets the rest."""
        kept = [min(a, self._fed_drafts) for a in accepted]
        if self.session is not None:
            self.session.rewind(self.rows, [self.session.length(r) - (self._fed_drafts - k)
                                            for r, k in zip(self.rows, kept, strict=True)])
        self.cached = [c + k for c, k in zip(self.cached, kept, strict=True)]

    def select_rows(self, rows: list[int]) -> None:
        """Keep only these rows (the others finished)."""
        if self.session is not None:
            self.session.close([r for i, r in enumerate(self.rows) if i not in set(rows)])
            self.rows = [self.rows[i] for i in rows]
        self.prompts = [self.prompts[r] for r in rows]
        self.cached = [self.cached[r] for r in rows]

    def close(self) -> None:
        if self.session is not None:
            self.session.close(self.rows)


# ----------------------------------------------------------------------------------------------
# The loop


@dataclass
class _Row:
    index: int  # batch row
    generator: torch.Generator | None
    known: list[int] = field(default_factory=list)  # final new tokens; the target's cache lacks the last
    done: bool = False


def _make_final(row: _Row, tokens: Sequence[int], eos: frozenset[int], budget: int) -> int:
    """Append newly final tokens, cut at EOS and at the budget (`finalize`); returns how many were kept."""
    if row.done:
        return 0
    kept, row.done = finalize(row.known, tokens, eos, budget)
    return kept


def _verify(logits: torch.Tensor, tail: torch.Tensor, drafts: Drafts, sampling: Sampling | None,
            generators: Sequence[torch.Generator | None]) -> list[tuple[int, list[int]]]:
    """Per row: how many drafts the target accepted, and the tokens made final (those drafts,
    then the target's own). `logits` (B, n + 1, V) after each prefix of `tail` (B, n + 1)."""
    if sampling is None:
        outputs = argmax(logits)  # (B, n + 1)
        accepted = accepted_drafts(tail[:, 1:], outputs)  # (B,)
        own = outputs.gather(1, accepted[:, None])  # (B, 1): the target's token after them
        rows = torch.cat([accepted[:, None], tail[:, 1:], own], dim=1).tolist()  # the step's one sync
        return [(r[0], r[1 : 1 + r[0]] + r[-1:]) for r in rows]
    probs = sampling.probs(logits)  # (B, n + 1, V)
    verified = []
    for r, (fed, g) in enumerate(zip(tail.tolist(), generators, strict=True)):
        outputs, a, _ = verify_drafts(fed, drafts.laws[r], probs[r], g)
        verified.append((a, outputs[: a + 1]))
    return verified


def _check_vocabularies(target: Runtime, draft: Runtime) -> None:
    """A draft must propose ids the target reads as the same tokens (and laws over the same V)."""
    if target.vocab_size != draft.vocab_size:
        raise ValueError(f"the draft's vocabulary ({draft.vocab_size}) differs from the target's "
                         f"({target.vocab_size}): they must share a tokenizer")


def _drop_finished(session: Session, rows: list[int], drafter: ModelDrafter, active: list[_Row]) -> list[_Row]:
    """The rows still decoding; the others leave both models' sessions."""
    still = [i for i, row in enumerate(active) if not row.done]
    if len(still) < len(active):
        session.close([rows[i] for i, row in enumerate(active) if row.done])
        drafter.select_rows(still)
        rows[:] = [rows[i] for i in still]
    return [active[i] for i in still]


def _draft_and_verify(session: Session, rows: list[int], drafter: ModelDrafter, active: list[_Row], n: int,
                      sampling: Sampling | None, stats: DecodeStats, eos: set[int], max_new_tokens: int) -> list[int]:
    """One step: the draft proposes n tokens per row, the target verifies them in one forward,
    the accepted ones and the target's own token become final. Returns each row's accepted drafts."""
    generators = [row.generator for row in active]
    drafts = drafter.propose([row.known for row in active], n, generators)
    # the target verifies [last final, d1 .. dn] of every row in one forward
    last = torch.tensor([row.known[-1:] for row in active])  # (B, 1)
    tail = torch.cat([last, drafts.tokens], dim=1)  # (B, n + 1)
    logits = session.feed(rows, tail.tolist()).logits  # (B, n + 1, V)
    stats.forward_passes += 1
    stats.fed.append(n + 1)
    verified = _verify(logits, tail.to(logits.device), drafts, sampling, generators)
    # the accepted drafts and the target's own token are final; both caches keep exactly them
    for row, (_, tokens) in zip(active, verified, strict=True):
        stats.count(row.index, _make_final(row, tokens, eos, max_new_tokens))
    accepted = [a for a, _ in verified]
    session.keep(rows, [range(a + 1) for a in accepted])
    drafter.accept(accepted)
    return accepted


@torch.inference_mode()
def speculative_decode(
    target: torch.nn.Module | Runtime,
    draft: torch.nn.Module | Runtime,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    draft_tokens: int = 4,
    max_new_tokens: int = 128,
    eos_token_id: int | Iterable[int] | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    draft_schedule: str = "constant",
) -> DecodeOutput:
    """Speculative decoding: `draft` proposes, `target` verifies. Greedy (the default): the output
    equals `greedy_decode(target, ...)`'s, token for token. With `temperature` > 0, lossless
    speculative sampling: distributed exactly as `sample_decode(target, ...)`'s.

    Args:
        target: the causal LM whose output this is (any transformers `*ForCausalLM`, or a runtime).
        draft: a smaller causal LM (or runtime) with the same tokenizer; only speed depends on it.
        input_ids: (B, T) prompt token ids, left-padded when rows differ in length; the rows of
            a batch are decoded together (one forward per model per draft token / step).
        attention_mask: (B, T), 0 on the left padding; None means no padding.
        draft_tokens: k, the tokens the draft proposes per step (>= 1; fewer near the budget).
        max_new_tokens: at most this many new tokens per row.
        eos_token_id: a row stops after producing it (or any of them); it is included.
        temperature: 0 (greedy) or > 0 to sample; `top_k` / `top_p` restrict the sampled law of
            both models as in `sample_decode`.
        generator: seeds the draws when sampling: None (torch's global RNG), one
            torch.Generator, or one per row. (Each row's law is exact either way; its draws may
            depend on its batch mates, which can shorten the drafts near the budget.)
        draft_schedule: "constant" (k every step) or "heuristic" (transformers' schedule: k + 2
            after a step whose drafts every row accepted, else k - 1, at least 1).

    Returns:
        DecodeOutput: `forward_passes` counts the target's calls (its prefill included),
        `stats.draft_forward_passes` the draft's; `stats.accepted` the tokens each target
        forward made final (accepted drafts + 1), `stats.fed` the tokens fed to each.
    """
    if not isinstance(draft_tokens, int) or draft_tokens < 1:
        raise ValueError(f"draft_tokens must be an int >= 1, got {draft_tokens!r}")
    if draft_schedule not in SCHEDULES:
        raise ValueError(f"unknown draft_schedule {draft_schedule!r}; expected one of {', '.join(SCHEDULES)}")
    sampling = make_sampling(temperature, top_k, top_p)
    target, draft = as_runtime(target), as_runtime(draft)
    prompt = prepare_prompt(target, input_ids, attention_mask, max_new_tokens)
    prepare_prompt(draft, input_ids, attention_mask, max_new_tokens)  # the draft's position limit too
    _check_vocabularies(target, draft)
    B, eos = prompt.batch_size, eos_set(eos_token_id)
    rows = [_Row(r, g) for r, g in enumerate(row_generators(generator, B))]
    stats = DecodeStats()
    if max_new_tokens == 0:
        return DecodeOutput(new_tokens=[[] for _ in rows], forward_passes=0, stats=stats)

    # 1. prefill the target: every row's first token
    session = target.session()
    ids, out = session.open(prompt.rows)
    stats.forward_passes = 1
    for row, token in zip(rows, pick_tokens(out.logits[:, -1], sampling, [r.generator for r in rows]), strict=True):
        stats.count(row.index, _make_final(row, [token], eos, max_new_tokens))
    drafter = ModelDrafter(draft, [list(p) for p in prompt.rows], sampling)
    active, k = rows, draft_tokens
    while active := _drop_finished(session, ids, drafter, active):  # 2. finished rows leave both sessions
        # 3. the draft proposes n tokens per row, none past the budget of the row nearest its end
        n = min(k, min(max_new_tokens - len(row.known) for row in active) - 1)
        accepted = _draft_and_verify(session, ids, drafter, active, n, sampling, stats, eos, max_new_tokens)
        if n:
            k = next_draft_tokens(k, all(a == n for a in accepted), draft_schedule)
    drafter.close()

    stats.draft_forward_passes = drafter.forward_passes
    stats.new_tokens = sum(len(row.known) for row in rows)
    return DecodeOutput(new_tokens=[row.known for row in rows], forward_passes=stats.forward_passes,
                        stats=stats)
