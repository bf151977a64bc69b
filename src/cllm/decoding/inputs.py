"""Checking and normalising what the decoders are given (token ids only, no tokenizer).

Every bad input raises ValueError with a one-line message, before any forward pass.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PromptBatch:
    """A validated, left-padded prompt batch on the model's device."""

    input_ids: torch.Tensor  # (B, T) long
    attention_mask: torch.Tensor  # (B, T) long, 0 = left padding
    lengths: list[int]  # per row: real (unpadded) prompt tokens

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    def row_tokens(self, row: int) -> torch.Tensor:
        """Row's unpadded prompt tokens (T_r,), on the model's device."""
        return self.input_ids[row, self.input_ids.shape[1] - self.lengths[row] :]


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id rows of different lengths -> left-padded input_ids and attention_mask (B, T)."""
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # (B, T)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)  # (B, T)
    for i, r in enumerate(rows):
        input_ids[i, width - len(r) :] = torch.tensor(r)
        attention_mask[i, width - len(r) :] = 1
    return input_ids, attention_mask


def model_device(model: torch.nn.Module) -> torch.device:
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    return next(model.parameters()).device


def position_limit(model: torch.nn.Module) -> int | None:
    """The longest sequence the model's position embeddings cover, when its config says."""
    config = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions"):
        limit = getattr(config, name, None)
        if isinstance(limit, int) and limit > 0:
            return limit
    return None


def eos_set(eos_token_id: int | Iterable[int] | None) -> frozenset[int]:
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, int):
        return frozenset([eos_token_id])
    return frozenset(int(t) for t in eos_token_id)


def cut_final(tokens: Sequence[int], eos: frozenset[int], room: int) -> tuple[int, bool]:
    """How many of a row's newly final `tokens` (in order) it keeps with `room` tokens of budget
    left: up to and including the first EOS, at most `room`; and whether the row is then done."""
    n = min(len(tokens), room)
    for i in range(n):
        if tokens[i] in eos:
            return i + 1, True
    return n, n == room


def row_generators(
    generator: torch.Generator | Sequence[torch.Generator] | None, batch_size: int
) -> list[torch.Generator | None]:
    """One generator per row: None (torch's global RNG), one shared, or one per row (a row's
    draws then do not depend on its batch mates)."""
    if generator is None or isinstance(generator, torch.Generator):
        return [generator] * batch_size
    generators = list(generator)
    if len(generators) != batch_size or not all(isinstance(g, torch.Generator) for g in generators):
        raise ValueError(
            f"generator must be None, a torch.Generator or a list of {batch_size} of them"
        )
    return generators


def prepare_prompt(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    max_new_tokens: int,
) -> PromptBatch:
    """Validate the shared arguments of greedy_decode / jacobi_decode and move them to the model."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError("input_ids must be a (batch, time) tensor of token ids")
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    B, T = input_ids.shape
    if B == 0 or T == 0:
        raise ValueError(f"empty prompt: input_ids has shape {tuple(input_ids.shape)}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(input_ids.shape)}"
        )
    mask = attention_mask.long()
    if bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError("attention_mask must contain only 0 and 1")
    lengths = mask.sum(dim=1).tolist()
    if min(lengths) == 0:
        raise ValueError(f"empty prompt: row {lengths.index(0)} of attention_mask is all zeros")
    if bool((mask[:, 1:] < mask[:, :-1]).any()):
        raise ValueError("attention_mask must be left-padded (zeros only before a row's tokens)")
    limit = position_limit(model)
    if limit is not None and max(lengths) + max_new_tokens > limit:
        raise ValueError(
            f"prompt length {max(lengths)} + max_new_tokens {max_new_tokens} exceeds the model's "
            f"position limit {limit}"
        )
    device = model_device(model)
    return PromptBatch(
        input_ids=input_ids.long().to(device), attention_mask=mask.to(device), lengths=lengths
    )
