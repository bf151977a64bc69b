"""The verbs a decoder needs of the forward it runs on, in the terms of llama.cpp's sequences
and vLLM's requests rather than of transformers' cache.

A `Runtime` is a model on one forward implementation: its vocabulary, its position limit,
which forward it is and why. Decoding happens in a `Session` of it (`runtime.session()`): a set
of *rows*, one token sequence each, named by ids the session gives out (llama.cpp's sequence
ids), that its forwards feed together; two decoders on one model each have their own. Every
verb takes row ids and token ids; nothing here is a tensor the caller must shape, except the
logits it gets back.

- `open(prompts)` starts one row per prompt, prefilled in one forward; the logits after each
  prompt's last token come back (after every prompt token, with `every`).
- `feed(rows, tokens, parents)` is one forward: each row is fed its tokens, which continue its
  sequence. Fed as a chain (`parents=None`) token i follows token i - 1; fed as a *tree*,
  `parents[b][i]` is the index of token i's parent among the fed tokens (-1: the row's last
  kept token), so several drafts sharing a prefix are verified at once (token i sits at the
  position after its parent and sees its ancestors only). The logits after every fed token
  come back, and the last hidden state where the runtime offers it (`hidden`).
- `keep(rows, kept)` after a feed: each row keeps the fed entries `kept[b]` (a chain from its
  first fed token, as indices into what it was fed) and the session forgets the others.
- `rewind(rows, lengths)` forgets every entry of a row past `lengths[b]` tokens (a drafter's
  rejected drafts).
- `close(rows)` ends rows; their entries are freed.
- `tree_leaves(rows)`: per row of `rows` fed together, how many leaves its tree may have
  (None: any; a runtime whose trees cost it a resource per leaf says so; 1: a chain only).

How entries are stored (a rectangular cache with holes, a paged cache, llama.cpp's sequences)
is each runtime's business: a decoder never sees it. `rows()` gives the open rows in the order
the session keeps them, the order a batched session is fed fastest in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass
class Forward:
    """What a forward gives back: the logits after each fed token and, when asked and offered,
    the last hidden state (the final norm's output, what the LM head reads) at each."""

    logits: torch.Tensor  # (B, L, V): row b's first len(tokens[b]) positions are its; the rest is padding
    hidden: torch.Tensor | None = None  # (B, L, H)


@runtime_checkable
class Session(Protocol):
    """Rows decoding together on one runtime (module docstring)."""

    forwards: int  # forwards run so far (every `open` and `feed`)

    def open(self, prompts: Sequence[Sequence[int]], *, hidden: bool = False,
             every: bool = False) -> tuple[list[int], Forward]:
        """New rows, one per prompt (at least one token each), prefilled in one forward: their
        ids, and the logits (B, 1, V) after each prompt's last token, or (`every`) (B, T, V)
        after each of its tokens, the prompts left-padded to the longest."""
        ...

    def feed(self, rows: Sequence[int], tokens: Sequence[Sequence[int]], *,
             parents: Sequence[Sequence[int]] | None = None, hidden: bool = False) -> Forward:
        """One forward over every open row (`rows`, in any order), each fed `tokens[b]` (at least
        one) as a chain, or as the tree `parents[b]` says; logits (B, L, V) in `rows`' order."""
        ...

    def keep(self, rows: Sequence[int], kept: Sequence[Sequence[int]]) -> None:
        """After `feed`: row rows[b] keeps its fed entries `kept[b]` (increasing indices, a chain
        from index 0, possibly empty); the others are forgotten."""
        ...

    def rewind(self, rows: Sequence[int], lengths: Sequence[int]) -> None:
        """Row rows[b] forgets its entries past its first `lengths[b]` tokens."""
        ...

    def close(self, rows: Sequence[int]) -> None:
        """End these rows and free their entries."""
        ...

    def rows(self) -> list[int]:
        """The open rows, in the order the session keeps them."""
        ...

    def length(self, row: int) -> int:
        """The tokens in a row's sequence (the position its next token takes)."""
        ...

    def tree_leaves(self, rows: Sequence[int]) -> list[int | None]:
        """Per row of `rows` (fed together), how many leaves its tree may have (None: any; 1: a
        chain only). llama.cpp's runtime holds a sequence per leaf while a tree is fed, and a row
        in a stream of its own verifies chains."""
        ...


@runtime_checkable
class Runtime(Protocol):
    """A model on one forward implementation (module docstring). `cllm.runtime.hf`'s
    `TransformersRuntime` (any transformers causal LM) and `cllm.runtime.lean`'s `LeanRuntime`
    (the Llama family, the engine's own forward) are the two here."""

    name: str  # "transformers", "lean", ...
    vocab_size: int  # logits per position
    position_limit: int | None  # the longest sequence its positions cover, when known
    device: torch.device  # where its logits are
    offers_hidden: bool  # whether `hidden=True` gives the last hidden state
    forwards: int  # forwards run by all its sessions so far
    # what a forward of k fed tokens (one row) costs here, in one-token forwards: step_costs[k - 1]
    # (`cllm.runtime.stepcost`, set by `load_for_decoding`); None: not measured (a fixed width)
    step_costs: tuple[float, ...] | None
    # whether a forward's logits for a token equal, but for their last bits, those of a forward
    # feeding that token alone (float32 torch forwards; llama.cpp with f32 weights and cache):
    # where not, greedy decoding with `exact` feeds one token per forward
    batch_invariant: bool

    def session(self) -> Session:
        """A new session, with no row open."""
        ...

    def prepare(self) -> None:
        """Ready the forward before the first request (kernels, plans), where there is any."""
        ...

    def compile(self, *, batches: bool = True) -> str | None:
        """Build a compiled forward (`batches`: for batches of rows too); None when it runs, else
        why not."""
        ...

    def describe(self) -> str:
        """Which forward this is and why, in a line (`cllm generate -v`)."""
        ...


def check_tree(parents: Sequence[int]) -> None:
    """A ValueError unless `parents` is a tree over its tokens as `Session.feed` takes it: each
    token's parent an earlier token, or -1."""
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"fed token {i}'s parent is {p}: a parent must be an earlier fed token, or -1")


def position_limit(model) -> int | None:
    """The longest sequence a model's position embeddings cover, when known: a runtime's
    `position_limit`, or what a transformers model's config says."""
    if not isinstance(model, torch.nn.Module) and hasattr(model, "position_limit"):
        return model.position_limit
    config = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions"):
        limit = getattr(config, name, None)
        if isinstance(limit, int) and limit > 0:
            return limit
    return None
