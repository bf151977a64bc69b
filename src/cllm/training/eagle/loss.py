"""The EAGLE loss (Li et al. 2024, arXiv 2401.15077, section 4.1) as pure functions of tensors:
the head's predicted feature f^_{t+1} regresses to the target's true f_{t+1} (SmoothL1), and the
LM head on it is pulled towards the target's distribution there (the classification term):

    L = L_reg + w_cls * L_cls,   L_reg = SmoothL1(f^_{t+1}, f_{t+1}),
    L_cls = KL(softmax(lm_head(f_{t+1})) || softmax(lm_head(f^_{t+1})))

(EAGLE writes L_cls as the cross-entropy to the same soft labels: it differs from the KL by the
target's entropy, which carries no gradient.) Shapes: B texts, T positions, H hidden, V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cllm.modeling.losses import token_distance


def eagle_terms(predicted: torch.Tensor, target: torch.Tensor, predicted_logits: torch.Tensor,
                target_logits: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(L_reg, L_cls) summed over the counted positions: predicted, target (B, T, H) features
    (target detached inside), their logits (B, T, V), mask (B, T). L_reg averages SmoothL1 over
    the hidden dimension of each position, as EAGLE does."""
    if predicted.shape != target.shape or predicted_logits.shape != target_logits.shape \
            or mask.shape != predicted.shape[:2]:
        raise ValueError(f"shapes differ: features {tuple(predicted.shape)} vs {tuple(target.shape)}, logits "
                         f"{tuple(predicted_logits.shape)} vs {tuple(target_logits.shape)}, mask {tuple(mask.shape)}")
    reg = F.smooth_l1_loss(predicted.float(), target.detach().float(), reduction="none").mean(-1)  # (B, T)
    cls = token_distance(target_logits, predicted_logits, "fkl")  # (B, T)
    return (reg * mask).sum(), (cls * mask).sum()


def eagle_loss(predicted: torch.Tensor, target: torch.Tensor, predicted_logits: torch.Tensor,
               target_logits: torch.Tensor, mask: torch.Tensor, *, w_cls: float = 0.1) -> torch.Tensor:
    """``(L_reg + w_cls L_cls) / count(mask)`` (`eagle_terms`)."""
    reg, cls = eagle_terms(predicted, target, predicted_logits, target_logits, mask)
    return (reg + w_cls * cls) / mask.sum().clamp(min=1)
