"""An n-gram table of a model's own greedy continuations: drafts that cost no forward pass.

A model decoded greedily keeps writing the same few continuations after the same few tokens
(`    return`, `self.`, a loop header...). Counting, over many of its own greedy completions,
which token followed each context of 4 (else 3, else 2) tokens gives a table whose chained look-ups
guess several tokens ahead, without a forward pass. Jacobi decoding uses those guesses as
drafts (a block's initial guess, and one more recycled branch); every draft is verified by the
model, so the output stays greedy's whatever the table says. The table only moves speed.

Kept: per context, its most frequent next token if it followed the context at least `min_count`
times and in at least `min_share` of them (rarer or split contexts are wrong too often to be
worth a fed token).

Storage: one safetensors file, per order o a (N_o, o) int32 tensor of contexts and an (N_o,)
int32 tensor of next tokens, plus JSON metadata (what it was built from). Token ids only: the
table knows nothing of tokenizers or models.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from cllm.core.outputs import replacing

ORDERS = (4, 3, 2)  # context lengths, longest first: a longer context is right more often
FORMAT = "cllm-ngram-drafts/1"


@dataclass
class DraftTable:
    """Per context (a tuple of `order` token ids): the token the model wrote next most often."""

    orders: tuple[int, ...]
    next_token: dict[tuple[int, ...], int]
    meta: dict = field(default_factory=dict)  # what it was built from (written with it)

    def __len__(self) -> int:
        return len(self.next_token)

    @functools.cached_property
    def max_token_id(self) -> int:
        """The largest token id in the table (-1 when empty): a model whose vocabulary does not
        reach it cannot decode with the table."""
        return max((max(*ctx, nxt) for ctx, nxt in self.next_token.items()), default=-1)

    def continuation(self, history: Sequence[int], count: int) -> list[int]:
        """Up to `count` tokens after `history`: the table's next token for its longest known
        context, appended, and again; stops at the first context the table does not hold."""
        out: list[int] = []
        tail = list(history[-max(self.orders) :])
        while len(out) < count:
            for o in self.orders:
                token = self.next_token.get(tuple(tail[-o:])) if len(tail) >= o else None
                if token is not None:
                    break
            if token is None:
                break
            out.append(token)
            tail = (tail + [token])[-max(self.orders) :]
        return out

    @classmethod
    def build(cls, sequences: Iterable[Sequence[int]], *, orders: Sequence[int] = ORDERS, min_count: int = 2,
              min_share: float = 0.3, meta: dict | None = None) -> DraftTable:
        """Count, in every sequence, which token follows each context of each order."""
        if not orders or any(o < 1 for o in orders):
            raise ValueError(f"orders must be ints >= 1, got {orders!r}")
        seqs = [torch.tensor(list(s), dtype=torch.int64) for s in sequences]
        table: dict[tuple[int, ...], int] = {}
        for o in sorted(set(orders), reverse=True):
            windows = [s.unfold(0, o + 1, 1) for s in seqs if len(s) > o]  # (N_s, o + 1) each
            if windows:
                table.update(_most_frequent_next(torch.cat(windows), min_count, min_share))
        meta = {**(meta or {}), "min_count": min_count, "min_share": min_share}
        return cls(tuple(sorted(set(orders), reverse=True)), table, meta)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for o in self.orders:
            items = [(ctx, nxt) for ctx, nxt in self.next_token.items() if len(ctx) == o]
            tensors[f"contexts_{o}"] = torch.tensor([c for c, _ in items], dtype=torch.int32).reshape(-1, o)
            tensors[f"next_{o}"] = torch.tensor([n for _, n in items], dtype=torch.int32)
        meta = {"format": FORMAT, "orders": list(self.orders), **self.meta}
        with replacing(path) as tmp:  # never a half-written table under the real name
            save_file(tensors, str(tmp), metadata={"cllm": json.dumps(meta)})
        return path

    @staticmethod
    def read_meta(path: str | Path) -> dict:
        """A table file's metadata (what it was built from), without reading its tensors."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"draft table not found: {path}")
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("cllm", "{}"))
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path} is not a cllm draft table (format {meta.get('format')!r})")
        return meta

    @classmethod
    def load(cls, path: str | Path) -> DraftTable:
        """The table saved at `path`; a file whose tensors are not what `save` writes (shapes,
        orders, negative ids) is a ValueError naming what is wrong."""
        meta = cls.read_meta(path)
        tensors = load_file(str(path))
        orders = meta.get("orders")
        if not isinstance(orders, list) or not orders or not all(isinstance(o, int) and o >= 1 for o in orders):
            raise ValueError(f"its orders are {orders!r}, not a list of ints >= 1")
        table: dict[tuple[int, ...], int] = {}
        for o in orders:
            contexts, nexts = tensors.get(f"contexts_{o}"), tensors.get(f"next_{o}")
            if contexts is None or nexts is None or contexts.dim() != 2 or nexts.dim() != 1 or \
                    contexts.shape != (len(nexts), o) or contexts.is_floating_point() or nexts.is_floating_point():
                raise ValueError(f"its order-{o} tensors are not (N, {o}) contexts and (N,) next tokens of ids")
            if len(nexts) and min(int(contexts.min()), int(nexts.min())) < 0:
                raise ValueError("it holds negative token ids")
            table.update(zip(map(tuple, contexts.tolist()), nexts.tolist(), strict=True))
        orders = tuple(orders)
        meta = {k: v for k, v in meta.items() if k not in ("format", "orders")}
        return cls(orders, table, meta)


def _most_frequent_next(windows: torch.Tensor, min_count: int, min_share: float) -> dict[tuple[int, ...], int]:
    """windows (N, o + 1): context then next token. Per context, its most frequent next token,
    if that followed it `min_count`+ times and in `min_share` of the context's occurrences."""
    pairs, pair_count = torch.unique(windows, dim=0, return_counts=True)  # (P, o + 1), (P,)
    contexts, group = torch.unique(pairs[:, :-1], dim=0, return_inverse=True)  # (C, o), (P,)
    total = torch.zeros(len(contexts), dtype=torch.int64).index_add_(0, group, pair_count)  # (C,)
    # the best pair of each context: sort by count (descending), then stably by context
    order = torch.sort(pair_count, descending=True, stable=True).indices
    order = order[torch.sort(group[order], stable=True).indices]
    first = torch.ones(len(order), dtype=torch.bool)
    first[1:] = group[order][1:] != group[order][:-1]
    best = order[first]  # one pair per context, in context order
    count, ctx_total = pair_count[best], total[group[best]]
    keep = (count >= min_count) & (count >= min_share * ctx_total)
    kept = pairs[best][keep]
    return {tuple(row[:-1]): row[-1] for row in kept.tolist()}
