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

Caches (both through `cache.py`): the target's holds every final token but the last, as in
Jacobi decoding; the draft's holds a prefix of the final tokens, and each step first feeds the
final tokens it lacks (one; two after a step whose drafts were all accepted). After
verification both hold exactly the final tokens again (`cache.commit`, `cache.rollback`).

Batches: the rows of a left-padded batch advance together, one draft forward per draft token and
one target forward per step, each row accepting its own prefix (the cache adapter keeps the
holes); finished rows leave both caches. Every row drafts the same `n`: at most k, and at most
the tokens the row nearest its budget still needs, minus one, so no row feeds past its budget.

Token ids only: the draft must share the target's tokenizer (and vocabulary size).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

import cllm.runtime.hf_cache as kv
from cllm.decoding.inputs import cut_final, eos_set, left_pad, model_device, prepare_prompt, row_generators
from cllm.decoding.sampling import Sampling, draw, make_sampling, pick_tokens, verify_drafts
from cllm.decoding.stats import DecodeOutput, DecodeStats

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
    """Proposes drafts with a small causal LM from its own KV cache: its argmax, or draws from
    its processed law when sampling. Holds state only: the cache, how many of each row's final
    tokens it holds, and its forward count."""

    def __init__(self, model: torch.nn.Module, prompts: list[list[int]], sampling: Sampling | None) -> None:
        self.model = model
        self.sampling = sampling
        self.prompts = prompts  # per row: its unpadded prompt tokens
        self.rc: kv.RowCache | None = None  # made by the first proposal
        self.cached = [0] * len(prompts)  # per row: its final new tokens in the cache
        self.forward_passes = 0
        self._fed_drafts = 0  # drafts of the last proposal that went into the cache

    def propose(self, known: list[list[int]], count: int,
                generators: Sequence[torch.Generator | None]) -> Drafts:
        """`count` drafts per row after its final new tokens `known[r]`: one forward feeding
        what the cache lacks of them (the first one a prefill of prompt + them), then one
        forward per draft but the last (which only the target reads)."""
        B, device = len(known), model_device(self.model)
        self._fed_drafts = max(count - 1, 0)
        if count == 0:
            none = torch.zeros(B, 0, dtype=torch.long, device=device)
            return Drafts(none, None if self.sampling is None else [[] for _ in range(B)])
        # 1. the final tokens the cache lacks; logits (B, V) after each row's last of them
        if self.rc is None:
            ids, mask = left_pad([p + k for p, k in zip(self.prompts, known, strict=True)], pad_id=0)
            self.rc, logits = kv.prefill(self.model, ids.to(device), mask.to(device))
        else:
            missing = [k[c:] for k, c in zip(known, self.cached, strict=True)]
            fed = [len(m) for m in missing]
            width = max(fed)
            ids = torch.tensor([m + m[-1:] * (width - len(m)) for m in missing], device=device)  # (B, width)
            logits = kv.feed(self.model, self.rc, ids, fed)  # (B, width, V)
            kv.commit(self.rc, keep=fed, fed=width)
            last = torch.tensor(fed, device=logits.device) - 1
            logits = logits[torch.arange(B, device=logits.device), last]
        self.cached = [len(k) for k in known]
        self.forward_passes += 1
        # 2. draft token by token; greedy drafts stay on the device (no host sync per token)
        tokens, laws = [], []
        for i in range(count):
            token, law = self._choose(logits, generators)
            tokens.append(token)
            laws.append(law)
            if i + 1 < count:
                logits = kv.feed(self.model, self.rc, token[:, None], [1] * B)[:, -1]  # (B, V)
                kv.commit(self.rc, keep=[1] * B, fed=1)
                self.forward_passes += 1
        by_row = None if self.sampling is None else [[law[r] for law in laws] for r in range(B)]
        return Drafts(torch.stack(tokens, dim=1), by_row)

    def _choose(self, logits: torch.Tensor, generators: Sequence[torch.Generator | None]
                ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """The next draft of every row (B,) and, when sampling, the law each was drawn from."""
        if self.sampling is None:
            return logits.argmax(dim=-1), None
        probs = self.sampling.probs(logits)  # (B, V)
        drawn = [draw(p, g) for p, g in zip(probs, generators, strict=True)]
        return torch.tensor(drawn, device=logits.device), list(probs)

    def accept(self, accepted: list[int]) -> None:
        """Row r's first `accepted[r]` drafts of the last proposal became final: the cache keeps
        those it holds and forgets the rest."""
        kept = [min(a, self._fed_drafts) for a in accepted]
        if self.rc is not None:
            kv.rollback(self.rc, [self._fed_drafts - k for k in kept])
        self.cached = [c + k for c, k in zip(self.cached, kept, strict=True)]

    def select_rows(self, rows: list[int]) -> None:
        """Keep only these rows (the others finished)."""
        if self.rc is not None:
            kv.select_rows(self.rc, rows)
        self.prompts = [self.prompts[r] for r in rows]
        self.cached = [self.cached[r] for r in rows]

    def compact(self) -> None:
        if self.rc is not None:
            kv.maybe_compact(self.rc)


# ----------------------------------------------------------------------------------------------
# The loop


@dataclass
class _Row:
    index: int  # batch row
    generator: torch.Generator | None
    known: list[int] = field(default_factory=list)  # final new tokens; the target's cache lacks the last
    done: bool = False


def _make_final(row: _Row, tokens: Sequence[int], eos: frozenset[int], budget: int) -> int:
    """Append newly final tokens, cut at EOS and at the budget; returns how many were kept."""
    if row.done:
        return 0
    kept, row.done = cut_final(tokens, eos, budget - len(row.known))
    row.known += tokens[:kept]
    return kept


def _verify(logits: torch.Tensor, tail: torch.Tensor, drafts: Drafts, sampling: Sampling | None,
            generators: Sequence[torch.Generator | None]) -> list[tuple[int, list[int]]]:
    """Per row: how many drafts the target accepted, and the tokens made final (those drafts,
    then the target's own). `logits` (B, n + 1, V) after each prefix of `tail` (B, n + 1)."""
    if sampling is None:
        outputs = logits.argmax(dim=-1)  # (B, n + 1)
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


def _vocab_size(model: torch.nn.Module) -> int | None:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    return None if weight is None else weight.shape[0]


def _check_vocabularies(target: torch.nn.Module, draft: torch.nn.Module) -> None:
    """A draft must propose ids the target reads as the same tokens (and laws over the same V)."""
    t, d = _vocab_size(target), _vocab_size(draft)
    if t is not None and d is not None and t != d:
        raise ValueError(f"the draft's vocabulary ({d}) differs from the target's ({t}): they must share a tokenizer")


@torch.inference_mode()
def _drop_finished(rc: kv.RowCache, drafter: ModelDrafter, active: list[_Row]) -> list[_Row]:
    """The rows still decoding; the others' entries leave both models' caches."""
    still = [i for i, row in enumerate(active) if not row.done]
    if still and len(still) < len(active):
        kv.select_rows(rc, still)
        drafter.select_rows(still)
    elif still:
        kv.maybe_compact(rc)
        drafter.compact()
    return [active[i] for i in still]


def _draft_and_verify(target, rc: kv.RowCache, drafter: ModelDrafter, active: list[_Row], n: int,
                      sampling: Sampling | None, stats: DecodeStats, eos: set[int], max_new_tokens: int) -> list[int]:
    """One step: the draft proposes n tokens per row, the target verifies them in one forward,
    the accepted ones and the target's own token become final. Returns each row's accepted drafts."""
    generators = [row.generator for row in active]
    drafts = drafter.propose([row.known for row in active], n, generators)
    # the target verifies [last final, d1 .. dn] of every row in one forward
    device = model_device(target)
    last = torch.tensor([row.known[-1:] for row in active], device=device)  # (B, 1)
    tail = torch.cat([last, drafts.tokens.to(device)], dim=1)  # (B, n + 1)
    logits = kv.feed(target, rc, tail, [n + 1] * len(active))  # (B, n + 1, V)
    stats.forward_passes += 1
    stats.fed.append(n + 1)
    verified = _verify(logits, tail, drafts, sampling, generators)
    # the accepted drafts and the target's own token are final; both caches keep exactly them
    for row, (_, tokens) in zip(active, verified, strict=True):
        stats.count(row.index, _make_final(row, tokens, eos, max_new_tokens))
    accepted = [a for a, _ in verified]
    kv.commit(rc, keep=[a + 1 for a in accepted], fed=n + 1)
    drafter.accept(accepted)
    return accepted


def speculative_decode(
    target: torch.nn.Module,
    draft: torch.nn.Module,
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
        target: the causal LM whose output this is (any transformers `*ForCausalLM`).
        draft: a smaller causal LM with the same tokenizer; only speed depends on it.
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
    prompt = prepare_prompt(target, input_ids, attention_mask, max_new_tokens)
    prepare_prompt(draft, input_ids, attention_mask, max_new_tokens)  # the draft's position limit too
    _check_vocabularies(target, draft)
    B, eos = prompt.batch_size, eos_set(eos_token_id)
    rows = [_Row(r, g) for r, g in enumerate(row_generators(generator, B))]
    stats = DecodeStats()
    if max_new_tokens == 0:
        return DecodeOutput(new_tokens=[[] for _ in rows], forward_passes=0, stats=stats)

    # 1. prefill the target: every row's first token
    rc, logits = kv.prefill(target, prompt.input_ids, prompt.attention_mask)
    stats.forward_passes = 1
    for row, token in zip(rows, pick_tokens(logits, sampling, [r.generator for r in rows]), strict=True):
        stats.count(row.index, _make_final(row, [token], eos, max_new_tokens))
    drafter = ModelDrafter(draft, [prompt.row_tokens(r).tolist() for r in range(B)], sampling)
    active, k = rows, draft_tokens
    while active := _drop_finished(rc, drafter, active):  # 2. finished rows leave both caches
        # 3. the draft proposes n tokens per row, none past the budget of the row nearest its end
        n = min(k, min(max_new_tokens - len(row.known) for row in active) - 1)
        accepted = _draft_and_verify(target, rc, drafter, active, n, sampling, stats, eos, max_new_tokens)
        if n:
            k = next_draft_tokens(k, all(a == n for a in accepted), draft_schedule)

    stats.draft_forward_passes = drafter.forward_passes
    stats.new_tokens = sum(len(row.known) for row in rows)
    return DecodeOutput(new_tokens=[row.known for row in rows], forward_passes=stats.forward_passes,
                        stats=stats)
