"""Greedy autoregressive decoding: the oracle every fast decoder is tested against.

Deliberately plain: one token per row per forward, KV cache, left-padded batches. Works on
token ids only; it knows nothing of tokenizers or chat templates.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from cllm.decoding.argmax import argmax
from cllm.decoding.inputs import eos_set, left_pad, prepare_prompt
from cllm.decoding.stats import DecodeOutput, DecodeStats
from cllm.runtime import Runtime, as_runtime


@torch.inference_mode()
def greedy_decode(
    model: torch.nn.Module | Runtime,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int = 128,
    eos_token_id: int | Iterable[int] | None = None,
) -> DecodeOutput:
    """Greedy decoding, `y_i = argmax p(. | x, y_<i)`, with a KV cache.

    Args:
        model: a causal LM (any transformers `*ForCausalLM`, decoded on its "auto" runtime) or a
            runtime (`cllm.runtime`).
        input_ids: (B, T) prompt token ids, left-padded when rows differ in length.
        attention_mask: (B, T), 0 on the left padding; None means no padding.
        max_new_tokens: at most this many new tokens per row.
        eos_token_id: a row stops after producing it (or any of them); it is included.

    Returns:
        DecodeOutput; `forward_passes` equals the longest row's number of new tokens (the
        prefill produces every row's first token).
    """
    return autoregressive(model, input_ids, attention_mask, max_new_tokens=max_new_tokens,
                          eos_token_id=eos_token_id, choose=lambda logits: argmax(logits).tolist())


def autoregressive(
    model: torch.nn.Module | Runtime,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    max_new_tokens: int,
    eos_token_id: int | Iterable[int] | None,
    choose: Callable[[torch.Tensor], list[int]],
) -> DecodeOutput:
    """One token per row per forward: `choose` maps the last logits (B, V) to the next tokens
    (argmax for greedy decoding, a draw for `sample_decode`)."""
    runtime = as_runtime(model)
    prompt = prepare_prompt(runtime, input_ids, attention_mask, max_new_tokens)
    eos = eos_set(eos_token_id)
    B = prompt.batch_size
    new_tokens: list[list[int]] = [[] for _ in range(B)]
    stats = DecodeStats()
    if max_new_tokens == 0:
        return DecodeOutput(new_tokens=new_tokens, forward_passes=0, stats=stats)

    # 1. prefill: one forward over the prompts gives every row its first token
    session = runtime.session()
    rows, out = session.open(prompt.rows)
    logits = out.logits[:, -1]  # (B, V)
    stats.forward_passes = 1
    active = [True] * B
    while True:
        # 2. record the new token of every row still running (one device sync per step)
        next_ids = choose(logits)
        for r, token in enumerate(next_ids):
            if active[r]:
                new_tokens[r].append(token)
                stats.count(r, 1)
                active[r] = token not in eos and len(new_tokens[r]) < max_new_tokens
        if not any(active):
            break
        # 3. feed it back; finished rows ride along and their outputs are ignored
        logits = session.feed(rows, [[t] for t in next_ids]).logits[:, -1]  # (B, V)
        session.keep(rows, [[0]] * B)
        stats.forward_passes += 1
        stats.fed.append(1)
    session.close(rows)

    stats.new_tokens = sum(len(t) for t in new_tokens)
    return DecodeOutput(new_tokens=new_tokens, forward_passes=stats.forward_passes, stats=stats)


def greedy_completions(
    model: torch.nn.Module | Runtime,
    prompt_ids: list[list[int]],
    *,
    max_new_tokens: int,
    batch_size: int,
    eos_token_id: int | Iterable[int] | None,
    pad_id: int,
    progress: Callable[[int], object] | None = None,
) -> list[list[int]]:
    """Each prompt's greedy continuation, decoded in left-padded batches of similar length
    (the model's own text: draft tables and Medusa heads are built from it). `progress` is
    called with each batch's size."""
    order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    out: list[list[int]] = [[] for _ in prompt_ids]
    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        input_ids, mask = left_pad([prompt_ids[i] for i in batch], pad_id)  # (B, T)
        result = greedy_decode(model, input_ids, mask, max_new_tokens=max_new_tokens,
                               eos_token_id=eos_token_id)
        for i, tokens in zip(batch, result.new_tokens, strict=True):
            out[i] = tokens
        if progress is not None:
            progress(len(batch))
    return out
