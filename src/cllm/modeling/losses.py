"""CLLM training losses as pure functions of tensors (Kou et al. 2024, section 3.2).

Shapes: B batch, N block positions (or T sequence positions for the AR term), V vocab.
Every loss returns a *sum* over counted positions divided by `normalizer`, the number of
counted positions in the whole (global, all accumulation steps, all processes) batch. With
that convention, accumulating k micro-batches gives exactly the gradient of one big batch.
If `normalizer` is None the local count is used (convenient for tests and single steps).

- Global consistency (GC, eq. 4): D(q_theta-( . | x, y*) || q_theta( . | x, y)) for a state y
  sampled from the trajectory, y* its fixed point, theta- = stop-gradient.
- Local consistency (LC, eq. 5): the same between adjacent states y^(j+1) and y^(j).
- AR (eq. 6): next-token cross-entropy on prompt + generated text or ground truth.
- Distillation (GKD): D(p_target || q_theta) to a frozen teacher's full distribution, on any text
  (ground truth, the target's continuations, the student's own rollouts).

The Medusa heads' loss (self-distillation on the frozen model's own text) is
`cllm.training.medusa.loss`'s, built on `token_distance`.

The caller computes the logits; these functions never call a model. `block_logits` cuts the
(B, N, V) block-aligned logits these losses take out of a forward over ``prefix + block``, and
`gc_mask` / `lc_mask` say which block positions count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cllm.modeling.names import Distance


def _normalise(total: torch.Tensor, mask: torch.Tensor, normalizer: float | torch.Tensor | None):
    if normalizer is None:
        normalizer = mask.sum().clamp(min=1)
    return total / normalizer


def token_distance(
    target_logits: torch.Tensor, student_logits: torch.Tensor, distance: Distance = "fkl",
    *, jsd_beta: float = 0.5,
) -> torch.Tensor:
    """Per-position distance between the target (detached inside) and the student.

    target_logits, student_logits: (..., V) -> (...). "fkl" = KL(target || student), the
    reference's soft cross-entropy up to the target's entropy, which carries no gradient;
    "rkl" = KL(student || target); "jsd" = generalised JSD with weight `jsd_beta` (GKD);
    "argmax" = cross-entropy against the target's argmax (what greedy Jacobi needs to match, and
    nothing of the rest of the distribution).
    """
    student_logp = F.log_softmax(student_logits.float(), dim=-1)
    if distance == "argmax":
        hard = target_logits.detach().argmax(-1, keepdim=True)
        return -student_logp.gather(-1, hard).squeeze(-1)
    target_logp = F.log_softmax(target_logits.detach().float(), dim=-1)
    if distance == "fkl":
        return (target_logp.exp() * (target_logp - student_logp)).sum(-1)
    if distance == "rkl":
        return (student_logp.exp() * (student_logp - target_logp)).sum(-1)
    if distance == "jsd":
        # mixture m = beta * target + (1 - beta) * student, in log space for stability
        log_beta = torch.log(torch.tensor(jsd_beta, device=target_logp.device))
        log_1m_beta = torch.log(torch.tensor(1.0 - jsd_beta, device=target_logp.device))
        mix_logp = torch.logsumexp(
            torch.stack([target_logp + log_beta, student_logp + log_1m_beta]), dim=0
        )
        kl_t = (target_logp.exp() * (target_logp - mix_logp)).sum(-1)
        kl_s = (student_logp.exp() * (student_logp - mix_logp)).sum(-1)
        return jsd_beta * kl_t + (1.0 - jsd_beta) * kl_s
    raise ValueError(f"unknown distance {distance!r}; choose fkl, rkl, jsd or argmax")


def consistency_loss(
    target_logits: torch.Tensor,
    student_logits: torch.Tensor,
    mask: torch.Tensor,
    *,
    distance: Distance = "fkl",
    normalizer: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """GC or LC: sum of per-position distances over `mask`, divided by `normalizer`.

    target_logits: (B, N, V) from the model on the fixed point (GC) or on the next state (LC);
    gradients never flow into it. student_logits: (B, N, V) from the model on the state.
    mask: (B, N) bool, True where a position counts.
    """
    if target_logits.shape != student_logits.shape:
        raise ValueError(f"logit shapes differ: {tuple(target_logits.shape)} vs {tuple(student_logits.shape)}")
    if mask.shape != student_logits.shape[:-1]:
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match logits {tuple(student_logits.shape[:-1])}")
    per_position = token_distance(target_logits, student_logits, distance)  # (B, N)
    total = (per_position * mask).sum()
    return _normalise(total, mask, normalizer)


def ar_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor,
    *,
    label_smoothing: float = 0.0,
    normalizer: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Next-token cross-entropy. logits (B, T, V) already aligned with labels (B, T): the
    logits at t predict labels[t]. mask (B, T) selects counted positions."""
    per_position = F.cross_entropy(
        logits.float().flatten(0, 1), labels.flatten(), reduction="none",
        label_smoothing=label_smoothing,
    ).view(labels.shape)
    total = (per_position * mask).sum()
    return _normalise(total, mask, normalizer)


