"""Decoding held-out prompts: what `cllm train` measures during training and the gates compare.

`heldout_prompts` encodes a prompt set to fit the model; `decode_prompts` decodes it greedily or
with plain Jacobi (seeded guesses, batches left-padded); `evaluate_heldout` gives the figures a
training run logs: Jacobi tokens per forward (over all completions and over those that do not
loop), loop and degenerate rates, Jacobi == greedy, and the AR validation loss on references.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from cllm.core.errors import UserError
from cllm.core.seeds import derived_seed
from cllm.data.prompts import Prompt, encode_prompts
from cllm.decoding import greedy_decode, jacobi_decode
from cllm.evaluation.lm_loss import lm_loss
from cllm.evaluation.text import ends_in_loop, is_degenerate, strip_eos
from cllm.modeling.forwards import rows_from_lists


def heldout_prompts(name: str, tokenizer, *, count: int, max_new_tokens: int, context: int | None,
                    spread: bool = False, text_field: str = "prompt") -> list[Prompt]:
    """`count` prompts of a set (the first ones, or spread evenly over it), each cut from the left
    so that it and `max_new_tokens` fit `context`; references cut to `max_new_tokens`."""
    keep = (context - max_new_tokens) if context else None
    if keep is not None and keep < 1:
        raise UserError(f"{max_new_tokens} new tokens leave no room for a prompt in {context} positions")
    return encode_prompts(name, tokenizer, limit=count, keep=keep, reference_tokens=max_new_tokens,
                          spread=spread, text_field=text_field)


@dataclass(frozen=True)
class DecodeResult:
    new_tokens: list[list[int]]  # per prompt
    forwards: list[int]  # per prompt: the forward passes its row took part in, prefill included

    @property
    def row_forwards(self) -> int:
        return sum(self.forwards)

    @property
    def tokens_per_forward(self) -> float:
        return sum(map(len, self.new_tokens)) / max(self.row_forwards, 1)


@torch.no_grad()
def decode_prompts(model, prompts: Sequence[Prompt], *, method: Literal["jacobi", "greedy"],
                   block_size: int = 16, max_new_tokens: int = 64, batch_size: int = 8,
                   eos_token_id=None, pad_id: int = 0, seed: int = 0) -> DecodeResult:
    """Decode every prompt (left-padded batches); Jacobi guesses are seeded per prompt, so the
    result does not depend on the batch size."""
    device = next(model.parameters()).device
    new_tokens, forwards = [], []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        rows = rows_from_lists([p.ids for p in chunk], [[]] * len(chunk), pad_id)
        ids, mask = rows.prefix_ids.to(device), rows.prefix_mask.to(device)
        if method == "jacobi":
            generators = [torch.Generator().manual_seed(derived_seed(seed, "guess", start + i))
                          for i in range(len(chunk))]
            out = jacobi_decode(model, ids, mask, block_size=block_size, max_new_tokens=max_new_tokens,
                                eos_token_id=eos_token_id, generator=generators)
        else:
            out = greedy_decode(model, ids, mask, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)
        new_tokens += out.new_tokens
        forwards += out.stats.forwards_per_row(len(chunk))
    return DecodeResult(new_tokens, forwards)


def reference_loss(model, prompts: Sequence[Prompt], *, batch_size: int = 8, pad_id: int = 0,
                   bf16: bool = False) -> float | None:
    """The AR validation loss: nats/token of the prompts' references after them (None when no
    prompt has a reference)."""
    return lm_loss(model, [p.ids for p in prompts], [p.reference for p in prompts], batch_size=batch_size,
                   pad_id=pad_id, bf16=bf16)


def tokens_per_forward_not_looping(decoded: DecodeResult, looping: Sequence[bool]) -> float | None:
    """Tokens per forward over the completions that do not end in a loop (decoding a loop
    converges fast, so speed measured on loops flatters a model that loops more)."""
    kept = [(len(t), f) for t, f, loops in zip(decoded.new_tokens, decoded.forwards, looping, strict=True)
            if not loops]
    return sum(t for t, _ in kept) / sum(f for _, f in kept) if kept else None


def evaluate_heldout(model, prompts: Sequence[Prompt], *, block_size: int, max_new_tokens: int,
                     batch_size: int, eos_token_id, pad_id: int, bf16: bool = False, seed: int = 0) -> dict:
    """Jacobi tokens per forward (greedy, docs/method.md#counting), over all prompts and over those
    whose completion does not end in a loop; how often the greedy completions loop or
    degenerate (`cllm.evaluation.text`); Jacobi == greedy; and the AR validation loss."""
    was_training = model.training
    model.eval()
    device_type = "cuda" if next(model.parameters()).is_cuda else "cpu"
    common = dict(max_new_tokens=max_new_tokens, batch_size=batch_size, eos_token_id=eos_token_id,
                  pad_id=pad_id, seed=seed)
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16):
        decoded = decode_prompts(model, prompts, method="jacobi", block_size=block_size, **common)
        greedy = decode_prompts(model, prompts, method="greedy", **common)
    ar = reference_loss(model, prompts, batch_size=batch_size, pad_id=pad_id, bf16=bf16)
    model.train(was_training)
    eos = eos_token_id if isinstance(eos_token_id, int) else None
    texts = [strip_eos(t, eos)[0] for t in greedy.new_tokens]
    looping = [ends_in_loop(t) for t in texts]
    n = max(len(texts), 1)
    return {"tokens_per_forward": decoded.tokens_per_forward,
            "tokens_per_forward_not_looping": tokens_per_forward_not_looping(decoded, looping),
            "looping_rate": sum(looping) / n, "degenerate_rate": sum(map(is_degenerate, texts)) / n,
            "jacobi_equals_greedy": sum(a == b for a, b in zip(decoded.new_tokens, greedy.new_tokens, strict=True)) / n,
            "ar_loss": ar}
