"""Lossless sampling (temperature > 0, top-k, top-p): the target distribution, plain AR sampling
(the baseline and oracle), and the speculative-sampling acceptance that lets Jacobi decoding
sample exactly from it.

Jacobi sampling (used by `jacobi_decode(..., temperature=...)`): every iteration feeds the block's
tail (its last final token, then the draft tokens) and gets the target distribution `p_i` after
every fed prefix. Draft `d` at position i was drawn from a known distribution `q` (the previous
iteration's `p` at that position, computed from a context that may have been wrong; a point mass
on the guess for the initial guess). Left to right, `d` is accepted with probability
``min(1, p(d) / q(d))``; at the first rejection the final token is drawn from the normalised
residual ``max(0, p - q)`` and the drafts after it are redrawn from this iteration's `p`s, with
those as their new `q`; when every draft is accepted, the token after them is drawn from the last
`p`. Each final token is then distributed exactly as AR sampling's (speculative sampling, Leviathan
et al. 2023 / Chen et al. 2023): the drafts are drawn independently of the acceptance draws, and
`q` is the law each was drawn from.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from cllm.core.errors import first_line
from cllm.decoding.argmax import argmax
from cllm.decoding.autoregressive import autoregressive
from cllm.decoding.inputs import row_generators
from cllm.decoding.settings import GREEDY_BELOW, is_greedy  # noqa: F401 (re-exported)
from cllm.decoding.stats import DecodeOutput


@dataclass(frozen=True)
class Sampling:
    """The distribution every sampler draws from: softmax(logits / temperature), restricted to the
    `top_k` most likely tokens and to the smallest set whose probability reaches `top_p`."""

    temperature: float
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= GREEDY_BELOW:
            raise ValueError(f"temperature must be >= {GREEDY_BELOW:.3g} to sample (below, decoding is greedy), got "
                             f"{self.temperature!r}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"top_k must be an int >= 1, got {self.top_k!r}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """(..., V) logits -> (..., V) float32 probabilities of the processed distribution."""
        # shift by the max before dividing: the same softmax, and no overflow to inf (then NaN)
        # however small the temperature (a tiny one gives a point mass on the argmax)
        scores = logits.float()
        scores = (scores - scores.amax(-1, keepdim=True)) / self.temperature
        if self.top_k is not None and self.top_k < scores.shape[-1]:
            kth = scores.topk(self.top_k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = scores.softmax(-1)
        if self.top_p is not None and self.top_p < 1:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            before = sorted_p.cumsum(-1) - sorted_p  # mass of the tokens ranked above each one
            drop_sorted = before >= self.top_p  # the most likely token is always kept
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            probs = probs.masked_fill(drop, 0.0)
            probs = probs / probs.sum(-1, keepdim=True)
        return probs


def make_sampling(temperature: float, top_k: int | None, top_p: float | None) -> Sampling | None:
    """None (greedy) for temperature 0 or below `GREEDY_BELOW`, else the validated `Sampling`."""
    if is_greedy(temperature):
        return None
    return Sampling(float(temperature), top_k, top_p)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token drawn from `probs` (V,); a law that is no distribution (NaN logits from the
    model, say) is a ValueError that says so."""
    try:
        return int(torch.multinomial(probs, 1, generator=generator).item())
    except RuntimeError as exc:
        raise ValueError(f"cannot sample: {first_line(exc)} (NaN or inf in the model's logits?)") from None


def pick_tokens(logits: torch.Tensor, sampling: Sampling | None,
                generators: Sequence[torch.Generator | None]) -> list[int]:
    """Every row's next token from its logits (B, V): the argmax (greedy), or one draw per row
    from the sampled distribution with the row's generator."""
    if sampling is None:
        return argmax(logits).tolist()
    return [draw(p, g) for p, g in zip(sampling.probs(logits), generators, strict=True)]


def verify_drafts(
    tail: Sequence[int], drafts_q: Sequence[torch.Tensor | None], probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[list[int], int, list[torch.Tensor]]:
    """One iteration's outputs for a tail under sampling.

    tail: the fed tokens, `tail[0]` final, `tail[1:]` drafts; drafts_q[i]: the law `tail[i+1]` was
    drawn from (None: a point mass on it); probs: (len(tail), V), `probs[i]` the target law after
    `tail[:i+1]`. Returns ``outputs`` in the greedy engine's shape (`outputs[i]` is the token for
    position i+1, so the accepted drafts equal the tail and `accepted_length` counts them),
    the number of accepted drafts `a`, and the laws of the fresh drafts ``outputs[a+1:]``.
    """
    outputs: list[int] = []
    a = 0
    for i, d in enumerate(tail[1:]):
        p, q = probs[i], drafts_q[i]
        qd = 1.0 if q is None else float(q[d])
        u = float(torch.rand((), generator=generator, device=probs.device))
        if qd > 0 and u * qd < float(p[d]):  # accept with probability min(1, p(d) / q(d))
            outputs.append(d)
            a += 1
            continue
        residual = p.clone()
        if q is None:
            residual[d] = 0.0
        else:
            residual = (p - q).clamp(min=0)
        if not float(residual.sum()) > 0:  # only by float round-off: p == q
            residual = p
        outputs.append(draw(residual / residual.sum(), generator))
        break
    else:
        outputs.append(draw(probs[len(tail) - 1], generator))  # every draft accepted: the next token
    fresh = [probs[i] for i in range(len(outputs), len(tail))]
    outputs += [draw(p, generator) for p in fresh]
    return outputs, a, fresh


@torch.inference_mode()
def sample_decode(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int = 128,
    eos_token_id: int | Iterable[int] | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
) -> DecodeOutput:
    """Plain autoregressive sampling, one token per row per forward, KV cache: the baseline
    (`cllm_ar_sampling`) and the law Jacobi sampling must reproduce. `generator`: None, one, or
    one per row (a row's draws then do not depend on its batch mates)."""
    sampling = Sampling(float(temperature), top_k, top_p)
    generators = row_generators(generator, input_ids.shape[0])
    return autoregressive(model, input_ids, attention_mask, max_new_tokens=max_new_tokens,
                          eos_token_id=eos_token_id, choose=lambda logits: pick_tokens(logits, sampling, generators))
