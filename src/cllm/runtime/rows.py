"""The bookkeeping of a batched runtime: rows of one rectangular KV cache, (rows, slots), whose
entries each row keeps or forgets on its own (`cllm.runtime.hf`, `cllm.runtime.lean`).

Rows of a batch keep different numbers of fed tokens per forward, but the cache stays
rectangular and the attention mask does the bookkeeping:

- after a forward that wrote `L` slots for every row, row r keeps only some of them; the slots
  no row keeps are cropped off the end, the others become *holes* that the row's slot-validity
  mask hides from attention;
- positions are logical (the count of a row's valid entries), never physical, so a hole changes
  nothing a row computes; causality stays physical, which is right because every row's entries
  are in order;
- when the holes (plus padding) waste a sizeable part of the cache, it is compacted: each row's
  valid entries gathered into a fresh left-padded layout.

One row never has holes: rejected entries are cropped, and entries kept off a chain from the
first (a tree's accepted branch) are first moved up over the rejected ones (a few entries per
layer). What differs between runtimes (how a cache is stored, copied and cropped) is a
`Storage`; everything here is the same for all of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from cllm.runtime.protocol import Forward, check_tree

# Compact when the cache holds more than this many columns beyond the longest row's valid
# entries, and they are at least this fraction of the cache (amortises the copy).
COMPACT_MIN_WASTE = 32
COMPACT_WASTE_FRACTION = 0.25


class Storage(Protocol):
    """The KV entries of a batch of rows, rectangular: (rows, slots) per layer."""

    def slots(self) -> int:
        """Slots in use (the same for every row)."""
        ...

    def crop(self, slots: int) -> None:
        """Keep the first `slots` slots of every row."""
        ...

    def gather(self, index: torch.Tensor) -> None:
        """Row b keeps slots `index[b]` (B, S') in that order; the cache then has S' slots."""
        ...

    def move(self, base: int, kept: Sequence[int]) -> None:
        """One row: copy slot base + kept[j] to base + j (kept increasing), every layer."""
        ...

    def select(self, rows: Sequence[int]) -> None:
        """Keep batch rows `rows`, in that order."""
        ...

    def join(self, other: Storage) -> None:
        """Append `other`'s rows after these; the part with fewer slots is padded to the other's,
        these rows after their entries, `other`'s before theirs."""
        ...


@dataclass
class Batch:
    """The open rows of a batched runtime, in cache order, and which of its slots each may read."""

    storage: Storage
    ids: list[int]  # row ids, in cache order
    lengths: list[int]  # per row: valid entries = the position of its next token
    valid: torch.Tensor | None  # (B, S) bool slot validity; None while every slot is valid

    @property
    def device(self) -> torch.device:
        return self.valid.device if self.valid is not None else torch.device("cpu")

    def order(self, rows: Sequence[int]) -> list[int] | None:
        """Where each of `rows` is in the cache (None when they are the cache's rows in its
        order, the fast case); a ValueError unless they are exactly the open rows."""
        if list(rows) == self.ids:
            return None
        if sorted(rows) != sorted(self.ids):
            raise ValueError(f"a forward feeds every open row once: open {sorted(self.ids)}, fed {sorted(rows)}")
        where = {r: i for i, r in enumerate(self.ids)}
        return [where[r] for r in rows]

    # -- masks and positions of a forward

    def chain(self, fed: Sequence[int], width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Positions (B, width) and the (B, S + width) key mask of a forward feeding `fed[r]`
        real tokens per row as chains, right-padded to `width` (a pad repeats the row's last
        position and is never kept). The mask is None when nothing needs hiding (the attention
        kernel's fast path)."""
        positions = torch.tensor([[n + min(i, f - 1) for i in range(width)] for n, f in zip(self.lengths, fed,
                                                                                             strict=True)],
                                 device=device)
        if self.valid is None and all(f == width for f in fed):
            return positions, None
        past = self.valid if self.valid is not None else torch.ones(len(fed), self.storage.slots(), dtype=torch.bool,
                                                                  device=device)
        new = torch.arange(width, device=device)[None, :] < torch.tensor(fed, device=device)[:, None]
        return positions, torch.cat([past.to(device), new], dim=1)

    def tree(self, depth: torch.Tensor, own: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions (B, L) and the (B, 1, L, S + L) mask of a tree forward: token i of row b at
        position ``lengths[b] + depth[b, i]``, seeing the row's valid entries and the fed tokens
        `own[b, i]` marks (its ancestors and itself)."""
        B, L = depth.shape
        device = depth.device
        positions = torch.tensor(self.lengths, device=device)[:, None] + depth
        S = self.storage.slots()
        past = self.valid.to(device) if self.valid is not None else torch.ones(B, S, dtype=torch.bool, device=device)
        mask = torch.cat([past[:, None, :].expand(B, L, S), own.bool()], dim=2)[:, None]
        return positions, mask

    # -- what a forward's rows keep

    def keep(self, kept: Sequence[Sequence[int]], fed: int) -> None:
        """After a forward wrote `fed` slots for every row, row r keeps exactly the entries
        `kept[r]` (increasing indices into them); the rest become holes or are cropped."""
        if all(list(k) == list(range(len(k))) for k in kept):
            self._keep_first([len(k) for k in kept], fed)
            return
        if len(kept) == 1 and self.valid is None:  # one row: move the kept entries up, leave no holes
            self.storage.move(self.storage.slots() - fed, kept[0])
            self._keep_first([len(kept[0])], fed)
            return
        last = max((k[-1] + 1 for k in kept if k), default=0)
        if fed > last:
            self.storage.crop(self.storage.slots() - (fed - last))
        device = self.device
        if self.valid is None:
            self.valid = torch.ones(len(kept), self.storage.slots() - last, dtype=torch.bool, device=device)
        new = [[False] * last for _ in kept]  # built on the host: one tensor, not one write per row
        for row, k in zip(new, kept, strict=True):
            for i in k:
                row[i] = True
        self.valid = torch.cat([self.valid, torch.tensor(new, dtype=torch.bool, device=self.valid.device)], dim=1)
        self.lengths = [n + len(k) for n, k in zip(self.lengths, kept, strict=True)]

    def _keep_first(self, keep: Sequence[int], fed: int) -> None:
        """After a forward wrote `fed` slots for every row, keep the first `keep[r]` of row r:
        the slots no row keeps are cropped, the rest of the rejected ones become holes."""
        most = max(keep)
        if fed > most:
            self.storage.crop(self.storage.slots() - (fed - most))
        self.lengths = [n + k for n, k in zip(self.lengths, keep, strict=True)]
        if self.valid is None and all(k == most for k in keep):
            return  # still dense: nothing to record
        if self.valid is None:
            self.valid = torch.ones(len(keep), self.storage.slots() - most, dtype=torch.bool, device=self.device)
        keep_t = torch.tensor(keep, device=self.valid.device)
        new = torch.arange(most, device=self.valid.device)[None, :] < keep_t[:, None]  # (B, most)
        self.valid = torch.cat([self.valid, new], dim=1)

    def rewind(self, drop: Sequence[int]) -> None:
        """Forget row r's last `drop[r]` entries (a drafter's rejected drafts, each a kept one)."""
        most = max(drop, default=0)
        if most == 0:
            return
        if self.valid is not None:
            if not bool(self.valid[:, -most:].all()):
                raise ValueError("rewind: the entries to forget must be the rows' last slots")
            self.valid = self.valid[:, :-most]
        # un-count the last `most` entries, then keep the first most - drop[r] of them per row
        self.lengths = [n - most for n in self.lengths]
        self._keep_first([most - d for d in drop], fed=most)

    # -- rows leaving and joining

    def close(self, rows: Sequence[int]) -> None:
        """These rows leave. The others stay in order, except that rows from the end take the
        leavers' places (the storage copies one row per row that left)."""
        gone = set(rows)
        stay = [i for i, r in enumerate(self.ids) if r not in gone]
        n, staying = len(stay), set(stay)
        movers = iter(i for i in stay if i >= n)
        order = [j if j in staying else next(movers) for j in range(n)]
        self.storage.select(order)
        self.ids = [self.ids[i] for i in order]
        self.lengths = [self.lengths[i] for i in order]
        if self.valid is not None:
            self.valid = self.valid[torch.tensor(order, device=self.valid.device)]
        self.maybe_compact()

    def join(self, other: Batch) -> None:
        """Append `other`'s rows after these (new rows joining a running batch). Every entry keeps
        its slot; the part with fewer slots is padded with hidden entries, these rows after their
        entries and `other`'s before theirs: positions are logical, so every row reads as before."""
        S, S2 = self.storage.slots(), other.storage.slots()
        end = max(S, S2)
        device = self.device if self.valid is not None else other.device
        masks = []
        for part, pad_after in ((self, True), (other, False)):  # (B, end) validity of each, padded
            valid = part.valid
            if valid is None:
                valid = torch.ones(len(part.ids), part.storage.slots(), dtype=torch.bool, device=device)
            pad = torch.zeros(valid.shape[0], end - valid.shape[1], dtype=torch.bool, device=device)
            masks.append(torch.cat([valid.to(device), pad] if pad_after else [pad, valid.to(device)], dim=1))
        self.storage.join(other.storage)
        valid = torch.cat(masks)  # (B + B', end)
        self.valid = None if bool(valid.all()) else valid
        self.ids += other.ids
        self.lengths += other.lengths

    def maybe_compact(self) -> bool:
        """Compact when holes and padding waste enough of the cache; returns whether it did."""
        if self.valid is None:
            return False
        S, longest = self.storage.slots(), max(self.lengths)
        waste = S - longest
        if waste < COMPACT_MIN_WASTE or waste < COMPACT_WASTE_FRACTION * S:
            return False
        self.compact()
        return True

    def compact(self) -> None:
        """Gather every row's valid entries, in order, into a left-padded cache of the longest
        row's length: the holes go, the positions (logical) are unchanged."""
        assert self.valid is not None
        S_new = max(self.lengths)
        # a stable sort on validity puts each row's invalid entries first and its valid ones last,
        # in their original order; the last S_new columns are then exactly what is kept
        order = torch.sort(self.valid.to(torch.int8), dim=1, stable=True).indices  # (B, S)
        self.storage.gather(order[:, -S_new:])
        lengths = torch.tensor(self.lengths, device=self.valid.device)
        self.valid = torch.arange(S_new, device=self.valid.device)[None, :] >= (S_new - lengths)[:, None]
        if bool(self.valid.all()):
            self.valid = None


def left_pad(prompts: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of different lengths as left-padded token ids and attention mask (B, T), on
    `device`; a ValueError for an empty prompt."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every row opens with a prompt of at least one token")
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
        mask[r, width - len(p) :] = 1
    return ids.to(device), mask.to(device)


def tree_layout(parents: Sequence[Sequence[int]], width: int) -> tuple[list[list[int]], list[list[list[bool]]]]:
    """Per row, each fed token's depth and the (width, width) ancestor mask of its tree (row i
    marks token i's ancestors and itself), padded to `width`: a pad token repeats the row's last
    depth and sees only itself."""
    depths, masks = [], []
    for row in parents:
        depth, mask = [], []
        for i, p in enumerate(row):
            depth.append(0 if p < 0 else depth[p] + 1)
            line = list(mask[p]) if p >= 0 else [False] * width
            line[i] = True
            mask.append(line)
        for i in range(len(row), width):
            depth.append(depth[-1])
            mask.append([j == i for j in range(width)])
        depths.append(depth)
        masks.append(mask)
    return depths, masks


class BatchedSession:
    """`protocol.Session` over one `Batch`: the verbs, given a subclass's prefill and forward
    (`_prefill`, `_forward`), for runtimes whose rows share one rectangular cache."""

    def __init__(self, runtime) -> None:
        self.runtime = runtime  # its `forwards` counts this session's forwards too
        self.device = runtime.device
        self.batch: Batch | None = None
        self.forwards = 0
        self._next = 0  # the next row id
        self._fed = 0  # slots the last forward wrote per row

    # -- what a subclass gives

    def _prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, hidden: bool,
                 every: bool) -> tuple[Storage, Forward]:
        raise NotImplementedError

    def _forward(self, storage: Storage, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 mask: torch.Tensor | None, *, hidden: bool) -> Forward:
        raise NotImplementedError

    # -- the protocol

    def _count(self) -> None:
        self.forwards += 1
        self.runtime.forwards += 1

    def open(self, prompts: Sequence[Sequence[int]], *, hidden: bool = False,
             every: bool = False) -> tuple[list[int], Forward]:
        input_ids, attention_mask = left_pad(prompts, self.device)
        storage, out = self._prefill(input_ids, attention_mask, hidden=hidden, every=every)
        self._count()
        lengths = attention_mask.sum(dim=1).tolist()
        valid = attention_mask.bool()
        ids = list(range(self._next, self._next + len(prompts)))
        self._next += len(prompts)
        new = Batch(storage, ids, lengths, None if bool(valid.all()) else valid)
        if self.batch is None:
            self.batch = new
        else:  # the newcomers' cache goes under the open rows' (left-padded to one length)
            self.batch.join(new)
        return ids, out

    def feed(self, rows: Sequence[int], tokens: Sequence[Sequence[int]], *,
             parents: Sequence[Sequence[int]] | None = None, hidden: bool = False) -> Forward:
        batch = self._batch()
        batch.maybe_compact()  # holes and padding gathered away when they waste enough of the cache
        order = batch.order(rows)
        if order is not None:  # into the cache's order, and the logits back into the caller's
            inverse = [0] * len(order)
            for caller, i in enumerate(order):
                inverse[i] = caller
            tokens = [tokens[c] for c in inverse]
            parents = None if parents is None else [parents[c] for c in inverse]
        fed = [len(t) for t in tokens]
        if min(fed) < 1:
            raise ValueError("every fed row needs at least one token")
        width = max(fed)
        # a row fed fewer tokens is padded with its last one, at its last position: never kept
        input_ids = torch.tensor([list(t) + [t[-1]] * (width - len(t)) for t in tokens], device=self.device)
        if parents is None:
            position_ids, mask = batch.chain(fed, width, self.device)
        else:
            for row in parents:
                check_tree(row)
            depth, own = tree_layout(parents, width)
            position_ids, mask = batch.tree(torch.tensor(depth, device=self.device),
                                            torch.tensor(own, device=self.device))
        out = self._forward(batch.storage, input_ids, position_ids, mask, hidden=hidden)
        self._count()
        self._fed = width
        if order is not None:
            index = torch.tensor(order, device=out.logits.device)
            out = Forward(out.logits.index_select(0, index),
                          None if out.hidden is None else out.hidden.index_select(0, index))
        return out

    def keep(self, rows: Sequence[int], kept: Sequence[Sequence[int]]) -> None:
        batch = self._batch()
        order = batch.order(rows)
        if order is not None:
            by_row = dict(zip(rows, kept, strict=True))
            kept = [by_row[r] for r in batch.ids]
        batch.keep([list(k) for k in kept], fed=self._fed)
        self._fed = 0

    def rewind(self, rows: Sequence[int], lengths: Sequence[int]) -> None:
        batch = self._batch()
        target = dict(zip(rows, lengths, strict=True))
        batch.rewind([n - target.get(r, n) for r, n in zip(batch.ids, batch.lengths, strict=True)])

    def close(self, rows: Sequence[int]) -> None:
        if self.batch is None or not rows:
            return
        if set(rows) >= set(self.batch.ids):
            self.batch = None  # nothing open: the cache goes
            return
        self.batch.close(rows)

    def rows(self) -> list[int]:
        return [] if self.batch is None else list(self.batch.ids)

    def length(self, row: int) -> int:
        batch = self._batch()
        return batch.lengths[batch.ids.index(row)]

    def tree_leaves(self, rows: Sequence[int]) -> list[int | None]:
        return [None] * len(rows)  # a tree is a mask here: any number of leaves

    def _batch(self) -> Batch:
        if self.batch is None:
            raise ValueError("no row is open in this session")
        return self.batch
