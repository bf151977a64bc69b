"""Medusa heads (Cai et al. 2024, arXiv 2401.10774) for any causal LM: the module, and the names
of the files it is saved in beside a checkpoint.

Head k (k = 1..K) guesses the token k + 1 positions ahead from the backbone's last hidden state
(the final norm's output, what the LM head reads): Medusa's residual block
``h + SiLU(W_k h)``, then a vocabulary projection. ``W_k`` starts at zero, so a fresh head is
the LM head itself. The projection is the model's own (frozen) LM head, shared by every head,
unless `own_projection` gives each head a copy to train. `cllm.decoding.rivals.medusa` decodes with
them (exactly greedy); `cllm.training.medusa` trains and saves them (`cllm medusa`);
`cllm.models.load_heads` loads them.

The file format, named here: a folder (default: ``<checkpoint>/medusa/``, a subfolder, so the
checkpoint's files and fingerprint do not change) holding ``medusa_config.json`` (sizes, the base
model's fingerprint, the heads' measured accuracies, what trained them) and
``medusa_heads.safetensors`` (the heads' own weights; a shared LM head is not copied).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cllm.core.errors import UserError
from cllm.modeling.names import MEDUSA_CONFIG_FILE, MEDUSA_DIR, MEDUSA_WEIGHTS_FILE

HEADS_DIR = MEDUSA_DIR  # relative to a checkpoint directory
CONFIG_FILE = MEDUSA_CONFIG_FILE
WEIGHTS_FILE = MEDUSA_WEIGHTS_FILE
FORMAT_VERSION = 1


class ResBlock(nn.Module):
    """Medusa's residual block, ``h + SiLU(W h + b)``; zero-initialised, so it starts as identity."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + nn.functional.silu(self.linear(h))


class MedusaHeads(nn.Module):
    """K heads on a model's last hidden state: ``heads(hidden (..., H)) -> logits (K, ..., V)``.

    Build with `MedusaHeads.for_model(model, num_heads=4)`. `accuracies` (``[k-1][r]``: how often
    head k's rank-r token was right, measured by `cllm.training.medusa.measure_accuracies`) shape the
    candidate trees of `medusa_decode`; `tree`, when set, is its default tree (Medusa's
    "medusa_choices", paths of top-k ranks); `meta` is what else `cllm.training.medusa.save_heads` writes.
    """

    def __init__(self, lm_head: nn.Module, *, num_heads: int, own_projection: bool = False) -> None:
        super().__init__()
        weight = lm_head.weight  # (V, H)
        if num_heads < 1:
            raise ValueError(f"num_heads must be >= 1, got {num_heads}")
        self.num_heads, self.own_projection = num_heads, own_projection
        self.vocab_size, self.hidden_size = weight.shape
        self.blocks = nn.ModuleList(ResBlock(self.hidden_size) for _ in range(num_heads))
        self.projections: nn.ModuleList | None = None
        if own_projection:  # each head its own copy of the LM head, trained with it
            self.projections = nn.ModuleList(_copy_linear(lm_head) for _ in range(num_heads))
        # the shared LM head belongs to the model: a tuple keeps it out of this module's
        # parameters and state dict (never trained here, never saved twice)
        self._shared = (lm_head,)
        self.accuracies: list[list[float]] | None = None
        self.tree: list[list[int]] | None = None
        self.meta: dict[str, Any] = {}
        self.to(device=weight.device, dtype=weight.dtype)

    @classmethod
    def for_model(cls, model: nn.Module, *, num_heads: int = 4, own_projection: bool = False) -> MedusaHeads:
        lm_head = model.get_output_embeddings()
        if lm_head is None or getattr(lm_head, "weight", None) is None:
            raise UserError(f"{type(model).__name__} has no output embedding (LM head) for Medusa heads to share")
        return cls(lm_head, num_heads=num_heads, own_projection=own_projection)

    @property
    def lm_head(self) -> nn.Module:
        return self._shared[0]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (..., H) -> logits (K, ..., V)."""
        if self.projections is not None:
            return torch.stack([proj(block(hidden)) for block, proj in zip(self.blocks, self.projections, strict=True)])
        # one product with the shared LM head for all heads: its V x H weights are read once (a
        # decoding step projects a single position, where reading them is the whole cost)
        return self.lm_head(torch.stack([block(hidden) for block in self.blocks]))  # (K, ..., V)

    def parameters_added(self) -> int:
        """The heads' own parameters (a shared LM head is the model's, not counted)."""
        return sum(p.numel() for p in self.parameters())


def _copy_linear(lm_head: nn.Module) -> nn.Linear:
    V, H = lm_head.weight.shape
    bias = getattr(lm_head, "bias", None)
    proj = nn.Linear(H, V, bias=bias is not None)
    with torch.no_grad():
        proj.weight.copy_(lm_head.weight)
        if bias is not None:
            proj.bias.copy_(bias)
    return proj
