"""The lean runner's KV cache: one keys and one values buffer per layer, preallocated and grown
geometrically, addressed by slot. It is a `cllm.runtime.rows.Storage`: the rows' bookkeeping
(which slots each row may read, holes, compaction) is `rows.Batch`'s; here are only the copies
it asks for and the writes of the runner's forwards.
"""

from __future__ import annotations

from typing import Any

import torch

GROWTH = 256  # cache slots reserved beyond what a forward needs when the buffers grow


class LeanKV:
    """Per layer a keys and a values buffer (rows, H_kv, capacity, D), both dimensions grown
    geometrically: the first `rows` rows are the batch, and `length[w][i]` slots of buffer w
    (0: keys, 1: values) of layer i are in use (equal between operations). Rows leaving and
    joining move only the rows concerned (`batch_select_indices`, `join`)."""

    def __init__(self, layers: int, batch: int, heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device, buffers: list | None = None) -> None:
        shape = (batch, heads, capacity, head_dim)
        # `buffers`: a freed cache's, reused (their contents are past slots nobody reads)
        self.buffers = buffers or [[torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)]
                                   for _ in range(2)]
        self.length = [[0] * layers, [0] * layers]
        self.rows = batch
        self.graphs: Any = None  # a `graphs.GraphSet`: the CUDA graphs of its forwards, once one is captured

    def get_seq_length(self, layer: int = 0) -> int:
        return self.length[0][layer]

    # -- `rows.Storage`

    def slots(self) -> int:
        return self.length[0][0]

    def crop(self, slots: int) -> None:
        for lengths in self.length:
            lengths[:] = [min(n, slots) for n in lengths]

    def gather(self, index: torch.Tensor) -> None:
        """Row b keeps slots `index[b]` (B, S') in that order."""
        B, S_new = index.shape
        for which, buffers in enumerate(self.buffers):
            for i, buffer in enumerate(buffers):
                H, D = buffer.shape[1], buffer.shape[3]
                idx = index.to(buffer.device)[:, None, :, None].expand(B, H, S_new, D)
                buffer[:B, :, :S_new] = buffer[:B, :, : self.length[which][i]].gather(2, idx)
                self.length[which][i] = S_new

    def move(self, base: int, kept) -> None:
        """One row: slot base + kept[j] copied to base + j, every layer."""
        for buffers in self.buffers:
            for buffer in buffers:
                index = torch.tensor(list(kept), device=buffer.device) + base
                buffer[: self.rows, :, base : base + len(kept)] = buffer[: self.rows].index_select(2, index)

    def select(self, rows) -> None:
        self.batch_select_indices(torch.tensor(list(rows)))

    def view(self, which: int, i: int) -> torch.Tensor:
        return self.buffers[which][i][: self.rows, :, : self.length[which][i]]

    def _room(self, which: int, i: int, rows: int, slots: int) -> torch.Tensor:
        """Buffer w of layer i, reallocated (its used part copied) when it has fewer than `rows`
        rows or `slots` slots."""
        buffer = self.buffers[which][i]
        R, H, S, D = buffer.shape
        if rows <= R and slots <= S:
            return buffer
        rows, slots = (R if rows <= R else max(rows, 2 * R)), (S if slots <= S else max(2 * S, slots + GROWTH))
        grown = buffer.new_empty((rows, H, slots, D))
        used = min(self.rows, R)
        grown[:used, :, : self.length[which][i]] = buffer[:used, :, : self.length[which][i]]
        self.buffers[which][i] = grown
        return grown

    def batch_select_indices(self, index: torch.Tensor) -> None:
        """Keep batch rows `index`, in that order. In place when no row is read after it was
        overwritten (kept rows in order, or rows from the end filling the gaps: only the rows
        that move are copied); otherwise through a copy of the kept rows."""
        rows = index.tolist()
        written: set[int] = set()
        moves = []
        for j, r in enumerate(rows):
            if r in written:
                moves = None
                break
            if r != j:
                moves.append((j, r))
                written.add(j)
        for which, buffers in enumerate(self.buffers):
            for i, buffer in enumerate(buffers):
                used = self.length[which][i]
                if moves is None:
                    kept = buffer[:, :, :used].index_select(0, index.to(buffer.device))
                    buffer[: len(rows), :, :used] = kept
                    continue
                for j, r in moves:
                    buffer[j, :, :used] = buffer[r, :, :used]
        self.rows = len(rows)

    def join(self, other: LeanKV) -> None:
        """Append `other`'s rows after these (new rows joining a running batch). Every entry keeps
        its slot; the part with fewer slots is padded with zeros, which the adapter's mask hides:
        these rows after their entries (nothing of theirs moves), `other`'s before theirs."""
        B, B2 = self.rows, other.rows
        for which in (0, 1):
            for i in range(len(self.buffers[which])):
                S, S2 = self.length[which][i], other.length[which][i]
                end = max(S, S2)
                buffer = self._room(which, i, B + B2, end)
                buffer[:B, :, S:end] = 0
                buffer[B : B + B2, :, : end - S2] = 0
                buffer[B : B + B2, :, end - S2 : end] = other.view(which, i)
                self.length[which][i] = end
        self.rows = B + B2

    def reserve(self, rows: int, slots: int) -> None:
        """Room in every buffer for `rows` batch rows and `slots` slots (the compiled forward
        writes into the buffers itself)."""
        for which, buffers in enumerate(self.buffers):
            for i in range(len(buffers)):
                self._room(which, i, rows, slots)

    def zero_unused(self) -> None:
        """Zero every slot past the used ones and every row past the batch, in every buffer (a
        forward attending over the whole capacity then meets no garbage; `graphs`)."""
        for which, buffers in enumerate(self.buffers):
            for i, buffer in enumerate(buffers):
                buffer[:, :, self.length[which][i] :].zero_()
                buffer[self.rows :].zero_()

    def extend(self, slots: int) -> None:
        """Count `slots` more slots as in use in every buffer: a compiled forward wrote them."""
        for lengths in self.length:
            lengths[:] = [n + slots for n in lengths]

    def append(self, i: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new (B, H, L, D) entries after layer i's used slots; returns every slot in use."""
        for which, new in ((0, keys), (1, values)):
            start = self.length[which][i]
            end = start + new.shape[2]
            self._room(which, i, self.rows, end)[: self.rows, :, start:end] = new
            self.length[which][i] = end
        return self.view(0, i), self.view(1, i)
