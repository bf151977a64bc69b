"""Training a model together with its Medusa heads (Medusa-2, Cai et al. 2024, section 2.2.2).

The text is the ORIGINAL model's greedy output (as for Medusa-1), and the original stays the
teacher of both terms: its last hidden states on the text are computed once
(`cllm.training.texts.hidden_states`) and a frozen copy of its LM head turns them into
its distributions per batch (V-sized logits are never stored; the model's own LM head may be
tied to its embeddings and moves with them). A joint step runs the model with gradients over
prompt + text (`cllm.runtime.hf.forward_hidden`, the one adapter for model calls) and takes
`cllm.training.medusa.loss.joint_loss`: the model's KL to the original at every counted position
+ lambda x the heads' loss on the model's current hidden states.

The first `warmup_heads` steps train the heads alone, the model frozen: the model is then the
original, so its stored states stand in for the forward and a step costs only the heads.

`JointTrainer` is Medusa-2 on the training skeleton, with both optimizers (one per learning rate);
nothing here prints.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from cllm.core.errors import UserError
from cllm.decoding.inputs import left_pad, model_device
from cllm.modeling.heads import MedusaHeads
from cllm.modeling.losses import Distance
from cllm.runtime import hf
from cllm.training.drafter import DrafterTrainer
from cllm.training.medusa.loss import agreement, joint_loss
from cllm.training.medusa.trainer import pad_batch
from cllm.training.schedule import warmup_cosine
from cllm.training.skeleton import descend, draw
from cllm.training.texts import Text

MAX_GRAD_NORM = 1.0  # the model's gradient is clipped (the heads' is not, as in Medusa-1)


def frozen_copy(lm_head: nn.Module) -> nn.Linear:
    """A detached copy of an LM head (V x H, its bias if any): the original's, kept while the
    model's own trains."""
    V, H = lm_head.weight.shape
    bias = getattr(lm_head, "bias", None)
    copy = nn.Linear(H, V, bias=bias is not None, device=lm_head.weight.device, dtype=lm_head.weight.dtype)
    with torch.no_grad():
        copy.weight.copy_(lm_head.weight)
        if bias is not None:
            copy.bias.copy_(bias)
    return copy.requires_grad_(False)


@dataclass
class Batch:
    """Texts of one step as the model reads them, and the counted positions' places."""

    ids: torch.Tensor  # (B, S) prompt + completion, left-padded
    attention: torch.Tensor  # (B, S)
    index: torch.Tensor  # (B, T) where counted position j of row r sits in the S positions
    mask: torch.Tensor  # (B, T) bool: the positions that count (right-padded)
    original: torch.Tensor  # (B, T, H) the original's last hidden states there


def make_batch(texts: Sequence[Text], states: Sequence[torch.Tensor], pad_id: int) -> Batch:
    """The counted positions of each text are those `hidden_states` kept: from the prompt's last
    token on, n = len(state) of them."""
    ids, attention = left_pad([t.prompt + t.completion for t in texts], pad_id)  # (B, S)
    original, mask = pad_batch(states)  # (B, T, H), (B, T)
    S, T = ids.shape[1], mask.shape[1]
    starts = torch.tensor([S - len(t.completion) - 1 for t in texts])  # (B,)
    index = (starts[:, None] + torch.arange(T)).clamp(max=S - 1)  # (B, T)
    return Batch(ids, attention, index, mask, original)


