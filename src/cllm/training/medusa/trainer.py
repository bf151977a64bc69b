"""Training Medusa heads on a frozen model (Medusa-1): self-distillation on its own greedy text.

A training step costs only the heads: their inputs are the model's last hidden states, computed
once (`cllm.training.texts.hidden_states`); head k at position t learns the model's
next-token distribution at t + k (`cllm.training.medusa.loss.medusa_loss`), computed by the
model's own LM head from the stored state at t + k. Positions count from the prompt's last
token on: there every token ahead is greedy's.

`HeadsTrainer` is Medusa-1's loss on the training skeleton; `train_heads` trains in one call;
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
from cllm.modeling.heads import CONFIG_FILE, FORMAT_VERSION, WEIGHTS_FILE, MedusaHeads
from cllm.modeling.losses import Distance
from cllm.training.drafter import DrafterTrainer, Score
from cllm.training.medusa.loss import agreement, medusa_loss
from cllm.training.texts import Text, hidden_states


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


class HeadsTrainer(DrafterTrainer[torch.Tensor]):
    """Medusa-1 on the skeleton (`cllm.training.drafter.DrafterTrainer`): the items are the frozen
    model's hidden-state runs; a batch's loss is `medusa_loss` of the heads against the model's
    own LM head on the same states."""

    def __init__(self, heads: MedusaHeads, states: Sequence[torch.Tensor], held: Sequence[torch.Tensor] = (), *,
                 steps: int, distance: Distance = "fkl", head_decay: float = 0.8, **optimizer) -> None:
        if not states:
            raise UserError("no training texts for the Medusa heads")
        super().__init__(heads, states, held, steps=steps, **optimizer)
        self.heads, self.distance = heads, distance
        self.weights = [head_decay**k for k in range(heads.num_heads)]  # Medusa's lambda_k

    def score(self, batch: Sequence[torch.Tensor], *, training: bool) -> Score:
        device = self.heads.lm_head.weight.device
        hidden, mask = pad_batch(batch)
        hidden, mask = hidden.to(device), mask.to(device)
        with torch.no_grad():
            model_logits = self.heads.lm_head(hidden)  # (B, T, V): the frozen model's own logits
        head_logits = self.heads(hidden)  # (K, B, T, V)
        loss = medusa_loss(head_logits, model_logits, mask, distance=self.distance, weights=self.weights)
        hits, counts = agreement(head_logits.detach(), model_logits, mask)
        return Score(loss, hits, counts, weight=sum(s.shape[0] for s in batch))

    @property
    def positions(self) -> int:
        return sum(s.shape[0] for s in self.items)


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
    trainer.train_in_memory()
    heads.accuracies = measure_accuracies(heads, states, top_k=top_k)
    return heads.eval()


# ------------------------------------------------------------------------ save


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
