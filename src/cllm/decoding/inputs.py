"""Checking and normalising what the decoders are given (token ids only, no tokenizer).

Every bad input raises ValueError with a one-line message, before any forward pass.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from cllm.runtime import position_limit  # re-exported: what the decoders check prompts against


@dataclass(frozen=True)
class PromptBatch:
    """A validated prompt batch: each row's real (unpadded) prompt tokens."""

    rows: list[list[int]]

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def lengths(self) -> list[int]:
        return [len(r) for r in self.rows]

    def row_tokens(self, row: int) -> torch.Tensor:
        """Row's prompt tokens (T_r,) on the CPU (the "prompt" guess samples them)."""
        return torch.tensor(self.rows[row], dtype=torch.long)


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


def finalize(known: list[int], tokens: Sequence[int], eos: frozenset[int], budget: int) -> tuple[int, bool]:
    """Append a row's newly final `tokens` to its final tokens `known`, cut at the first EOS and
    at its `budget` of new tokens: how many it kept, and whether the row is then done. Every
    decoder finalizes through this."""
    kept, done = cut_final(tokens, eos, budget - len(known))
    known += tokens[:kept]
    return kept, done


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
    runtime,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    max_new_tokens: int,
) -> PromptBatch:
    """Validate the shared arguments of the decoders (`runtime`: a runtime, or a model, for its
    position limit) and take each row's real prompt tokens."""
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
    mask = attention_mask.long().cpu()
    if bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError("attention_mask must contain only 0 and 1")
    lengths = mask.sum(dim=1).tolist()
    if min(lengths) == 0:
        raise ValueError(f"empty prompt: row {lengths.index(0)} of attention_mask is all zeros")
    if bool((mask[:, 1:] < mask[:, :-1]).any()):
        raise ValueError("attention_mask must be left-padded (zeros only before a row's tokens)")
    limit = position_limit(runtime)
    if limit is not None and max(lengths) + max_new_tokens > limit:
        raise ValueError(
            f"prompt length {max(lengths)} + max_new_tokens {max_new_tokens} exceeds the model's "
            f"position limit {limit}"
        )
    ids = input_ids.long().cpu().tolist()
    return PromptBatch(rows=[row[T - n :] for row, n in zip(ids, lengths, strict=True)])
