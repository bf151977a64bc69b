"""Training an EAGLE head on a frozen model: teacher forcing on its own greedy text.

The target never changes, so its features (last hidden states) on the training text are
computed once (`feature_runs`, reusing Medusa's `hidden_states`); a step then costs only the
head and the LM head. At every position t the head reads the TRUE feature f_t (plus EAGLE's
uniform noise) and the token x_{t+1}, and learns f_{t+1} (`cllm.training.eagle.loss`).

`EagleTrainer` is EAGLE's loss on the training skeleton; `train_eagle` trains in one call
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
from cllm.modeling.eagle import CONFIG_FILE, DRAFT_CONFIG_FILE, FORMAT_VERSION, WEIGHTS_FILE, EagleHead
from cllm.training.drafter import DrafterTrainer, Score
from cllm.training.eagle.loss import eagle_loss
from cllm.training.texts import Text, hidden_states


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


class EagleTrainer(DrafterTrainer[FeatureRun]):
    """The EAGLE head on the skeleton (`cllm.training.drafter.DrafterTrainer`): the items are the
    frozen model's feature runs; a batch's loss is EAGLE's (feature regression + `w_cls` x
    classification), teacher forced on the true features with uniform noise of width `noise` on
    them while training (drawn from the batch generator)."""

    def __init__(self, head: EagleHead, runs: Sequence[FeatureRun], held: Sequence[FeatureRun] = (), *, steps: int,
                 w_cls: float = 0.1, noise: float = 0.2, **optimizer) -> None:
        if not runs:
            raise UserError("no training texts for the EAGLE head")
        super().__init__(head, runs, held, steps=steps, **optimizer)
        self.head, self.w_cls, self.noise = head, w_cls, noise

    def score(self, batch: Sequence[FeatureRun], *, training: bool) -> Score:
        device = self.head.lm_head.weight.device
        features, tokens, mask = (x.to(device) for x in pad_runs(batch))
        inputs, target = features[:, :-1], features[:, 1:]  # (B, T-1, H): f_t in, f_{t+1} out
        if training and self.noise:  # EAGLE: uniform noise on the input features
            u = torch.rand(inputs.shape, generator=self.generator, dtype=inputs.dtype)
            inputs = inputs + ((u - 0.5) * self.noise).to(device)
        predicted = self.head(inputs, tokens)  # (B, T-1, H)
        with torch.no_grad():
            target_logits = self.head.logits(target)  # (B, T-1, V): the frozen model's own
        predicted_logits = self.head.logits(predicted)
        loss = eagle_loss(predicted, target, predicted_logits, target_logits, mask, w_cls=self.w_cls)
        hits = ((predicted_logits.argmax(-1) == target_logits.argmax(-1)) & mask).sum()
        return Score(loss, hits, mask.sum(), weight=int(mask.sum()))

    def agreement(self, hits: torch.Tensor, counts: torch.Tensor) -> float:
        """The head's next-next token against the model's, teacher forced: one share."""
        return int(hits) / max(int(counts), 1)

    @property
    def positions(self) -> int:
        return sum(r.next_tokens.shape[0] for r in self.items)


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
    trainer.train_in_memory()
    return head


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
