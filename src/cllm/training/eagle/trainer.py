"""Training an EAGLE head on a frozen model: teacher forcing on its own greedy text.

The target never changes, so its features (last hidden states) on the training text are
computed once (`feature_runs`, reusing Medusa's `hidden_states`); a step then costs only the
head and the LM head. At every position t the head reads the TRUE feature f_t (plus EAGLE's
uniform noise) and the token x_{t+1}, and learns f_{t+1} (`cllm.training.eagle.loss`).

`EagleTrainer` holds the optimizer state and steps; `train_eagle` is the whole loop in one call
(scripts, tests); `save_eagle` writes a head in `cllm.modeling.eagle`'s file format
(`cllm.models.load_eagle` reads it back). Nothing here prints.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from cllm.core.errors import UserError
from cllm.core.outputs import replacing, share_like_siblings
from cllm.core.runs import Resumable
from cllm.modeling.eagle import CONFIG_FILE, DRAFT_CONFIG_FILE, FORMAT_VERSION, WEIGHTS_FILE, EagleHead
from cllm.training.eagle.loss import eagle_loss
from cllm.training.medusa.texts import Text, hidden_states
from cllm.training.schedule import warmup_cosine


@dataclass(frozen=True)
class FeatureRun:
    """One text as the head trains on it: the target's features f_0 .. f_{n-1} (n, H) and the
    tokens x_1 .. x_{n-1} (n - 1,): input t is (f_t, x_{t+1}), its target f_{t+1}."""

    features: torch.Tensor
    next_tokens: torch.Tensor


def feature_runs(model: torch.nn.Module, texts: Sequence[Text], *, pad_id: int = 0,
                 eos_token_id: int | Iterable[int] | None = None, progress=None) -> list[FeatureRun]:
    """The frozen model's features at every position of each text (prompt and completion; not
    after a final EOS). Medusa's `hidden_states` starts at the prompt's last token, so each text
    is handed to it with a one-token prompt."""
    whole = [Text(t.prompt[:1], t.prompt[1:] + t.completion) for t in texts]
    states = hidden_states(model, whole, pad_id=pad_id, eos_token_id=eos_token_id, progress=progress)
    runs = []
    for text, s in zip(whole, states, strict=True):
        ids = text.prompt + text.completion
        if s.shape[0] >= 2:
            runs.append(FeatureRun(s, torch.tensor(ids[1 : s.shape[0]])))
    return runs


def pad_runs(runs: Sequence[FeatureRun]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Runs -> features (B, T, H) right-padded with zeros, next tokens (B, T - 1), mask (B, T - 1)
    of the counted inputs."""
    T = max(r.features.shape[0] for r in runs)
    features = runs[0].features.new_zeros(len(runs), T, runs[0].features.shape[1])
    tokens = torch.zeros(len(runs), T - 1, dtype=torch.long)
    mask = torch.zeros(len(runs), T - 1, dtype=torch.bool)
    for r, run in enumerate(runs):
        n = run.features.shape[0]
        features[r, :n], tokens[r, : n - 1], mask[r, : n - 1] = run.features, run.next_tokens, True
    return features, tokens, mask


