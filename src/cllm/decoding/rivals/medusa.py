"""Greedy decoding with Medusa heads (Cai et al. 2024, arXiv 2401.10774): a tree of candidate
continuations verified in one forward, exactly greedy's output (docs/method.md#medusa-heads).

The heads read the backbone's last hidden state at the last verified position; head k
(k = 1..K) guesses the token k + 1 positions ahead (the LM head itself gives the next one). A
*tree* is a fixed list of paths of top-k ranks, Medusa's "medusa_choices": path (0, 2) is head
1's best token followed by head 2's third best. One step:

1. the heads' top-k tokens at the last verified position fill the tree's nodes;
2. one forward feeds the last final token (the root, not yet in the session) and every node, as
   a tree (`tree.Tree`, fed by its parent list: each node attends to its ancestors only);
3. a node is accepted when its token equals the output predicted at its parent and its parent
   is accepted (the root always is); sibling tokens differ, so the accepted nodes form one path
   (`Tree.accept`). Its tokens are final, and so is the output at its last node (predicted from
   an all-correct prefix), which is the next step's root. Every forward thus makes at least one
   token final;
4. the session keeps exactly the accepted path's entries, and the hidden state at the path's
   last node feeds the heads for the next step.

Batch 1: one prompt at a time. Token ids only; the engine knows nothing of how the heads were
trained, only that `heads(hidden)` maps (B, H) hidden states to (K, B, V) logits.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from cllm.decoding.argmax import argmax
from cllm.decoding.inputs import eos_set, finalize, prepare_prompt
from cllm.decoding.rivals.defaults import MEDUSA_NODES, MEDUSA_TOP_K
from cllm.decoding.stats import DecodeOutput, DecodeStats
from cllm.decoding.tree import Tree
from cllm.runtime import Runtime, Session, as_runtime

Path = tuple[int, ...]  # top-k ranks, one per depth: (r1, .., rd) = head 1's r1-th token, ...

DEFAULT_NODES = MEDUSA_NODES  # tree nodes verified per forward besides the root (a CPU pays for each)
DEFAULT_TOP_K = MEDUSA_TOP_K  # ranks a built tree considers per head
# How often a head's rank-r token is right, relative to its first, assumed for heads that carry
# no measured accuracies (`cllm medusa` measures and saves them; see `prior_accuracies`).
PRIOR_RANK_SHARES = (1.0, 0.25, 0.12, 0.07, 0.05, 0.04, 0.03, 0.02)


class Heads(Protocol):
    """What the decoder needs of a set of Medusa heads (`cllm.modeling.heads.MedusaHeads` is one)."""

    num_heads: int

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:  # (B, H) -> (K, B, V)
        ...


def prior_accuracies(num_heads: int) -> tuple[tuple[float, ...], ...]:
    """Assumed top-r accuracies of heads 1..K (rows) at ranks 0.. (columns), the shape Medusa-1
    reports: head 1 right 60% of the time, each head further ahead a quarter less often."""
    return tuple(tuple(0.6 * 0.75**k * share for share in PRIOR_RANK_SHARES) for k in range(num_heads))


def build_tree(accuracies: Sequence[Sequence[float]], nodes: int = DEFAULT_NODES,
               top_k: int = DEFAULT_TOP_K) -> tuple[Path, ...]:
    """The `nodes` paths most likely to be accepted, estimating a path's chance as the product
    of its ranks' accuracies (``accuracies[k - 1][r]``: how often head k's rank-r token is the
    right one). Best-first from the root, so the set is closed under prefixes. Sorted by depth,
    then ranks (the nodes of depth <= d are a prefix of the list)."""
    if nodes < 0 or top_k < 1:
        raise ValueError(f"a tree needs nodes >= 0 and top_k >= 1, got {nodes} and {top_k}")
    K = len(accuracies)
    heap = [(-float(accuracies[0][r]), (r,)) for r in range(min(top_k, len(accuracies[0])))] if K else []
    heapq.heapify(heap)
    chosen: list[Path] = []
    while heap and len(chosen) < nodes:
        score, path = heapq.heappop(heap)
        chosen.append(path)
        if len(path) < K:
            row = accuracies[len(path)]
            for r in range(min(top_k, len(row))):
                heapq.heappush(heap, (score * float(row[r]), (*path, r)))
    return tuple(sorted(chosen, key=lambda p: (len(p), p)))


def check_tree(paths: Iterable[Sequence[int]], num_heads: int) -> tuple[Path, ...]:
    """Paths as a valid tree: each path's prefixes added, duplicates dropped, depth-sorted.
    A path deeper than the heads or with a negative rank is a ValueError."""
    closed: set[Path] = set()
    for path in paths:
        path = tuple(int(r) for r in path)
        if not path or len(path) > num_heads or min(path) < 0:
            raise ValueError(f"tree path {path} must hold 1 to {num_heads} ranks >= 0 (one per head)")
        closed.update(path[:d] for d in range(1, len(path) + 1))
    return tuple(sorted(closed, key=lambda p: (len(p), p)))


@dataclass(frozen=True)
class TreeLayout:
    """Where a tree's nodes take their tokens from. Node 0 is the root (the last final token);
    node i > 0 is ``paths[i-1]``, whose token is head `depth[i]`'s rank-`rank[i]` guess.
    Depth-sorted, so the first `nodes_within(d)` nodes are the tree cut at depth d."""

    paths: tuple[Path, ...]
    parent: list[int]  # parent[0] = -1 (`tree.Tree`'s parent list)
    depth: torch.Tensor  # (L,) long: the head a node's token comes from (root: 0)
    rank: torch.Tensor  # (L,) long: the top-k rank it takes from that head (root: 0)

    @classmethod
    def from_paths(cls, paths: Sequence[Path]) -> TreeLayout:
        index = {p: i + 1 for i, p in enumerate(paths)}
        return cls(paths=tuple(paths), parent=[-1] + [index.get(p[:-1], 0) for p in paths],
                   depth=torch.tensor([0] + [len(p) for p in paths]),
                   rank=torch.tensor([0] + [p[-1] for p in paths]))

    @property
    def max_rank(self) -> int:
        return 1 + max((p[-1] for p in self.paths), default=0)

    def nodes_within(self, depth: int) -> int:
        """Nodes of depth <= `depth`, the root included."""
        return 1 + sum(len(p) <= depth for p in self.paths)

    def to(self, device: torch.device | str) -> TreeLayout:
        return replace(self, depth=self.depth.to(device), rank=self.rank.to(device))


def verify_tree(session: Session, row: int, tree: Tree, stats: DecodeStats, eos: frozenset[int],
                known: list[int], budget: int) -> tuple[torch.Tensor, list[int], list[int], bool]:
    """One target forward over `tree` (its root the row's last final token), each node seeing its
    ancestors; the accepted path's entries stay in the session, and the output after its last
    node is final too. Returns the hidden states at the fed nodes (1, L, H), the path (node
    indices, root first), the new final tokens (appended to `known`, cut at EOS or the
    `budget`), and whether decoding is done."""
    out = session.feed([row], [tree.tokens], parents=[tree.parent], hidden=True)
    stats.forward_passes += 1
    stats.fed.append(len(tree.tokens))
    outputs = argmax(out.logits[0]).tolist()  # (L,)
    path = tree.accept(outputs)
    session.keep([row], [path])
    new = [tree.tokens[i] for i in path[1:]] + [outputs[path[-1]]]
    kept, done = finalize(known, new, eos, budget)
    stats.count(0, kept)
    return out.hidden, path, new[:kept], done


def medusa_steps(
    model: torch.nn.Module | Runtime,
    heads: Heads,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    layout: TreeLayout,
    *,
    max_new_tokens: int,
    eos: frozenset[int],
    stats: DecodeStats,
) -> Iterator[list[int]]:
    """The decode loop as a generator: yields the tokens each forward made final (the prefill's
    first token, then each step's accepted path + the output after it), cut at EOS or the
    budget. Counts into `stats`. The caller may stop early with `break`."""
    runtime = as_runtime(model)
    prompt = prepare_prompt(runtime, input_ids, attention_mask, max_new_tokens)
    if prompt.batch_size != 1:
        raise ValueError(f"medusa_decode decodes one prompt at a time (batch 1), got {prompt.batch_size} rows")
    if max_new_tokens == 0:
        return
    # 1. prefill: the last logits give the first token, the last hidden state the first guesses
    session = runtime.session()
    (row,), out = session.open(prompt.rows, hidden=True)
    stats.forward_passes += 1
    known: list[int] = []
    root, hidden = int(argmax(out.logits[0, -1])), out.hidden[:, -1]  # hidden: (1, H)
    done = finalize(known, [root], eos, max_new_tokens)[1]
    stats.count(0, 1)
    yield [root]
    layout = layout.to(hidden.device)
    try:
        while not done:
            # 2. candidates: head k's top-r tokens at the last verified position fill depth k; the
            #    tree is cut where its tokens could only pass the budget (so positions stay in range)
            L = layout.nodes_within(max_new_tokens - len(known) - 1)
            tokens = [root]
            if L > 1:
                top = heads(hidden)[:, 0].topk(layout.max_rank, dim=-1).indices  # (K, R)
                tokens += top[layout.depth[1:L] - 1, layout.rank[1:L]].tolist()
            # 3. one forward over root + tree verifies it; the accepted path and the output after it are final
            tree = Tree.from_parents(tokens, layout.parent[:L])
            hiddens, path, new, done = verify_tree(session, row, tree, stats, eos, known, max_new_tokens)
            yield new
            root, hidden = new[-1], hiddens[:, path[-1]]
    finally:
        session.close([row])


@torch.inference_mode()
def medusa_decode(
    model: torch.nn.Module | Runtime,
    heads: Heads,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    tree: int | Sequence[Sequence[int]] | None = None,
    top_k: int = DEFAULT_TOP_K,
    max_new_tokens: int = 128,
    eos_token_id: int | Iterable[int] | None = None,
) -> DecodeOutput:
    """Greedy decoding sped up by Medusa heads: the same tokens as `greedy_decode`, fewer forwards.

    Args:
        model: a causal LM (any transformers `*ForCausalLM`) or a runtime offering hidden states.
        heads: maps the last hidden state (B, H) to (K, B, V) logits, head k guessing the token
            k + 1 positions ahead (`cllm.modeling.heads.MedusaHeads`; untrained heads stay exact, only
            slower).
        input_ids: (1, T) prompt token ids: one prompt (batch 1).
        attention_mask: (1, T), or None.
        tree: the candidate tree: None (the heads' own `tree` when they carry one, else
            `DEFAULT_NODES` nodes built from their `accuracies`, else from
            `prior_accuracies`), a node budget (an int: built from the accuracies), or Medusa's
            "medusa_choices", a list of paths of top-k ranks (prefixes added).
        top_k: ranks per head a built tree considers.
        max_new_tokens: at most this many new tokens.
        eos_token_id: decoding stops after producing it (or any of them); it is included.

    Returns:
        DecodeOutput; `forward_passes` counts every model call, the prefill included
        (docs/method.md#counting); `stats.fed` the tokens fed per forward after it (root +
        tree); `stats.sources` the new tokens made final as the output after a path ("ar") and
        as accepted head guesses ("medusa").
    """
    layout = resolve_tree(heads, tree, top_k)
    stats = DecodeStats()
    tokens: list[int] = []
    for new in medusa_steps(model, heads, input_ids, attention_mask, layout, max_new_tokens=max_new_tokens,
                            eos=eos_set(eos_token_id), stats=stats):
        tokens += new
    stats.new_tokens = len(tokens)
    forwards = len(stats.accepted)
    stats.sources = {s: n for s, n in (("ar", forwards), ("medusa", len(tokens) - forwards)) if n}
    return DecodeOutput(new_tokens=[tokens], forward_passes=stats.forward_passes, stats=stats)


def resolve_tree(heads: Heads, tree: int | Sequence[Sequence[int]] | None, top_k: int = DEFAULT_TOP_K) -> TreeLayout:
    """The layout of `medusa_decode`'s `tree` argument for these heads."""
    K = heads.num_heads
    if tree is None and getattr(heads, "tree", None):
        tree = heads.tree
    if tree is None or isinstance(tree, int):
        nodes = DEFAULT_NODES if tree is None else tree
        measured = getattr(heads, "accuracies", None)
        accuracies = measured if measured else prior_accuracies(K)
        if len(accuracies) != K:
            raise ValueError(f"the heads carry accuracies for {len(accuracies)} heads, not {K}")
        return TreeLayout.from_paths(build_tree(accuracies, nodes, top_k))
    return TreeLayout.from_paths(check_tree(tree, K))
