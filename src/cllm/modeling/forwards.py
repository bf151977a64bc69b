"""PrefixBlocks: prefix (left-padded) + block (right-padded), the one shape every training and
evaluation forward takes. Positions count real tokens only, as in the decoders."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cllm.modeling import losses
from cllm.runtime import hf
from cllm.runtime.hf import custom_mask


@dataclass
class PrefixBlocks:
    prefix_ids: torch.Tensor  # (R, P) left-padded
    prefix_mask: torch.Tensor  # (R, P) 1 on real tokens
    block_ids: torch.Tensor  # (R, N) right-padded
    block_mask: torch.Tensor  # (R, N) 1 on real tokens

    def __len__(self) -> int:
        return self.block_ids.shape[0]

    @property
    def width(self) -> int:
        return self.block_ids.shape[1]

    def to(self, device) -> PrefixBlocks:
        tensors = (self.prefix_ids, self.prefix_mask, self.block_ids, self.block_mask)
        return PrefixBlocks(*(t.to(device) for t in tensors))


def rows_from_lists(prefixes: Sequence[Sequence[int]], blocks: Sequence[Sequence[int]], pad_id: int) -> PrefixBlocks:
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
    return PrefixBlocks(ids, pmask, bids, bmask)


def window_loss(model, windows: torch.Tensor, bf16: bool = False) -> torch.Tensor:
    """The language-model training loss (`cllm pretrain`): mean next-token cross-entropy
    (nats/token) over (B, T + 1) windows of a token stream, one causal forward each."""
    x, y = windows[:, :-1], windows[:, 1:]  # (B, T) each
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=x, use_cache=False).logits  # (B, T, V)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def forward_blocks(model, rows: PrefixBlocks, *, logits_to_keep: bool = True) -> torch.Tensor:
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
    if checkpointed(model):
        return forward_prefix_per_block(model, prefix_ids, prefix_mask, groups, logits_to_keep=logits_to_keep)
    device = next(model.parameters()).device
    prefixes, last = hf.prefill_rows(model, prefix_ids.to(device), prefix_mask.to(device))  # last: (B, V)
    out = []
    for g in groups:
        owner = g.owner.to(device)
        with torch.enable_grad() if g.grad else torch.no_grad():
            fork = hf.fork_rows(prefixes, owner, detach=not g.grad)
            logits = hf.feed_rows(model, fork, g.block_ids.to(device), g.block_mask.sum(1).tolist())
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
        rows = PrefixBlocks(prefix_ids[owner], prefix_mask[owner], g.block_ids, g.block_mask)
        with torch.enable_grad() if g.grad else torch.no_grad():
            out.append(forward_blocks(model, rows, logits_to_keep=logits_to_keep))
    return out


@dataclass
class Packing:
    """A micro-batch's records laid out as Jacobi Forcing packs them: one sequence per prompt,
    its clean text (the prompt and the fixed points of its blocks, in order) followed by the
    state blocks of its records. A state block attends to the prompt, the fixed points before
    its own block and itself (causally): the noise-conditioned mask. Every clean position is
    computed once for all the blocks of its prompt."""

    clean_ids: torch.Tensor  # (S, C) right-padded: prompt + fixed points
    clean_lengths: torch.Tensor  # (S,)
    sequence: torch.Tensor  # (B,) the sequence of each record
    start: torch.Tensor  # (B,) where each record's block starts in its sequence

    def to(self, device) -> Packing:
        return Packing(*(t.to(device) for t in (self.clean_ids, self.clean_lengths, self.sequence, self.start)))


def forward_packed(model, packing: Packing, width: int, groups: Sequence[BlockGroup], *,
                   logits_to_keep: bool = True) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One forward over the packed sequences: block-aligned logits (B, width, V) of every
    record's fixed point (read off the clean text), and of every group's blocks (group row i
    continues record ``owner[i]``), equal to what `forward_blocks` gives for ``prefix + block``
    row by row. A group with ``grad=False`` comes back detached."""
    device = next(model.parameters()).device
    packing = packing.to(device)
    S, C = packing.clean_ids.shape
    # 1. where each group row goes: the next free block slot after its sequence's clean text
    taken = [0] * S
    placed = []  # per group: the column where each of its rows' block starts
    for g in groups:
        columns = []
        for s in packing.sequence[g.owner.to(device)].tolist():
            columns.append(C + taken[s] * width)
            taken[s] += 1
        placed.append(columns)
    L = C + max(taken, default=0) * width
    # 2. tokens, positions (a block at its own block's positions) and the mask
    ids = torch.zeros(S, L, dtype=torch.long, device=device)
    ids[:, :C] = packing.clean_ids
    positions = torch.arange(L, device=device).repeat(S, 1)
    allowed = torch.eye(L, dtype=torch.bool, device=device).repeat(S, 1, 1)  # padding sees itself
    causal = torch.ones(L, L, dtype=torch.bool, device=device).tril()
    for s, n in enumerate(packing.clean_lengths.tolist()):
        allowed[s, :n, :n] = causal[:n, :n]
    for g, columns in zip(groups, placed, strict=True):
        for i, (record, at) in enumerate(zip(g.owner.tolist(), columns, strict=True)):
            s, start = int(packing.sequence[record]), int(packing.start[record])
            ids[s, at : at + width] = g.block_ids[i].to(device)
            positions[s, at : at + width] = start + torch.arange(width, device=device)
            allowed[s, at : at + width, :start] = True  # the prompt and the fixed points before the block
            allowed[s, at : at + width, at : at + width] = causal[:width, :width]
    # 3. one forward (logits from the shortest prompt's last position on), read block-aligned
    first_needed = int(packing.start.min()) - 1
    kwargs = {"logits_to_keep": L - first_needed} if logits_to_keep else {}
    logits = model(input_ids=ids, attention_mask=custom_mask(model, allowed[:, None]), position_ids=positions,
                   use_cache=False, **kwargs).logits
    shift = L - logits.shape[1]  # the sequence column of logits[:, 0]
    offsets = torch.arange(width, device=device)
    before = packing.start - 1 - shift  # (B,) the logits column that predicts each block's first token
    columns = (before[:, None] + offsets[None, :]).clamp(max=logits.shape[1] - 1)
    fixed = logits[packing.sequence[:, None], columns]  # (B, width, V)
    out = []
    for g, at in zip(groups, placed, strict=True):
        owner = g.owner.to(device)
        at = torch.tensor(at, dtype=torch.long, device=device) - shift
        cols = torch.cat([before[owner][:, None], at[:, None] + offsets[None, :-1]], 1)  # (R, width)
        block = logits[packing.sequence[owner][:, None], cols]
        out.append(block if g.grad else block.detach())
    return fixed, out


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
