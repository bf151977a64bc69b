"""Training Medusa heads on a frozen model (Medusa-1): self-distillation on its own greedy text.

A training step costs only the heads: their inputs are the model's last hidden states, computed
once (`cllm.training.medusa.texts.hidden_states`); head k at position t learns the model's
next-token distribution at t + k (`cllm.training.medusa.loss.medusa_loss`), computed by the
model's own LM head from the stored state at t + k. Positions count from the prompt's last
token on: there every token ahead is greedy's.

`HeadsTrainer` holds the optimizer state and steps; `train_heads` is the whole loop in one call;
`measure_accuracies` gives the per-rank accuracies a candidate tree is shaped by; `save_heads`
writes heads in `cllm.modeling.heads`' file format (`cllm.models.load_heads` reads them back).
Nothing here prints: callers (`cllm medusa`, tests) log and report.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from cllm.core.errors import UserError
from cllm.core.outputs import replacing, share_like_siblings
from cllm.core.runs import Resumable
from cllm.modeling.heads import CONFIG_FILE, FORMAT_VERSION, WEIGHTS_FILE, MedusaHeads
from cllm.modeling.losses import Distance
from cllm.models import fingerprint
from cllm.training.medusa.loss import agreement, medusa_loss
from cllm.training.medusa.texts import Text, hidden_states
from cllm.training.schedule import warmup_cosine


def pad_batch(states: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden-state runs of different lengths -> (B, T, H) right-padded with zeros, mask (B, T)."""
    T = max(s.shape[0] for s in states)
    hidden = states[0].new_zeros(len(states), T, states[0].shape[1])
    mask = torch.zeros(len(states), T, dtype=torch.bool)
    for r, s in enumerate(states):
        hidden[r, : s.shape[0]], mask[r, : s.shape[0]] = s, True
    return hidden, mask


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


class HeadsTrainer(Resumable):
    """AdamW on the heads alone (the backbone is frozen, its states precomputed), linear
    warm-up then cosine decay; batches drawn from `states` by a seeded generator."""

    STATEFUL = ("heads", "optimizer", "scheduler")

    def __init__(self, heads: MedusaHeads, states: Sequence[torch.Tensor], *, steps: int, batch_size: int = 8,
                 lr: float = 3e-3, weight_decay: float = 0.0, warmup: int = 0, distance: Distance = "fkl",
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
        loss = medusa_loss(head_logits, model_logits, mask, distance=self.distance, weights=self.weights)
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


def train_heads(model: torch.nn.Module, texts: Sequence[Text], *, num_heads: int = 4, own_projection: bool = False,
                steps: int = 200, batch_size: int = 8, lr: float = 3e-3, distance: Distance = "fkl",
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


# ------------------------------------------------------------------------ save


def base_model_meta(model: torch.nn.Module, model_path: str | os.PathLike | None = None) -> dict[str, str]:
    """The fingerprints `cllm.models.load_heads` checks: of the checkpoint folder when the model
    came from one, and of its float32 parameters (for a model given in memory)."""
    meta = {"parameters_fingerprint": fingerprint(model)}
    if model_path is not None:
        meta["model_fingerprint"] = fingerprint(model_path)
    return meta


def save_heads(heads: MedusaHeads, directory: str | os.PathLike) -> Path:
    """Write `heads` (weights, sizes, accuracies, `meta`) to a folder; returns it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in heads.state_dict().items()}
    with replacing(directory / WEIGHTS_FILE) as tmp:
        save_file(state, str(tmp))
    # what the heads are now wins over `meta` (heads loaded from an older file carry its fields there)
    record = {**heads.meta, "format_version": FORMAT_VERSION, "num_heads": heads.num_heads,
              "hidden_size": heads.hidden_size, "vocab_size": heads.vocab_size, "own_projection": heads.own_projection,
              "parameters_added": heads.parameters_added(), "accuracies": heads.accuracies, "tree": heads.tree}
    (directory / CONFIG_FILE).write_text(json.dumps(record, indent=2) + "\n")
    share_like_siblings(directory)  # safetensors writes 0600
    return directory
