"""Medusa heads (Cai et al. 2024, arXiv 2401.10774) for any causal LM: the module, and how it is
saved beside a checkpoint and loaded back.

Head k (k = 1..K) guesses the token k + 1 positions ahead from the backbone's last hidden state
(the final norm's output, what the LM head reads): Medusa's residual block
``h + SiLU(W_k h)``, then a vocabulary projection. ``W_k`` starts at zero, so a fresh head is
the LM head itself. The projection is the model's own (frozen) LM head, shared by every head,
unless `own_projection` gives each head a copy to train. `cllm.decoding.rivals.medusa` decodes with
them (exactly greedy); `cllm.training.heads` trains them; `cllm medusa` does both from the shell.

Saved as a folder (default: ``<checkpoint>/medusa/``, a subfolder, so the checkpoint's files and
fingerprint do not change): ``medusa_config.json`` (sizes, the base model's fingerprint, the
heads' measured accuracies, what trained them) and ``medusa_heads.safetensors`` (the heads'
own weights; a shared LM head is not copied).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cllm.core.errors import UserError, first_line

log = logging.getLogger(__name__)

HEADS_DIR = Path("medusa")  # relative to a checkpoint directory
CONFIG_FILE = "medusa_config.json"
WEIGHTS_FILE = "medusa_heads.safetensors"
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
    head k's rank-r token was right, measured by `cllm.training.heads.measure_accuracies`) shape the
    candidate trees of `medusa_decode`; `tree`, when set, is its default tree (Medusa's
    "medusa_choices", paths of top-k ranks); `meta` is what else `save_heads` writes.
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


# ------------------------------------------------------------------------ save and load


def base_model_meta(model: nn.Module, model_path: str | os.PathLike | None = None) -> dict[str, str]:
    """The fingerprints `load_heads` checks: of the checkpoint folder when the model came from
    one, and of its float32 parameters (for a model given in memory)."""
    from cllm.models import fingerprint

    meta = {"parameters_fingerprint": fingerprint(model)}
    if model_path is not None:
        meta["model_fingerprint"] = fingerprint(model_path)
    return meta


def save_heads(heads: MedusaHeads, directory: str | os.PathLike) -> Path:
    """Write `heads` (weights, sizes, accuracies, `meta`) to a folder; returns it."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in heads.state_dict().items()}
    tmp = directory / f".{WEIGHTS_FILE}.partial"
    save_file(state, str(tmp))
    os.replace(tmp, directory / WEIGHTS_FILE)
    # what the heads are now wins over `meta` (heads loaded from an older file carry its fields there)
    record = {**heads.meta, "format_version": FORMAT_VERSION, "num_heads": heads.num_heads,
              "hidden_size": heads.hidden_size, "vocab_size": heads.vocab_size, "own_projection": heads.own_projection,
              "parameters_added": heads.parameters_added(), "accuracies": heads.accuracies, "tree": heads.tree}
    (directory / CONFIG_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return directory


def heads_dir(source: str | os.PathLike) -> Path | None:
    """The heads folder `source` names: itself when it holds a `medusa_config.json`, else its
    `medusa/` subfolder when that does (a checkpoint with heads); None otherwise."""
    path = Path(source).expanduser()
    for candidate in (path, path / HEADS_DIR):
        if (candidate / CONFIG_FILE).is_file():
            return candidate
    return None


def load_heads(source: str | os.PathLike, model: nn.Module, *,
               model_path: str | os.PathLike | None = None) -> MedusaHeads | None:
    """The heads saved in `source` (a heads folder, or a checkpoint whose `medusa/` holds them)
    for `model`, on its device and in its dtype; None when `source` is a folder without heads.

    The base model must be the one they were trained on: its fingerprint
    (`cllm.models.fingerprint`) is compared with the saved one, that of the checkpoint folder
    (`model_path`, or `source` itself when it is a checkpoint) when one is known, else that of
    `model`'s float32 parameters. A mismatch, other sizes or an unreadable file is a one-line
    UserError.
    """
    from safetensors.torch import load_file

    path = Path(source).expanduser()
    if not path.exists():
        raise UserError(f"Medusa heads not found: {path}")
    found = heads_dir(path)
    if found is None:
        return None
    if model_path is None and found != path and (path / "config.json").is_file():
        model_path = path  # a checkpoint with its heads inside
    try:
        record = json.loads((found / CONFIG_FILE).read_text(encoding="utf-8"))
        num_heads, own = int(record["num_heads"]), bool(record["own_projection"])
        sizes = (int(record["vocab_size"]), int(record["hidden_size"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"cannot read {found / CONFIG_FILE}: {first_line(exc)}") from None
    lm_head = model.get_output_embeddings()
    if lm_head is None or tuple(lm_head.weight.shape) != sizes:
        have = None if lm_head is None else tuple(lm_head.weight.shape)
        raise UserError(f"Medusa heads in {found} are for a vocabulary x hidden size of {sizes}, the model has {have}")
    _check_fingerprint(record, found, model, model_path)
    heads = MedusaHeads(lm_head, num_heads=num_heads, own_projection=own)
    try:
        state = load_file(str(found / WEIGHTS_FILE))
        heads.load_state_dict(state)
    except Exception as exc:  # noqa: BLE001 - a missing, damaged or foreign file: one line naming it
        raise UserError(f"cannot load {found / WEIGHTS_FILE}: {first_line(exc)}") from None
    heads.accuracies, heads.tree = record.get("accuracies"), record.get("tree")
    heads.meta = {k: v for k, v in record.items() if k not in ("accuracies", "tree")}
    return heads.to(device=lm_head.weight.device, dtype=lm_head.weight.dtype).eval()


def _check_fingerprint(record: dict, found: Path, model: nn.Module, model_path) -> None:
    from cllm.models import fingerprint

    if model_path is not None and record.get("model_fingerprint"):
        saved, have = record["model_fingerprint"], fingerprint(model_path)
    elif record.get("parameters_fingerprint"):
        if next(model.parameters()).dtype != torch.float32:  # a cast changes the parameters' hash
            log.warning("Medusa heads in %s: the base model's fingerprint is not checked for a model "
                        "in %s (pass model_path)", found, next(model.parameters()).dtype)
            return
        saved, have = record["parameters_fingerprint"], fingerprint(model)
    else:
        return
    if saved != have:
        raise UserError(f"Medusa heads in {found} were trained on another model (fingerprint {saved}, "
                        f"this one is {have}); retrain them with cllm medusa")
