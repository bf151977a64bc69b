"""The Medusa-1 loss (Cai et al. 2024, arXiv 2401.10774, section 2.2.1) as pure functions of
tensors: head k at position t learns the frozen model's distribution at t + k (the token k + 1
ahead), on the model's own greedy text, so the heads learn what greedy decoding will write.
Medusa-2's (section 2.2.2, `--joint`) adds the backbone's KL to the frozen original
(`backbone_terms`, `joint_loss`).

Shapes: K heads, B texts, T positions, V vocab. The caller computes the logits (the heads', and
the model's own from its LM head on the same hidden states); nothing here calls a model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cllm.modeling.losses import Distance, token_distance


def medusa_terms(
    head_logits: torch.Tensor, model_logits: torch.Tensor, mask: torch.Tensor, *, distance: Distance = "fkl",
) -> torch.Tensor:
    """Per head, the summed distance to the model's own distribution k positions on: (K,).

    head_logits: (K, B, T, V), head k (row k - 1) reading the hidden state at position t and
    guessing the token k + 1 positions ahead; model_logits: (B, T, V), the frozen model's logits
    at the same positions of the same text (detached inside): those at t + k predict the token
    k + 1 after t, so they are head k's target at t. mask: (B, T), the positions that count;
    head k counts position t when both t and t + k count. With "fkl" this is Medusa's
    self-distillation (soft labels); with "argmax", cross-entropy against the model's greedy
    token there (Medusa-1's hard labels, on the model's own greedy text).
    """
    K, B, T, V = head_logits.shape
    if model_logits.shape != (B, T, V) or mask.shape != (B, T):
        raise ValueError(f"shapes differ: heads {tuple(head_logits.shape)}, model {tuple(model_logits.shape)}, "
                         f"mask {tuple(mask.shape)}")
    terms = []
    for k in range(1, K + 1):
        counted = mask[:, : T - k] & mask[:, k:]  # (B, T - k)
        per_position = token_distance(model_logits[:, k:], head_logits[k - 1, :, : T - k], distance)
        terms.append((per_position * counted).sum())
    return torch.stack(terms)


def medusa_loss(
    head_logits: torch.Tensor,
    model_logits: torch.Tensor,
    mask: torch.Tensor,
    *,
    distance: Distance = "fkl",
    weights: Sequence[float] | torch.Tensor | None = None,
    normalizer: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """The Medusa-1 loss, ``sum_k w_k sum_t D(p(. | x_<=t+k) || q_k(. | h_t))`` over the counted
    positions (`medusa_terms`), divided by `normalizer` (default: the count of `mask`).
    `weights` w_k default to 1 (Medusa uses 0.8^k to favour the heads that are accepted most)."""
    terms = medusa_terms(head_logits, model_logits, mask, distance=distance)
    if weights is not None:
        terms = terms * torch.as_tensor(weights, dtype=terms.dtype, device=terms.device)
    if normalizer is None:
        normalizer = mask.sum().clamp(min=1)
    return terms.sum() / normalizer


def agreement(head_logits: torch.Tensor, model_logits: torch.Tensor,
              mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head k: at how many counted positions t its top-1 token is the model's greedy token at
    t + k (the token k + 1 ahead), and how many positions counted. (K,), (K,)."""
    K, _, T, _ = head_logits.shape
    greedy = model_logits.argmax(-1)  # (B, T)
    hits, counts = [], []
    for k in range(1, K + 1):
        counted = mask[:, : T - k] & mask[:, k:]
        hits.append(((head_logits[k - 1, :, : T - k].argmax(-1) == greedy[:, k:]) & counted).sum())
        counts.append(counted.sum())
    return torch.stack(hits), torch.stack(counts)


# ------------------------------------------------------------------------ Medusa-2 (--joint)


@dataclass
class JointLoss:
    """Medusa-2's loss and its two terms, each per counted position (scalars)."""

    total: torch.Tensor  # backbone + heads_weight * heads: what `backward()` is called on
    backbone: torch.Tensor  # KL(original || model) of the next token
    heads: torch.Tensor  # the Medusa-1 loss against the original's distributions


def backbone_terms(model_logits: torch.Tensor, original_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Summed KL(original || model) of the next-token distribution over the counted positions:
    Medusa-2's self-distillation of the backbone (Cai et al. 2024, section 2.2.2), which keeps
    the model's output close to the frozen original's. model_logits, original_logits: (B, T, V)
    (the original's detached inside); mask: (B, T)."""
    if model_logits.shape != original_logits.shape or mask.shape != model_logits.shape[:2]:
        raise ValueError(f"shapes differ: model {tuple(model_logits.shape)}, original "
                         f"{tuple(original_logits.shape)}, mask {tuple(mask.shape)}")
    return (token_distance(original_logits, model_logits, "fkl") * mask).sum()


def joint_loss(
    model_logits: torch.Tensor | None,
    head_logits: torch.Tensor,
    original_logits: torch.Tensor,
    mask: torch.Tensor,
    *,
    heads_weight: float,
    distance: Distance = "fkl",
    weights: Sequence[float] | torch.Tensor | None = None,
) -> JointLoss:
    """Medusa-2's loss, ``KL(p_orig || p_theta) + lambda * L_medusa`` per counted position.

    The heads read the current model's hidden states (`head_logits`, (K, B, T, V), gradient into
    the model too) and learn the ORIGINAL's distributions (`original_logits`, (B, T, V): the
    frozen original LM head on the original's hidden states), so the target does not move with
    the model. `model_logits` None (the heads' warm-up, the model frozen and equal to the
    original): the backbone term is 0 and the total is the heads' loss alone."""
    count = mask.sum().clamp(min=1)
    heads = medusa_loss(head_logits, original_logits, mask, distance=distance, weights=weights, normalizer=count)
    if model_logits is None:
        return JointLoss(heads, torch.zeros_like(heads), heads)
    backbone = backbone_terms(model_logits, original_logits, mask) / count
    return JointLoss(backbone + heads_weight * heads, backbone, heads)
