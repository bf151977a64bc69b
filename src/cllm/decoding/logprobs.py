"""Log-probabilities of the tokens a decoder makes final, read off the forward that verified
them (no forward of their own).

A final token is the output at some fed position of the forward that accepted it (greedy: the
argmax there; sampling: the draw, or the speculative-sampling acceptance). Its log-probability
is taken from that position's distribution: the model's own (log-softmax of the logits) when
greedy, which is what autoregressive decoding's logits give at that token; when sampling, the
distribution it was drawn from (temperature, top-k and top-p applied, as OpenAI reports it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """One final token's log-probability and its position's `k` most likely tokens."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token, logprob), most likely first; none of probability 0


def token_logprobs(dist: torch.Tensor, tokens: Sequence[int], k: int, *, probs: bool) -> list[TokenLogprob]:
    """`tokens[i]`'s entry from `dist[i]` (n, V): logits, or (`probs`) the probabilities a
    sampler drew it from; with `k` > 0 the k most likely tokens of each position too."""
    logp = dist.float().log() if probs else dist.float().log_softmax(-1)
    chosen = logp.gather(-1, torch.tensor(list(tokens), device=logp.device)[:, None])[:, 0].tolist()
    if k <= 0:
        return [TokenLogprob(t, lp) for t, lp in zip(tokens, chosen, strict=True)]
    values, ids = logp.topk(min(k, logp.shape[-1]), dim=-1)
    return [TokenLogprob(t, lp, tuple((i, v) for i, v in zip(row_ids, row_values, strict=True) if v > -float("inf")))
            for t, lp, row_ids, row_values in zip(tokens, chosen, ids.tolist(), values.tolist(), strict=True)]