class JointTrainer(DrafterTrainer[tuple[Text, torch.Tensor]]):
    """Medusa-2 on the skeleton: AdamW on the heads (`lr`) and on the model (`backbone_lr`), each
    with linear warm-up then cosine decay (the model's over the joint steps only); the items are
    (text, the original's hidden states on it) pairs, batches drawn by a seeded generator."""

    def __init__(self, model: nn.Module, heads: MedusaHeads, texts: Sequence[Text], states: Sequence[torch.Tensor],
                 teacher: nn.Module, *, steps: int, held: Sequence[tuple[Text, torch.Tensor]] = (),
                 warmup_heads: int = 0, batch_size: int = 8, lr: float = 3e-3, backbone_lr: float = 1e-4,
                 heads_weight: float = 0.2, weight_decay: float = 0.0, warmup: int = 0, distance: Distance = "fkl",
                 head_decay: float = 0.8, pad_id: int = 0, seed: int = 0, plan=None) -> None:
        if not texts or len(texts) != len(states):
            raise UserError("no training texts for Medusa-2")
        super().__init__(heads, list(zip(texts, states, strict=True)), held, steps=steps, batch_size=batch_size, lr=lr,
                         weight_decay=weight_decay, warmup=warmup, seed=seed, plan=plan)
        self.model, self.heads, self.teacher = model, heads, teacher
        self.warmup_heads = min(warmup_heads, steps)
        self.heads_weight, self.distance, self.pad_id = heads_weight, distance, pad_id
        self.weights = [head_decay**k for k in range(heads.num_heads)]  # Medusa's lambda_k
        self.model_optimizer = torch.optim.AdamW(model.parameters(), lr=backbone_lr, weight_decay=weight_decay)
        joint = steps - self.warmup_heads
        self.model_scheduler = warmup_cosine(self.model_optimizer, max(joint, 1), min(warmup, joint))

    @property
    def joint(self) -> bool:
        """Whether the next step trains the model too (the heads' warm-up is over)."""
        return self.step >= self.warmup_heads

    def _forward(self, batch: Sequence[tuple[Text, torch.Tensor]], *, backbone: bool):
        """The loss on a batch; with `backbone`, through a forward of the model (with gradients
        when enabled), else on the original's stored states (the model frozen and unchanged)."""
        device = model_device(self.model)
        made = make_batch([t for t, _ in batch], [s for _, s in batch], self.pad_id)
        mask, original = made.mask.to(device), made.original.to(device)
        with torch.no_grad():
            original_logits = self.teacher(original)  # (B, T, V) the original's distributions
        if backbone:
            fwd = hf.forward_hidden(self.model, made.ids.to(device), made.attention.to(device))
            index = made.index.to(device)[..., None]  # (B, T, 1)
            hidden = fwd.hidden.gather(1, index.expand(-1, -1, fwd.hidden.shape[-1]))  # (B, T, H)
            model_logits = fwd.logits.gather(1, index.expand(-1, -1, fwd.logits.shape[-1]))  # (B, T, V)
        else:
            hidden, model_logits = original, None
        head_logits = self.heads(hidden)  # (K, B, T, V)
        loss = joint_loss(model_logits, head_logits, original_logits, mask, heads_weight=self.heads_weight,
                          distance=self.distance, weights=self.weights)
        hits, counts = agreement(head_logits.detach(), original_logits, mask)
        same = None
        if model_logits is not None:  # the model's greedy token = the original's, teacher-forced
            same = ((model_logits.detach().argmax(-1) == original_logits.argmax(-1)) & mask).sum()
        return loss, hits, counts, same, mask.sum()

    def train_step(self) -> dict:
        """One optimizer step on a random batch: the heads alone during the warm-up, then both."""
        joint = self.joint
        self.heads.train()
        self.model.train(joint)
        batch = [self.items[i] for i in draw(len(self.items), self.batch_size, self.generator)]
        loss, hits, counts, same, n = self._forward(batch, backbone=joint)
        self.model_optimizer.zero_grad(set_to_none=True)
        descend(loss.total, self.optimizer, self.scheduler)
        if joint:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), MAX_GRAD_NORM)
            self.model_optimizer.step()
            self.model_scheduler.step()
        self.model.eval()
        record = {"joint": joint, "loss": loss.total.item(), "backbone_kl": loss.backbone.item(),
                  "heads_loss": loss.heads.item(), "lr": self.scheduler.get_last_lr()[0],
                  "backbone_lr": self.model_scheduler.get_last_lr()[0] if joint else 0.0,
                  "agreement": (hits / counts.clamp(min=1)).tolist()}
        if same is not None:
            record["model_agreement"] = float(same) / max(int(n), 1)
        return record

    @torch.no_grad()
    def holdout(self) -> dict:
        """On the held-out texts, through the current model: mean KL to the original and heads' loss
        per position, per-head top-1 agreement with the original's greedy token k + 1 ahead, and
        how often the model's own greedy token is the original's (teacher-forced)."""
        self.heads.eval()
        self.model.eval()
        sums = {"loss": 0.0, "backbone_kl": 0.0, "heads_loss": 0.0}
        positions, hits, counts, same = 0, 0, 0, 0
        for start in range(0, len(self.held), self.batch_size):
            loss, h, c, s, n = self._forward(self.held[start : start + self.batch_size], backbone=True)
            for key, value in (("loss", loss.total), ("backbone_kl", loss.backbone), ("heads_loss", loss.heads)):
                sums[key] += float(value) * int(n)
            positions, hits, counts, same = positions + int(n), hits + h, counts + c, same + int(s)
        return {**{k: v / max(positions, 1) for k, v in sums.items()},
                "agreement": (hits / counts.clamp(min=1)).tolist(), "model_agreement": same / max(positions, 1)}

    def postfix(self, record: dict) -> dict[str, str]:
        return {"kl": f"{record['backbone_kl']:.4f}", "heads": f"{record['heads_loss']:.2f}",
                "head1": f"{record['agreement'][0]:.2f}"}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "model": self.model.state_dict(),
                "model_optimizer": self.model_optimizer.state_dict(),
                "model_scheduler": self.model_scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        super().load_state_dict(state)
        self.model_optimizer.load_state_dict(state["model_optimizer"])
        self.model_scheduler.load_state_dict(state["model_scheduler"])

    @property
    def positions(self) -> int:
        return sum(s.shape[0] for _, s in self.items)
