"""Jacobi decoding from transformers' own `model.generate(...)`.

transformers (4.57+) takes a decoding loop as `generate(..., custom_generate=callable)`: it
prepares the inputs, the generation config and the stopping length as usual, then hands the
loop to the callable. `jacobi_generate` is such a loop: it runs `cllm.jacobi_decode` and returns
what greedy `generate` returns, a (B, T + new) LongTensor with the rows that stopped early padded
with the pad token, token for token the same (float32):

    from cllm import RECOMMENDED
    from cllm.serving.hf_generate import jacobi_generate

    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=64, do_sample=False,
                         custom_generate=jacobi_generate)                  # plain Jacobi, n = 16
    out = model.generate(input_ids, max_new_tokens=64, custom_generate=jacobi_generate,
                         **RECOMMENDED, draft_table=table)                  # the CLI's setting

The engine's options (`block_size`, `recycle`, ..., `draft_table`) go to `generate` as keyword
arguments (transformers passes a callable's own parameters through). Only greedy decoding
without logits processors is served (what Jacobi decoding reproduces exactly); sampling,
beams, repetition penalties and the like are refused with a ValueError rather than ignored,
and so are `streamer` and `return_dict_in_generate`. For sampling use `cllm.jacobi_decode(...,
temperature=...)` directly.
"""

from __future__ import annotations

from typing import Any

import torch

from cllm.decoding import jacobi_decode


def jacobi_generate(
    model: torch.nn.Module,
    input_ids: torch.LongTensor,
    logits_processor=None,
    stopping_criteria=None,
    generation_config=None,
    synced_gpus: bool = False,
    streamer=None,
    *,
    block_size: int = 16,
    recycle: int = 0,
    recycle_width: int = 16,
    recycle_min_ngram: int = 2,
    recycle_budget: int | None = 24,
    blocks_in_flight: int = 1,
    exact: bool = True,
    adaptive: bool = False,
    draft_table=None,
    guess: str = "prompt",
    **model_kwargs: Any,
) -> torch.LongTensor:
    """A `custom_generate` decoding loop: greedy Jacobi decoding (see the module docstring)."""
    cfg = generation_config
    if cfg.do_sample or (cfg.num_beams or 1) > 1 or logits_processor:
        raise ValueError("jacobi_generate decodes greedily with no logits processors (do_sample=False, "
                         "num_beams=1, no repetition penalty ...): use cllm.jacobi_decode to sample")
    if streamer is not None or cfg.return_dict_in_generate:
        raise ValueError("jacobi_generate returns the sequences tensor; it has no streamer or dict output")
    new = cfg.max_length - input_ids.shape[1]
    mask = model_kwargs.get("attention_mask")
    out = jacobi_decode(model, input_ids, mask, block_size=block_size, max_new_tokens=max(new, 0),
                        eos_token_id=cfg.eos_token_id, guess=guess, recycle=recycle, recycle_width=recycle_width,
                        recycle_min_ngram=recycle_min_ngram, recycle_budget=recycle_budget,
                        blocks_in_flight=blocks_in_flight, exact=exact, adaptive=adaptive, draft_table=draft_table)
    width = max(map(len, out.new_tokens))
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    tail = torch.full((input_ids.shape[0], width), pad, dtype=input_ids.dtype, device=input_ids.device)
    for r, tokens in enumerate(out.new_tokens):
        tail[r, : len(tokens)] = torch.tensor(tokens, dtype=input_ids.dtype)
    return torch.cat([input_ids, tail], dim=1)
