"""The exact law of a model's first sampled tokens, by enumeration: the oracle of the
lossless-sampling tests.

It shares no code with `cllm.decoding` on purpose (every sampler under test draws from
`Sampling.probs`): the processed law (temperature, then top-k, then top-p) is recomputed here in
float64 from the raw logits of plain full forwards without a cache, one row per context, and the
joint law of the first `length` new tokens is the product of the conditionals along every
sequence. Meant for a vocabulary of a few tokens (V^length sequences).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

# top-p: a cumulative mass this close to top_p could be cut differently by the engine's float32
# and this float64; the oracle refuses such a setting rather than guess
TOP_P_GUARD = 1e-4


def processed_law(logits: Sequence[float], temperature: float, top_k: int | None = None,
                  top_p: float | None = None) -> list[float]:
    """softmax(logits / temperature) kept to the `top_k` most likely tokens, then to the fewest
    most likely tokens whose probability reaches `top_p`, renormalised: a probability per token."""
    z = [x / temperature for x in logits]
    ranked = sorted(range(len(z)), key=lambda t: -z[t])
    kept = ranked[:top_k] if top_k is not None else ranked
    weights = {t: math.exp(z[t] - z[ranked[0]]) for t in kept}
    total = sum(weights.values())
    probs = {t: w / total for t, w in weights.items()}
    if top_p is not None:
        nucleus, mass = [], 0.0
        for t in kept:
            nucleus.append(t)
            mass += probs[t]
            assert abs(mass - top_p) > TOP_P_GUARD, f"top_p {top_p} sits on a boundary ({mass})"
            if mass >= top_p:
                break
        probs = {t: probs[t] / mass for t in nucleus}
    return [probs.get(t, 0.0) for t in range(len(z))]


@torch.inference_mode()
def exact_joint_law(model: torch.nn.Module, prompt: Sequence[int], length: int, *,
                    temperature: float, top_k: int | None = None,
                    top_p: float | None = None) -> dict[tuple[int, ...], float]:
    """P(the first `length` sampled tokens after `prompt` are s), for every s of positive
    probability (the others are left out)."""
    law: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(length):
        contexts = list(law)
        ids = torch.tensor([[*prompt, *c] for c in contexts])  # (C, T + k): no padding, no cache
        logits = model(input_ids=ids, use_cache=False).logits[:, -1].double()  # (C, V)
        law = {
            (*c, t): law[c] * p
            for c, row in zip(contexts, logits.tolist(), strict=True)
            for t, p in enumerate(processed_law(row, temperature, top_k, top_p))
            if p > 0
        }
    return law
