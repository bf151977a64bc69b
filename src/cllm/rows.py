"""Rows: prefix (left-padded) + block (right-padded), the one shape every training and
evaluation forward takes. Positions count real tokens only, as in the decoders."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cllm import losses


@dataclass
class Rows:
    prefix_ids: torch.Tensor  # (R, P) left-padded
    prefix_mask: torch.Tensor  # (R, P) 1 on real tokens
    block_ids: torch.Tensor  # (R, N) right-padded
    block_mask: torch.Tensor  # (R, N) 1 on real tokens

    def __len__(self) -> int:
        return self.block_ids.shape[0]

    @property
    def width(self) -> int:
        return self.block_ids.shape[1]

    def to(self, device) -> Rows:
        return Rows(*(t.to(device) for t in (self.prefix_ids, self.prefix_mask, self.block_ids, self.block_mask)))


def rows_from_lists(prefixes: Sequence[Sequence[int]], blocks: Sequence[Sequence[int]], pad_id: int) -> Rows:
    P, N = max(map(len, prefixes)), max(map(len, blocks))
    ids = torch.full((len(prefixes), P), pad_id, dtype=torch.long)
    pmask = torch.zeros_like(ids)
    bids = torch.full((len(blocks), N), pad_id, dtype=torch.long)
    bmask = torch.zeros_like(bids)
    for r, (p, b) in enumerate(zip(prefixes, blocks, strict=True)):
        if p:
            ids[r, P - len(p):], pmask[r, P - len(p):] = torch.tensor(list(p)), 1
        if b:
            bids[r, : len(b)], bmask[r, : len(b)] = torch.tensor(list(b)), 1
    return Rows(ids, pmask, bids, bmask)


def forward_blocks(model, rows: Rows, *, logits_to_keep: bool = True) -> torch.Tensor:
    """Block-aligned logits (R, N, V) of one forward over ``prefix + block``: [:, i] predicts
    block token i. Positions count real tokens only, as in the decoders."""
    input_ids = torch.cat([rows.prefix_ids, rows.block_ids], 1)  # (R, P + N)
    mask = torch.cat([rows.prefix_mask, rows.block_mask], 1)
    position_ids = (mask.cumsum(1) - 1).clamp(min=0)
    device = next(model.parameters()).device
    kwargs = {"logits_to_keep": rows.width + 1} if logits_to_keep else {}
    out = model(input_ids=input_ids.to(device), attention_mask=mask.to(device),
                position_ids=position_ids.to(device), use_cache=False, **kwargs)
    return losses.block_logits(out.logits, rows.width)




@dataclass
class BlockGroup:
    """Blocks that continue shared prefixes: block row i continues prefix row ``owner[i]``."""

    block_ids: torch.Tensor  # (R, N) right-padded
    block_mask: torch.Tensor  # (R, N)
    owner: torch.Tensor  # (R,) index into the prefix rows
    grad: bool = True  # False: a stop-gradient target (no graph kept)


def forward_shared_prefix(model, prefix_ids: torch.Tensor, prefix_mask: torch.Tensor,
                          groups: Sequence[BlockGroup], *, logits_to_keep: bool = True) -> list[torch.Tensor]:
    """Block-aligned logits of every group, as `forward_blocks` would give for the rows
    ``prefix[owner] + block``, but each prefix is computed once (with gradients) and its KV
    entries reused by all of its blocks: k states of one record cost one prefix, not k.

    Under gradient checkpointing transformers drops the cache of a checkpointed layer (its
    backward replay would append to it twice), so there every block gets its own copy of the
    prefix instead (`forward_prefix_per_block`): the same logits, at k times the prefix cost."""
    from cllm.decoding import cache as kv

    if checkpointed(model):
        return forward_prefix_per_block(model, prefix_ids, prefix_mask, groups, logits_to_keep=logits_to_keep)
    device = next(model.parameters()).device
    rc, last = kv.prefill(model, prefix_ids.to(device), prefix_mask.to(device))  # last: (B, V)
    out = []
    for g in groups:
        owner = g.owner.to(device)
        with torch.enable_grad() if g.grad else torch.no_grad():
            fork = kv.fork_rows(rc, owner, detach=not g.grad)
            logits = kv.feed(model, fork, g.block_ids.to(device), g.block_mask.sum(1).tolist())
            first = last.index_select(0, owner)
            first = first if g.grad else first.detach()
            out.append(torch.cat([first[:, None], logits[:, :-1]], 1))
    return out


def forward_prefix_per_block(model, prefix_ids: torch.Tensor, prefix_mask: torch.Tensor,
                             groups: Sequence[BlockGroup], *, logits_to_keep: bool = True) -> list[torch.Tensor]:
    """`forward_shared_prefix` without a cache: one `forward_blocks` over ``prefix[owner] + block``
    per group (the form gradient checkpointing allows)."""
    out = []
    for g in groups:
        owner = g.owner.to(prefix_ids.device)
        rows = Rows(prefix_ids[owner], prefix_mask[owner], g.block_ids, g.block_mask)
        with torch.enable_grad() if g.grad else torch.no_grad():
            out.append(forward_blocks(model, rows, logits_to_keep=logits_to_keep))
    return out


def enable_checkpointing(model) -> None:
    """Activation (gradient) checkpointing on every layer, non-reentrant (no inputs that require
    grad needed: LoRA), by whichever name the installed transformers gives it."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def checkpointed(model) -> bool:
    """Whether any layer of `model` (possibly wrapped: DDP, FSDP, peft) recomputes its activations
    in backward in this forward (training mode, gradients on): transformers'
    `gradient_checkpointing_enable`, or torch's checkpoint wrapper (FSDP's activation
    checkpointing), which would replay the cache writes too."""
    if not (model.training and torch.is_grad_enabled()):
        return False
    return any(getattr(m, "gradient_checkpointing", False) is True or type(m).__name__ == "CheckpointWrapper"
               for m in model.modules())
