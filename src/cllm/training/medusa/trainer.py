"""Training Medusa heads on a frozen model (Medusa-1): self-distillation on its own greedy text.

The data is the model's own greedy continuations of prompts (`greedy_texts`, or the fixed
points of collected trajectories, `texts_from_trajectories`), so the heads learn to guess what
greedy decoding will write, which is all that tree verification accepts. The backbone never
changes, so its last hidden states are computed once (`hidden_states`); a training step then
costs only the heads: head k at position t learns the model's next-token distribution at t + k
(`cllm.modeling.losses.medusa_loss`), computed by the model's own LM head from the stored state at
t + k. Positions count from the prompt's last token on: there every token ahead is greedy's.

`HeadsTrainer` holds the optimizer state and steps; `train_heads` is the whole loop in one call.
Nothing here prints: callers (`cllm medusa`, tests) log and report.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from cllm.core.errors import UserError
from cllm.decoding import cache as kv
from cllm.decoding.autoregressive import greedy_completions
from cllm.decoding.inputs import eos_set, left_pad, model_device
from cllm.modeling import losses
from cllm.modeling.heads import MedusaHeads
from cllm.training.schedule import warmup_cosine


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
        fwd = kv.forward_hidden(model, ids.to(device), mask.to(device))
        if start == 0:
            _check_lm_head(lm_head, fwd, mask.to(device).bool())
        T = ids.shape[1]
        for r, text in enumerate(batch):
            n = len(text.completion) - (1 if text.completion and text.completion[-1] in eos else 0)
            out.append(fwd.hidden[r, T - len(text.completion) - 1 : T - len(text.completion) + n].to("cpu", copy=True))
        if progress is not None:
            progress(len(batch))
    return out


def _check_lm_head(lm_head: torch.nn.Module, fwd: kv.Forward, mask: torch.Tensor) -> None:
    got, want = lm_head(fwd.hidden)[mask].float(), fwd.logits[mask].float()
    tolerance = (1e-4 if fwd.hidden.dtype == torch.float32 else 2e-2) * (1 + float(want.abs().max()))
    if float((got - want).abs().max()) > tolerance:
        raise UserError("this model's logits are not its LM head applied to the last hidden state "
                        "(soft-capped or scaled logits): Medusa heads cannot be trained on it here")


def pad_batch(states: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden-state runs of different lengths -> (B, T, H) right-padded with zeros, mask (B, T)."""
    T = max(s.shape[0] for s in states)
    hidden = states[0].new_zeros(len(states), T, states[0].shape[1])
    mask = torch.zeros(len(states), T, dtype=torch.bool)
    for r, s in enumerate(states):
        hidden[r, : s.shape[0]], mask[r, : s.shape[0]] = s, True
    return hidden, mask


