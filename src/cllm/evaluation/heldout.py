"""Evaluation on held-out prompts: Jacobi tokens per forward, exactness, AR validation loss.
Used by `cllm train` during training and by `cllm distill` after it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from cllm.core.errors import UserError
from cllm.core.seeds import derived_seed
from cllm.decoding.cache import accepts_logits_to_keep
from cllm.modeling import losses
from cllm.modeling.forwards import forward_blocks, rows_from_lists


@dataclass(frozen=True)
class EvalPrompt:
    ids: list[int]  # the prompt, as the target's tokenizer encodes it
    reference: list[int]  # ground-truth continuation (first max_new_tokens tokens; may be empty)


def load_eval_prompts(name: str, tokenizer, *, count: int, max_new_tokens: int, context: int | None,
                      text_field: str = "prompt") -> list[EvalPrompt]:
    """The first `count` prompts of a prompt set, tokenized; cut from the left to fit `context`."""
    from cllm.data.prompts import load_prompts, prompt_ids

    keep = (context - max_new_tokens) if context else None
    if keep is not None and keep < 1:
        raise UserError(f"eval-max-new-tokens {max_new_tokens} leaves no room for a prompt in {context} positions")
    out = []
    for p in load_prompts(name, text_field=text_field, limit=count):
        ids = prompt_ids(tokenizer, p.text, keep=keep)
        reference = tokenizer(p.reference, add_special_tokens=False)["input_ids"] if p.reference else []
        if ids:
            out.append(EvalPrompt(list(ids), list(reference[:max_new_tokens])))
    return out


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
def decode_prompts(model, prompts: Sequence[EvalPrompt], *, method: Literal["jacobi", "greedy"],
                   block_size: int = 16, max_new_tokens: int = 64, batch_size: int = 8,
                   eos_token_id=None, pad_id: int = 0, seed: int = 0) -> DecodeResult:
    """Decode every prompt (left-padded batches); Jacobi guesses are seeded per prompt, so the
    result does not depend on the batch size."""
    from cllm.decoding import greedy_decode, jacobi_decode

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


@torch.no_grad()
def ar_validation_loss(model, prompts: Sequence[EvalPrompt], *, batch_size: int = 8, pad_id: int = 0,
                       logits_to_keep: bool = True) -> float | None:
    """Mean next-token cross-entropy (nats/token) on the references after their prompts."""
    scored = [p for p in prompts if p.reference]
    total, count = 0.0, 0
    for start in range(0, len(scored), batch_size):
        chunk = scored[start : start + batch_size]
        rows = rows_from_lists([p.ids for p in chunk], [p.reference for p in chunk], pad_id)
        logits = forward_blocks(model, rows, logits_to_keep=logits_to_keep).float()
        mask = rows.block_mask.bool().to(logits.device)
        total += float(losses.ar_loss(logits, rows.block_ids.to(logits.device), mask, normalizer=1))
        count += int(mask.sum())
    return total / count if count else None


def evaluate(model, prompts: Sequence[EvalPrompt], *, block_size: int, max_new_tokens: int,
             batch_size: int, eos_token_id, pad_id: int, bf16: bool = False, seed: int = 0) -> dict:
    """Jacobi tokens per forward (greedy, docs/method.md#counting), over all prompts and over those
    whose completion does not end in a loop; how often the greedy completions loop or
    degenerate (`cllm.evaluation.quality`); Jacobi == greedy; and the AR validation loss."""
    from cllm.evaluation.quality import ends_in_loop, is_degenerate, strip_eos

    was_training = model.training
    model.eval()
    device_type = "cuda" if next(model.parameters()).is_cuda else "cpu"
    common = dict(max_new_tokens=max_new_tokens, batch_size=batch_size, eos_token_id=eos_token_id,
                  pad_id=pad_id, seed=seed)
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16):
        decoded = decode_prompts(model, prompts, method="jacobi", block_size=block_size, **common)
        greedy = decode_prompts(model, prompts, method="greedy", **common)
        ar = ar_validation_loss(model, prompts, batch_size=batch_size, pad_id=pad_id,
                                logits_to_keep=accepts_logits_to_keep(model))
    model.train(was_training)
    eos = eos_token_id if isinstance(eos_token_id, int) else None
    texts = [strip_eos(t, eos)[0] for t in greedy.new_tokens]
    looping = [ends_in_loop(t) for t in texts]
    kept = [(len(t), f) for t, f, loops in zip(decoded.new_tokens, decoded.forwards, looping, strict=True)
            if not loops]
    n = max(len(texts), 1)
    return {"tokens_per_forward": decoded.tokens_per_forward,
            "tokens_per_forward_not_looping": sum(t for t, _ in kept) / sum(f for _, f in kept) if kept else None,
            "looping_rate": sum(looping) / n, "degenerate_rate": sum(map(is_degenerate, texts)) / n,
            "jacobi_equals_greedy": sum(a == b for a, b in zip(decoded.new_tokens, greedy.new_tokens, strict=True)) / n,
            "ar_loss": ar}
