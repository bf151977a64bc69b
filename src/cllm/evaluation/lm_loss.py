"""The one held-out language-model loss: mean next-token cross-entropy (nats/token) of
continuations after their prompts. Every held-out loss here is this function: the AR validation
loss on prompts' references, the target's NLL of a model's greedy completions, and the loss on
windows of a text (a window's first token is the context of the rest)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cllm.data.corpus import load_corpus
from cllm.data.tokenizer import token_stream
from cllm.decoding.inputs import position_limit
from cllm.modeling import losses
from cllm.modeling.forwards import forward_blocks, rows_from_lists
from cllm.runtime.hf import accepts_logits_to_keep

MAX_WINDOW = 1024  # text windows are at most this many tokens (and at most the model's context)


@torch.no_grad()
def lm_loss(model, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]], *,
            batch_size: int = 8, pad_id: int = 0, bf16: bool = False) -> float | None:
    """Mean nats/token `model` assigns to each continuation after its prompt, every token pooled;
    None when there is no continuation token. The model is evaluated in eval mode (dropout off)
    and left as it was."""
    pairs = [(p, c) for p, c in zip(prompts, continuations, strict=True) if len(c)]
    keep = accepts_logits_to_keep(model)
    device_type = "cuda" if next(model.parameters()).is_cuda else "cpu"
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        rows = rows_from_lists([p for p, _ in chunk], [c for _, c in chunk], pad_id)
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16):
            logits = forward_blocks(model, rows, logits_to_keep=keep).float()  # (B, N, V)
        mask = rows.block_mask.bool().to(logits.device)
        total += float(losses.ar_loss(logits, rows.block_ids.to(logits.device), mask, normalizer=1))
        count += int(mask.sum())
    model.train(was_training)
    return total / count if count else None


def text_loss(model, windows: torch.Tensor, *, batch_size: int = 8, bf16: bool = False) -> float:
    """Mean nats/token over (N, T + 1) windows of a token stream: each window's first token is
    the context of its other T."""
    return lm_loss(model, windows[:, :1].tolist(), windows[:, 1:].tolist(), batch_size=batch_size, bf16=bf16)


def stream_windows(stream: torch.Tensor, context: int) -> torch.Tensor:
    """(n, context + 1) consecutive windows covering the stream, each sharing its last token
    with the next one's first (so every token after the first is predicted once)."""
    n = (len(stream) - 1) // context
    return stream[(torch.arange(n) * context)[:, None] + torch.arange(context + 1)]


def validation_loss(model, tokenizer, *, batch_size: int = 8) -> tuple[float, int]:
    """Mean nats/token over the whole validation split of the embedded stdlib corpus, in windows
    of the model's context (at most `MAX_WINDOW`); returns it and the split's token count."""
    stream = token_stream(load_corpus("validation"), tokenizer)
    context = min(position_limit(model) or MAX_WINDOW, MAX_WINDOW) - 1
    return text_loss(model, stream_windows(stream, context), batch_size=batch_size), len(stream)
