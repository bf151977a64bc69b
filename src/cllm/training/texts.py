"""The drafters' training text (Medusa-1 and -2 heads, the EAGLE head) and what the frozen
model computes on it once.

The text is the model's own greedy continuations of prompts (`greedy_texts`, or the fixed
points of collected trajectories, `texts_from_trajectories`), so a drafter learns to guess what
greedy decoding will write, which is all that tree verification accepts. The backbone never
changes, so its last hidden states are computed once (`hidden_states`): a training step then
costs only the drafter. `training_texts` is `cllm medusa`'s and `cllm eagle`'s source: decoded
once, kept in the run's folder until the run finishes, read back by a resume.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from cllm.core.errors import UserError
from cllm.core.outputs import replacing
from cllm.core.progress import progress_bar
from cllm.data.prompts import encode_prompts, load_prompts
from cllm.data.trajectories import read_meta, read_records
from cllm.decoding.autoregressive import greedy_completions
from cllm.decoding.inputs import eos_set, left_pad, model_device, position_limit
from cllm.models import fingerprint, pad_token_id
from cllm.runtime import hf
from cllm.training.options import DrafterOptions


@dataclass(frozen=True)
class Text:
    """A prompt and the model's greedy continuation of it (token ids)."""

    prompt: list[int]
    completion: list[int]


def greedy_texts(model: torch.nn.Module, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                 batch_size: int, eos_token_id: int | Iterable[int] | None, pad_id: int,
                 progress: Callable[[int], object] | None = None) -> list[Text]:
    """Each prompt with the model's greedy continuation (batched, left-padded)."""
    prompts = [list(p) for p in prompts]
    outputs = greedy_completions(model, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size,
                                 eos_token_id=eos_token_id, pad_id=pad_id, progress=progress)
    return [Text(p, o) for p, o in zip(prompts, outputs, strict=True)]


def texts_from_trajectories(records: Iterable) -> list[Text]:
    """Per prompt of `cllm collect`'s records, its prompt and the fixed points of all its blocks
    (greedy's continuation, docs/method.md#trajectory-records), in prompt order."""
    last: dict[str, object] = {}
    for r in records:
        if r.prompt_id not in last or r.block_index > last[r.prompt_id].block_index:
            last[r.prompt_id] = r
    ordered = sorted(last.values(), key=lambda r: r.prompt_index)
    return [Text(list(r.prefix_ids[: r.prompt_len]), list(r.prefix_ids[r.prompt_len :]) + list(r.fixed_point))
            for r in ordered]


def training_texts(config: DrafterOptions, model: torch.nn.Module, tokenizer, path: Path, *,
                   command: str = "medusa") -> list[Text]:
    """`cllm medusa`'s and `cllm eagle`'s texts: read back
    from an unfinished run, else decoded from --prompts (or read from the --data trajectories)
    and written to `path` until the run finishes."""
    if path.exists():
        return [Text(**json.loads(line)) for line in path.read_text().splitlines() if line]
    if config.data:
        texts = _trajectory_texts(config)
    else:
        limit, new = position_limit(model), config.max_new_tokens
        if limit:
            new = min(new, limit // 2)  # leave half the context to the prompt
        prompts = encode_prompts(config.prompts, tokenizer, limit=config.max_prompts,
                                 keep=limit - new if limit else None)
        with progress_bar(total=len(prompts), unit="prompt", desc=f"{command}: greedy text") as bar:
            texts = greedy_texts(model, [p.ids for p in prompts], max_new_tokens=new,
                                 batch_size=config.decode_batch_size,
                                 eos_token_id=tokenizer.eos_token_id, pad_id=pad_token_id(tokenizer),
                                 progress=bar.update)
    with replacing(path) as tmp:
        tmp.write_text("".join(json.dumps({"prompt": t.prompt, "completion": t.completion}) + "\n" for t in texts))
    return texts


def check_texts_source(config: DrafterOptions, path: Path) -> None:
    """What `training_texts` will read, checked before the run's folder is claimed: the
    trajectories (collected with this model) or the prompt set, and that it holds more texts than
    --holdout keeps back. A resumed run reads its own texts (`path`)."""
    if path.exists():
        return
    count = len(_trajectory_texts(config)) if config.data else \
        len(load_prompts(config.prompts, limit=config.max_prompts))
    if count <= config.holdout:
        raise UserError(f"{count} texts leave none to train on after --holdout {config.holdout}")


@torch.no_grad()
def probe_lm_head(model: torch.nn.Module) -> None:
    """`hidden_states`' check that the model's logits are its LM head applied to its last hidden
    state, on a few tokens, before anything long (or written) starts."""
    ids = torch.arange(min(8, model.config.vocab_size), device=model_device(model))[None]  # (1, T)
    fwd = hf.forward_hidden(model, ids, torch.ones_like(ids))
    _check_lm_head(model.get_output_embeddings(), fwd, torch.ones_like(ids, dtype=torch.bool))


def _trajectory_texts(config: DrafterOptions) -> list[Text]:
    meta = read_meta(config.data)
    if meta.model_fingerprint != fingerprint(config.model):
        raise UserError(f"the trajectories in {config.data} were collected with another model ({meta.model}): "
                        "their fixed points are not this model's greedy text")
    texts = texts_from_trajectories(read_records(config.data))
    return texts[: config.max_prompts] if config.max_prompts else texts


@torch.no_grad()  # not inference mode: the states are inputs of training steps later
def hidden_states(model: torch.nn.Module, texts: Sequence[Text], *, batch_size: int = 8, pad_id: int = 0,
                  eos_token_id: int | Iterable[int] | None = None,
                  progress: Callable[[int], object] | None = None) -> list[torch.Tensor]:
    """Per text, the frozen model's last hidden states (n, H) at the positions whose guesses the
    heads learn: the prompt's last token and the completion's tokens, except an EOS that ends
    it (nothing after it is ever decoded). On the CPU, in the model's dtype.

    The teacher's distributions are taken later as ``lm_head(hidden)``; the first batch checks
    that this is the model's logits (a model that post-processes them, e.g. soft-capping, is a
    UserError)."""
    eos = eos_set(eos_token_id)
    lm_head, device = model.get_output_embeddings(), model_device(model)
    out: list[torch.Tensor] = []
    for start in range(0, len(texts), batch_size):
        batch = texts[start : start + batch_size]
        ids, mask = left_pad([t.prompt + t.completion for t in batch], pad_id)  # (B, T)
        fwd = hf.forward_hidden(model, ids.to(device), mask.to(device))
        if start == 0:
            _check_lm_head(lm_head, fwd, mask.to(device).bool())
        T = ids.shape[1]
        for r, text in enumerate(batch):
            n = len(text.completion) - (1 if text.completion and text.completion[-1] in eos else 0)
            out.append(fwd.hidden[r, T - len(text.completion) - 1 : T - len(text.completion) + n].to("cpu", copy=True))
        if progress is not None:
            progress(len(batch))
    return out


def _check_lm_head(lm_head: torch.nn.Module, fwd: hf.Forward, mask: torch.Tensor) -> None:
    got, want = lm_head(fwd.hidden)[mask].float(), fwd.logits[mask].float()
    tolerance = (1e-4 if fwd.hidden.dtype == torch.float32 else 2e-2) * (1 + float(want.abs().max()))
    if float((got - want).abs().max()) > tolerance:
        raise UserError("this model's logits are not its LM head applied to the last hidden state "
                        "(soft-capped or scaled logits): Medusa heads cannot be trained on it here")