def distill_loss(
    teacher_logits: torch.Tensor,
    student_logits: torch.Tensor,
    mask: torch.Tensor,
    *,
    distance: Distance = "fkl",
    normalizer: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Distillation from a frozen teacher (GKD, Agarwal et al. 2024): D(teacher || student) per
    position, soft labels instead of the hard tokens of `ar_loss`.

    teacher_logits, student_logits: (B, T, V) aligned with each other (the logits at t of both
    models on the same input); mask (B, T) selects counted positions. On the target's own text it
    keeps the student's next-token distribution, not only its argmax, where the target's is;
    on the student's own text (on-policy) it corrects the contexts the student actually reaches.
    """
    return consistency_loss(teacher_logits, student_logits, mask, distance=distance, normalizer=normalizer)


def from_first_difference(state: torch.Tensor, fixed_point: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(B, N) mask of positions from the first one where `state` differs from `fixed_point`.

    The reference counts only these positions in GC: the leading tokens that already equal
    the fixed point have nothing left to learn. A row equal to its fixed point counts nothing.
    """
    differs = (state != fixed_point) & valid
    after_first = differs.int().cummax(dim=1).values.bool()
    return after_first & valid


# ---------------------------------------------------------------------------------------------
# From model logits to the losses of one batch of trajectory records


def block_logits(logits: torch.Tensor, block_width: int) -> torch.Tensor:
    """The logits that predict the block's tokens, from a forward over ``prefix + block``.

    logits: (B, T, V) over rows whose last `block_width` columns are the block (prefix
    left-padded, block right-padded, so the block starts at the same column in every row), or
    only the last ``block_width + 1`` of them (``logits_to_keep``). Returns (B, N, V) where
    ``[:, i]`` is ``p(. | x, y_<i)``: the last prefix position predicts ``y_0``, and the last
    block position, which points past the block, is dropped (as in the reference).
    """
    if logits.dim() != 3 or logits.shape[1] < block_width + 1:
        raise ValueError(
            f"logits of shape {tuple(logits.shape)} do not cover a block of {block_width} tokens "
            "and the prefix position before it"
        )
    return logits[:, logits.shape[1] - block_width - 1 : -1]


def gc_mask(state: torch.Tensor, fixed_point: torch.Tensor, valid: torch.Tensor,
            window: int | None = None) -> torch.Tensor:
    """(B, N) positions GC counts: from the first one where the state differs from the fixed
    point (the reference). Before it the two inputs agree, so the distance is zero anyway.
    With `window`, only the first `window` positions after that one: the short skips over a
    wrong token that fast-forwarding needs, not the far, near-hopeless ones of junk states."""
    mask = from_first_difference(state, fixed_point, valid)
    if window is not None:
        first = torch.where(mask.any(1), mask.int().argmax(1), mask.shape[1])  # (B,)
        mask = mask & (torch.arange(mask.shape[1], device=mask.device)[None, :] <= first[:, None] + window)
    return mask


def lc_mask(state: torch.Tensor, next_state: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(B, N) positions LC counts: from the first one where state j differs from state j+1."""
    return from_first_difference(state, next_state, valid)


def gc_loss(
    state_logits: torch.Tensor,
    fixed_point_logits: torch.Tensor,
    mask: torch.Tensor,
    *,
    distance: Distance = "fkl",
    normalizer: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Global consistency (eq. 4): D(q_theta-(. | x, y*) || q_theta(. | x, y)).

    state_logits: (B, N, V) block logits of the model on ``prefix + y`` (gradients flow);
    fixed_point_logits: (B, N, V) on ``prefix + y*`` (detached here, whatever the caller did);
    mask: `gc_mask(y, y*, valid)`.
    """
    return consistency_loss(fixed_point_logits, state_logits, mask, distance=distance, normalizer=normalizer)


def lc_loss(
    state_logits: torch.Tensor,
    next_state_logits: torch.Tensor,
    mask: torch.Tensor,
    *,
    distance: Distance = "fkl",
    normalizer: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Local consistency (eq. 5): D(q_theta-(. | x, y^(j+1)) || q_theta(. | x, y^(j))).

    The target is the model's own (detached) prediction on the *next* state of the trajectory,
    not the fixed point: each state learns to jump one Jacobi step ahead of itself.
    mask: `lc_mask(y^(j), y^(j+1), valid)`.
    """
    return consistency_loss(next_state_logits, state_logits, mask, distance=distance, normalizer=normalizer)