class EagleTrainer(Resumable):
    """AdamW on the head alone (target frozen, its features precomputed), linear warm-up then
    cosine decay; batches and noise drawn from seeded generators."""

    STATEFUL = ("head", "optimizer", "scheduler")

    def __init__(self, head: EagleHead, runs: Sequence[FeatureRun], *, steps: int, batch_size: int = 8,
                 lr: float = 3e-3, weight_decay: float = 0.0, warmup: int = 0, w_cls: float = 0.1,
                 noise: float = 0.2, seed: int = 0) -> None:
        if not runs:
            raise UserError("no training texts for the EAGLE head")
        self.head, self.runs, self.steps, self.batch_size = head, list(runs), steps, batch_size
        self.w_cls, self.noise = w_cls, noise
        self.optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr,
                                           weight_decay=weight_decay)
        self.scheduler = warmup_cosine(self.optimizer, steps, min(warmup, steps))
        self.generator = torch.Generator().manual_seed(seed)
        self.step_index = 0

    def _forward(self, runs: Sequence[FeatureRun], *, noisy: bool):
        device = self.head.lm_head.weight.device
        features, tokens, mask = (x.to(device) for x in pad_runs(runs))
        inputs, target = features[:, :-1], features[:, 1:]  # (B, T-1, H): f_t in, f_{t+1} out
        if noisy and self.noise:  # EAGLE: uniform noise on the input features
            u = torch.rand(inputs.shape, generator=self.generator, dtype=inputs.dtype)
            inputs = inputs + ((u - 0.5) * self.noise).to(device)
        predicted = self.head(inputs, tokens)  # (B, T-1, H)
        with torch.no_grad():
            target_logits = self.head.logits(target)  # (B, T-1, V): the frozen model's own
        predicted_logits = self.head.logits(predicted)
        loss = eagle_loss(predicted, target, predicted_logits, target_logits, mask, w_cls=self.w_cls)
        hits = ((predicted_logits.argmax(-1) == target_logits.argmax(-1)) & mask).sum()
        return loss, hits, mask.sum()

    def step(self) -> dict:
        """One optimizer step on a random batch; returns its loss, top-1 agreement, lr."""
        self.head.train()
        pick = torch.randint(len(self.runs), (self.batch_size,), generator=self.generator).tolist()
        loss, hits, count = self._forward([self.runs[i] for i in pick], noisy=True)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        self.step_index += 1
        return {"step": self.step_index, "loss": loss.item(), "lr": self.scheduler.get_last_lr()[0],
                "agreement": float(hits) / max(int(count), 1)}

    @torch.no_grad()
    def evaluate(self, runs: Sequence[FeatureRun]) -> dict:
        """Mean loss per position and top-1 agreement (the head's next-next token vs the model's,
        teacher forced) on held-out runs, without noise."""
        self.head.eval()
        total = hits = count = 0.0
        for start in range(0, len(runs), self.batch_size):
            loss, h, c = self._forward(runs[start : start + self.batch_size], noisy=False)
            total, hits, count = total + float(loss) * int(c), hits + int(h), count + int(c)
        return {"loss": total / max(count, 1), "agreement": hits / max(count, 1)}


def new_head(model: torch.nn.Module, seed: int = 0) -> EagleHead:
    """A freshly initialised head for `model` (its initial weights depend on `seed` alone)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return EagleHead.for_model(model)


def train_eagle(model: torch.nn.Module, texts: Sequence[Text], *, steps: int = 200, batch_size: int = 8,
                lr: float = 3e-3, w_cls: float = 0.1, noise: float = 0.2,
                eos_token_id: int | Iterable[int] | None = None, pad_id: int = 0, seed: int = 0) -> EagleHead:
    """A fresh head for `model` trained on `texts` (its greedy output); the model is left frozen
    and unchanged. For scripts and tests: `cllm eagle` adds held-out loss, logs, checkpoints,
    an evaluation."""
    model.requires_grad_(False)
    head = new_head(model, seed)
    runs = feature_runs(model, texts, pad_id=pad_id, eos_token_id=eos_token_id)
    trainer = EagleTrainer(head, runs, steps=steps, batch_size=batch_size, lr=lr, w_cls=w_cls, noise=noise, seed=seed)
    for _ in range(steps):
        trainer.step()
    return head.eval()


def save_eagle(head: EagleHead, directory: str | os.PathLike) -> Path:
    """Write `head` (weights under EAGLE-1's names, sizes, default tree, `meta`) and its layer's
    one-layer Llama `config.json` to a folder; returns it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with replacing(directory / WEIGHTS_FILE) as tmp:
        save_file(head.saved_state(), str(tmp), metadata={"format": "pt"})
    record = {**head.meta, "format_version": FORMAT_VERSION, "sizes": head.sizes,
              "parameters_added": head.parameters_added(), "tree": head.tree}
    (directory / CONFIG_FILE).write_text(json.dumps(record, indent=2) + "\n")
    (directory / DRAFT_CONFIG_FILE).write_text(json.dumps(head.draft_config(), indent=2, default=str) + "\n")
    share_like_siblings(directory)  # safetensors writes 0600
    return directory
