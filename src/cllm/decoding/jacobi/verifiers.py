"""Verifiers: one batched forward over what the rows feed, and what each row keeps of it.

A verifier's `step(model, rc, rows, cfg, stats)` feeds every row's tokens in one forward through
the cache adapter, decides per row which fed tokens are final, moves the row (`state.advance`)
and keeps exactly those tokens' KV entries (`cache.commit` / `cache.commit_kept`):

- `LinearVerifier`: each row feeds its tail causally. Greedy: a token is final when every token
  before it is and it equals the argmax predicted for it (`rule.accepted_length`). Sampling:
  speculative sampling's acceptance (`sampling.verify_drafts`), which keeps the law exact.
- `TreeVerifier` (greedy recycling): each row feeds its tail and the tree drafters' branches as
  one token trie (`TokenTrie`) under a tree attention mask; the longest path whose tokens all
  equal their predictions is final, and the branch it lies on becomes the tail.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

import cllm.runtime.hf_cache as kv
from cllm.decoding.jacobi.drafters import branches
from cllm.decoding.jacobi.state import Row, Settings, advance, isolated, last_token, set_drafts, swap_in_draft, tail
from cllm.decoding.sampling import verify_drafts
from cllm.decoding.stats import DecodeStats
from cllm.runtime.lean import runner as lean


class Verifier(Protocol):
    def step(self, model: torch.nn.Module, rc: kv.RowCache, rows: list[Row], cfg: Settings,
             stats: DecodeStats) -> None:
        """One batched forward in which every row of `rows` (all unfinished) advances."""
        ...


def choose_verifier(cfg: Settings) -> Verifier:
    return TreeVerifier() if cfg.drafters.tree else LinearVerifier()


class LinearVerifier:
    """Every row feeds its tail; the accepted prefix is kept (greedy or speculative sampling)."""

    def step(self, model: torch.nn.Module, rc: kv.RowCache, rows: list[Row], cfg: Settings,
             stats: DecodeStats) -> None:
        if cfg.drafters.swap is not None:  # sampling with recycling: a pool draft replaces the Jacobi drafts
            isolated(rows, lambda r, row: swap_in_draft(row, cfg), lambda row: None)
        # 1. right-pad the tails to the longest (the pad repeats a real token and is masked);
        # a row that fails (here or below) feeds its last token and keeps nothing
        tails = isolated(rows, lambda r, row: tail(row), last_token)
        fed = [len(t) for t in tails]
        width = max(fed)
        ids = torch.tensor([t + t[-1:] * (width - len(t)) for t in tails], device=cfg.device)  # (B, L)
        # 2. forward, argmax at every fed position: the one device sync of the iteration
        logits = kv.feed(model, rc, ids, fed)  # (B, L, V)
        stats.forward_passes += 1
        stats.fed.append(width)
        if cfg.sampling is None:
            outputs = lean.argmax(logits).tolist()
            # 3. each row accepts what it can; the cache keeps exactly the accepted entries
            keep = isolated(rows, lambda r, row: advance(row, outputs[r][: fed[r]], cfg, stats), lambda row: 0)
        else:
            probs = cfg.sampling.probs(logits)  # (B, L, V)

            def accept(r: int, row: Row) -> int:
                block = row.block
                laws = block.laws[block.committed :] if block is not None else []
                out, _, fresh = verify_drafts(tails[r], laws, probs[r, : fed[r]], row.generator)
                return advance(row, out, cfg, stats, fresh)

            keep = isolated(rows, accept, lambda row: 0)
        kv.commit(rc, keep, fed=width)


class TreeVerifier:
    """Per row, the Jacobi tail and the tree drafters' branches as one token trie (shared
    prefixes fed once); the longest verified path is final, its KV entries are kept."""

    def step(self, model: torch.nn.Module, rc: kv.RowCache, rows: list[Row], cfg: Settings,
             stats: DecodeStats) -> None:
        def trie_of(r: int, row: Row) -> tuple[TokenTrie, list[str]]:
            t = tail(row)
            drafts, kinds = [], []
            # a draft may reach past the tail (its surplus rides as drafts of the next block);
            # between blocks (the tail is the last final token alone) drafts start the next
            # block, unless blocks in flight already hold its drafts; none are looked for when
            # the budget has no room left after the tail (the trie would add none of them)
            room = cfg.recycle_budget is None or len(t) < cfg.recycle_budget
            if room and (row.block is not None or cfg.blocks_in_flight == 1):
                width = min(cfg.recycle_width, row.max_new_tokens - len(row.known))
                drafts, kinds = branches(cfg.drafters.tree, row.context(cfg), t, width)
            return TokenTrie.build(t, drafts, cfg.recycle_budget), ["jacobi", *kinds]  # kinds: per branch

        # a row that fails (here or below) feeds its last token and keeps it alone
        built = isolated(rows, trie_of, lambda row: (TokenTrie.build(last_token(row), []), ["jacobi"]))
        tries, branch_kinds = [trie for trie, _ in built], [kinds for _, kinds in built]
        plain = all(len(trie.tokens) == len(trie.path(trie.leaves[0])) for trie in tries)  # the tails alone
        if plain:  # no draft added a token: a plain Jacobi step (causal, no tree mask to build)
            LinearVerifier().step(model, rc, rows, cfg, stats)
            return
        L = max(len(trie.tokens) for trie in tries)
        # padding repeats a row's last token and offset, sees only itself, and is never kept
        ids = torch.tensor([trie.tokens + trie.tokens[-1:] * (L - len(trie.tokens)) for trie in tries])  # (B, L)
        offsets = torch.tensor([trie.depth + trie.depth[-1:] * (L - len(trie.depth)) for trie in tries])  # (B, L)
        mask = torch.tensor([trie.ancestor_rows(L) for trie in tries])  # (B, L, L)
        logits = kv.feed_tree(model, rc, ids.to(cfg.device), offsets, mask)
        out = lean.argmax(logits).tolist()
        stats.forward_passes += 1
        stats.fed.append(L)

        def accept(r: int, row: Row) -> list[int]:
            trie = tries[r]
            accepted = trie.accepted_path(out[r])
            # the first branch (the tail's, else a draft's) the accepted path lies on: its tokens
            # become the tail, its outputs the next state
            tail_path = trie.path(trie.leaves[0])
            b, branch = next((b, p) for b, p in enumerate((tail_path, *map(trie.path, trie.leaves[1:])))
                             if accepted[-1] in p)
            outputs = [out[r][i] for i in branch] + [out[r][i] for i in tail_path[len(branch) :]]
            if row.block is None:  # between blocks: the branch's outputs draft the next block
                row.ahead = outputs
            elif b > 0:
                set_drafts(row, [trie.tokens[i] for i in branch[1:]], branch_kinds[r][b])
            advance(row, outputs, cfg, stats, accepted=len(accepted), draft_source=branch_kinds[r][b])
            return accepted

        kv.commit_kept(rc, isolated(rows, accept, lambda row: [0]), fed=L)


@dataclass
class TokenTrie:
    """The tokens one row feeds in a tree step, as a token trie rooted at the tail's first
    token: the Jacobi tail is the first branch, each draft shares the longest prefix it can
    with the branches before it and adds only the rest. Node i's parent is ``parent[i]`` (< i),
    its depth the position offset; a node attends to its ancestors (itself included)."""

    tokens: list[int]
    parent: list[int]
    depth: list[int]
    children: list[dict[int, int]]
    leaves: list[int]  # per branch (tail first, then each draft): its last node

    @classmethod
    def build(cls, tail: Sequence[int], drafts: Sequence[Sequence[int]], budget: int | None = None) -> TokenTrie:
        """The tail whole, then each draft's new tokens while the trie holds at most `budget`
        tokens (a draft's nodes past it are cut; None: no limit)."""
        trie = cls(tokens=[tail[0]], parent=[-1], depth=[0], children=[{}], leaves=[])
        for b, branch in enumerate((tail[1:], *drafts)):
            node = 0
            for token in branch:
                child = trie.children[node].get(token)
                if child is None:
                    if b > 0 and budget is not None and len(trie.tokens) >= budget:
                        break
                    child = len(trie.tokens)
                    trie.tokens.append(token)
                    trie.parent.append(node)
                    trie.depth.append(trie.depth[node] + 1)
                    trie.children.append({})
                    trie.children[node][token] = child
                node = child
            trie.leaves.append(node)
        return trie

    def ancestor_rows(self, width: int) -> list[list[bool]]:
        """The tree attention mask, `width` x `width`: row i marks node i's ancestors and itself;
        rows and columns past the trie (padding) are all False."""
        rows: list[list[bool]] = []
        for i, p in enumerate(self.parent):
            row = list(rows[p]) if p >= 0 else [False] * width
            row[i] = True
            rows.append(row)
        return rows + [[False] * width for _ in range(width - len(rows))]

    def path(self, node: int) -> list[int]:
        """The nodes from the root to `node`, in order (increasing indices)."""
        nodes = []
        while node >= 0:
            nodes.append(node)
            node = self.parent[node]
        return nodes[::-1]

    def accepted_path(self, outputs: Sequence[int]) -> list[int]:
        """Greedy verification: from the root, descend to the child holding the token predicted
        at the current node while there is one; the nodes walked (root first) are final."""
        nodes = [0]
        while (child := self.children[nodes[-1]].get(outputs[nodes[-1]])) is not None:
            nodes.append(child)
        return nodes
