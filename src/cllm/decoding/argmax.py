"""The greedy choice every decoder makes on a forward's logits: `argmax`, torch's indices, faster
on CPU logits."""

from __future__ import annotations

import numpy as np
import torch

ARGMAX_BLOCK = 256  # vocabulary entries per block of the blocked argmax
ARGMAX_MIN_TOKENS = 64  # fewer tokens' feature-major logits: numpy's argmax is as fast


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(-1)`: the same indices (a row's first maximum; NaN counting as the largest),
    faster on a CPU, where torch's argmax reads float32 logits many times slower than numpy's
    vectorized one: CPU logits in float32 / float64 go to numpy's. The lean runtime's feature-major logits of many
    tokens, a (B, L, V) view of a (V, B * L) tensor, are reduced in blocks of `ARGMAX_BLOCK`
    vocabulary entries along the contiguous tokens (`amax`), and only the first block holding a
    token's maximum is searched."""
    V = logits.shape[-1]
    M = logits.numel() // max(V, 1)
    if logits.device.type != "cpu" or logits.dtype not in (torch.float32, torch.float64) or logits.requires_grad:
        return logits.argmax(-1)
    by_vocab = logits.reshape(M, V).t()  # (V, M): a view when the logits are feature-major
    if M < ARGMAX_MIN_TOKENS or V % ARGMAX_BLOCK or not by_vocab.is_contiguous():
        return torch.as_tensor(np.argmax(logits.numpy(), axis=-1))
    blocks = by_vocab.view(V // ARGMAX_BLOCK, ARGMAX_BLOCK, M)
    first = blocks.amax(1).argmax(0)  # (M,): per token, the first block holding its maximum
    within = blocks[first, :, torch.arange(M)].argmax(1)  # (M,)
    return (first * ARGMAX_BLOCK + within).view(logits.shape[:-1])