def agreement(head_logits: torch.Tensor, model_logits: torch.Tensor,
              mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head k: at how many counted positions t its top-1 token is the model's greedy token at
    t + k (the token k + 1 ahead), and how many positions counted. (K,), (K,)."""
    K, _, T, _ = head_logits.shape
    greedy = model_logits.argmax(-1)  # (B, T)
    hits, counts = [], []
    for k in range(1, K + 1):
        counted = mask[:, : T - k] & mask[:, k:]
        hits.append(((head_logits[k - 1, :, : T - k].argmax(-1) == greedy[:, k:]) & counted).sum())
        counts.append(counted.sum())
    return torch.stack(hits), torch.stack(counts)


@torch.inference_mode()
def measure_accuracies(heads: MedusaHeads, states: Sequence[torch.Tensor], *, top_k: int = 8,
                       batch_size: int = 8) -> list[list[float]]:
    """``acc[k-1][r]``: the share of positions where head k's rank-r token is the model's greedy
    token k + 1 ahead, r < top_k: what `cllm.decoding.rivals.medusa.build_tree` shapes a tree by."""
    device = heads.lm_head.weight.device
    K = heads.num_heads
    ranks = torch.zeros(K, top_k)
    counts = torch.zeros(K)
    for start in range(0, len(states), batch_size):
        hidden, mask = pad_batch(states[start : start + batch_size])
        hidden, mask = hidden.to(device), mask.to(device)
        greedy = heads.lm_head(hidden).argmax(-1)  # (B, T)
        logits = heads(hidden)  # (K, B, T, V)
        T = mask.shape[1]
        for k in range(1, K + 1):
            counted = mask[:, : T - k] & mask[:, k:]
            head = logits[k - 1, :, : T - k][counted]  # (n, V)
            target = greedy[:, k:][counted]  # (n,)
            rank = (head > head.gather(-1, target[:, None])).sum(-1)  # (n,) how many tokens beat it
            ranks[k - 1] += torch.bincount(rank.clamp(max=top_k).cpu(), minlength=top_k + 1)[:top_k].float()
            counts[k - 1] += counted.sum().cpu()
    return (ranks / counts.clamp(min=1)[:, None]).tolist()


class HeadsTrainer:
    """AdamW on the heads alone (the backbone is frozen, its states precomputed), linear
    warm-up then cosine decay; batches drawn from `states` by a seeded generator."""

    def __init__(self, heads: MedusaHeads, states: Sequence[torch.Tensor], *, steps: int, batch_size: int = 8,
                 lr: float = 3e-3, weight_decay: float = 0.0, warmup: int = 0, distance: losses.Distance = "fkl",
                 head_decay: float = 0.8, seed: int = 0) -> None:
        if not states:
            raise UserError("no training texts for the Medusa heads")
        self.heads, self.states, self.steps, self.batch_size = heads, list(states), steps, batch_size
        self.distance = distance
        self.weights = [head_decay**k for k in range(heads.num_heads)]  # Medusa's lambda_k
        self.optimizer = torch.optim.AdamW([p for p in heads.parameters() if p.requires_grad], lr=lr,
                                           weight_decay=weight_decay)
        warmup = min(warmup, steps)
        self.scheduler = warmup_cosine(self.optimizer, steps, warmup)
        self.generator = torch.Generator().manual_seed(seed)
        self.step_index = 0

    def _forward(self, states: Sequence[torch.Tensor]):
        device = self.heads.lm_head.weight.device
        hidden, mask = pad_batch(states)
        hidden, mask = hidden.to(device), mask.to(device)
        with torch.no_grad():
            model_logits = self.heads.lm_head(hidden)  # (B, T, V): the frozen model's own logits
        head_logits = self.heads(hidden)  # (K, B, T, V)
        loss = losses.medusa_loss(head_logits, model_logits, mask, distance=self.distance, weights=self.weights)
        return loss, agreement(head_logits.detach(), model_logits, mask)

    def step(self) -> dict:
        """One optimizer step on a random batch; returns its loss, per-head top-1 agreement, lr."""
        self.heads.train()
        pick = torch.randint(len(self.states), (self.batch_size,), generator=self.generator).tolist()
        loss, (hits, counts) = self._forward([self.states[i] for i in pick])
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        self.step_index += 1
        return {"step": self.step_index, "loss": loss.item(), "lr": self.scheduler.get_last_lr()[0],
                "agreement": (hits / counts.clamp(min=1)).tolist()}

    @torch.no_grad()
    def evaluate(self, states: Sequence[torch.Tensor]) -> dict:
        """Mean loss per position and per-head top-1 agreement on held-out states."""
        self.heads.eval()
        total, positions = 0.0, 0
        hits = counts = 0
        for start in range(0, len(states), self.batch_size):
            chunk = states[start : start + self.batch_size]
            loss, (h, c) = self._forward(chunk)
            n = sum(s.shape[0] for s in chunk)
            total, positions = total + float(loss) * n, positions + n
            hits, counts = hits + h, counts + c
        return {"loss": total / max(positions, 1), "agreement": (hits / counts.clamp(min=1)).tolist()}

    def state_dict(self) -> dict:
        return {"heads": self.heads.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "generator": self.generator.get_state(),
                "step": self.step_index}

    def load_state_dict(self, state: dict) -> None:
        self.heads.load_state_dict(state["heads"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.generator.set_state(state["generator"])
        self.step_index = state["step"]


def train_heads(model: torch.nn.Module, texts: Sequence[Text], *, num_heads: int = 4, own_projection: bool = False,
                steps: int = 200, batch_size: int = 8, lr: float = 3e-3, distance: losses.Distance = "fkl",
                eos_token_id: int | Iterable[int] | None = None, pad_id: int = 0, top_k: int = 8,
                seed: int = 0) -> MedusaHeads:
    """Fresh heads for `model` trained on `texts` (its greedy output), with their accuracies
    measured on the same texts; the model is left frozen and unchanged. For scripts and tests:
    `cllm medusa` adds held-out measurement, logs, checkpoints and an evaluation."""
    model.requires_grad_(False)
    heads = MedusaHeads.for_model(model, num_heads=num_heads, own_projection=own_projection)
    states = hidden_states(model, texts, pad_id=pad_id, eos_token_id=eos_token_id)
    trainer = HeadsTrainer(heads, states, steps=steps, batch_size=batch_size, lr=lr, distance=distance, seed=seed)
    for _ in range(steps):
        trainer.step()
    heads.accuracies = measure_accuracies(heads, states, top_k=top_k)
    return heads.eval()


@torch.inference_mode()
def evaluate_heads(model: torch.nn.Module, heads: MedusaHeads, prompts: Sequence[Sequence[int]], *,
                   max_new_tokens: int, eos_token_id: int | Iterable[int] | None = None,
                   tree: int | Sequence[Sequence[int]] | None = None,
                   progress: Callable[[int], object] | None = None) -> dict:
    """Greedy and Medusa decoding of each prompt (batch 1): whether Medusa wrote greedy's tokens,
    tokens per forward (all prompts pooled, docs/method.md#counting), the accepted histogram, and
    wall-clock tokens per second of both."""
    from cllm.decoding import greedy_decode
    from cllm.decoding.rivals.medusa import medusa_decode

    device = model_device(model)
    tokens = forwards = exact = greedy_tokens = 0
    seconds = {"greedy": 0.0, "medusa": 0.0}
    histogram: dict[int, int] = {}
    mismatches = []
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([list(prompt)], device=device)
        started = time.perf_counter()
        expected = greedy_decode(model, ids, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id).new_tokens[0]
        seconds["greedy"] += time.perf_counter() - started
        started = time.perf_counter()
        out = medusa_decode(model, heads, ids, tree=tree, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)
        seconds["medusa"] += time.perf_counter() - started
        got = out.new_tokens[0]
        if got == expected:
            exact += 1
        else:
            first = next((j for j, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b),
                         min(len(got), len(expected)))
            mismatches.append({"prompt": i, "first_difference": first})
        tokens, forwards, greedy_tokens = (tokens + len(got), forwards + out.forward_passes,
                                           greedy_tokens + len(expected))
        for n, c in out.stats.accepted_histogram().items():
            histogram[n] = histogram.get(n, 0) + c
        if progress is not None:
            progress(1)
    made = {"greedy": greedy_tokens, "medusa": tokens}
    return {"prompts": len(prompts), "exact": exact, "mismatches": mismatches, "new_tokens": tokens,
            "forward_passes": forwards, "tokens_per_forward": tokens / max(forwards, 1),
            "accepted_histogram": {str(k): v for k, v in sorted(histogram.items())},
            "seconds": seconds, "tokens_per_second": {k: made[k] / v if v else None for k, v in seconds.items()},
            "speedup_vs_greedy": seconds["greedy"] / seconds["medusa"] if seconds["medusa"] else None}
