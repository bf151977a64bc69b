"""Greedy decoding with an EAGLE draft head (Li et al. 2024: EAGLE-1 arXiv 2401.15077, EAGLE-2's
dynamic tree arXiv 2406.16858): a tree of drafts verified in one forward, exactly greedy's output
(docs/method.md#eagle-head).

Positions: the final tokens are x_0 .. x_n, x_n the *root* (final, not yet fed to the target);
the target's feature f_i is its last hidden state at position i. The head's input at position i
is (f_i, e(x_{i+1})) and its output there the predicted feature f^_{i+1}, whose logits guess
x_{i+2}. Between steps the head's cache holds exactly positions 0 .. n-1, all built from TRUE
features, and its last output g = f^_n guesses x_{n+1}. One step:

1. draft (EAGLE-2): g's top-k tokens are depth 1, scored by log-probability; depth by depth,
   the `top_k` best frontier nodes by cumulative score go through the head in one forward (node
   at depth d: position n + d - 1, input (its parent's predicted feature, its token), attending
   to the cache and its ancestors), each giving its top-k children. After `depth` levels the
   `nodes` best nodes of all are the tree: a child never scores above its parent (ties go to
   the shallower node), so the set holds every chosen node's ancestors;
2. verify: one target forward over root + tree (`tree.Tree`), each node seeing its ancestors;
   greedy acceptance along one path (`Tree.accept`, in `medusa.verify_tree`); the path's tokens
   and the output after its last node are final;
3. commit: the target's session keeps the path; the head forgets its draft entries (its cache's
   `rewind`) and is fed the path's true features (f_n .. f_{n+m}, from the verify forward) with
   the tokens after them as one causal chunk; its last output is the next step's g.

Batch 1, token ids only; the engine knows nothing of how the head was trained.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol

import torch

from cllm.decoding.argmax import argmax
from cllm.decoding.inputs import eos_set, finalize, prepare_prompt
from cllm.decoding.rivals.defaults import EAGLE_DEPTH, EAGLE_NODES, EAGLE_TOP_K
from cllm.decoding.rivals.medusa import TreeLayout, verify_tree
from cllm.decoding.stats import DecodeOutput, DecodeStats
from cllm.decoding.tree import Tree
from cllm.runtime import Runtime, as_runtime

# defaults for a head that carries no tree of its own (`cllm eagle` saves these with it): a CPU
# pays for every fed token and every head forward, so a modest tree (the sweep over trees:
# benchmarks/rivals-humaneval/COMMAND.md, models/stdlib-coder/eagle/MODEL_CARD.md)
DEFAULT_NODES = EAGLE_NODES  # draft tokens verified per forward besides the root
DEFAULT_DEPTH = EAGLE_DEPTH  # draft levels: the head runs this many forwards per step
DEFAULT_TOP_K = EAGLE_TOP_K  # children per expanded node, and nodes expanded per level


class HeadCache(Protocol):
    """A draft head's own cache of one row: `length` entries."""

    length: int

    def rewind(self, length: int) -> None:
        """Forget every entry past the first `length`."""
        ...


class Head(Protocol):
    """What the decoder needs of a draft head (`cllm.modeling.eagle.EagleHead` is one)."""

    def new_cache(self) -> HeadCache:
        ...

    def step(self, cache: HeadCache, features: torch.Tensor, next_tokens: torch.Tensor, position_ids: torch.Tensor,
             allowed: torch.Tensor | None = None) -> torch.Tensor:  # (1, L, H), (1, L), (1, L) -> (1, L, H)
        ...

    def logits(self, features: torch.Tensor) -> torch.Tensor:  # (..., H) -> (..., V)
        ...


def draft_tree(head: Head, cache: HeadCache, root: int, g: torch.Tensor, *, nodes: int, depth: int,
               top_k: int) -> tuple[Tree, int]:
    """Step 1: EAGLE-2's dynamic tree from g (1, H), the head's predicted feature at the root's
    position. Appends the drafts to `cache` (the caller rolls them back). Returns the tree and
    the head forwards it took."""
    device = g.device
    n = cache.length  # the root's position
    logp = torch.log_softmax(head.logits(g).float(), dim=-1)[0]  # (V,)
    k = min(top_k, logp.shape[0])
    # candidates: (score, depth, parent candidate or -1, rank among siblings, token)
    scores, tokens = logp.topk(k)
    cands = [(float(s), 1, -1, r, int(t)) for r, (s, t) in enumerate(zip(scores, tokens, strict=True))]
    frontier = list(range(len(cands)))  # depth-1 candidates, all expandable
    fed: list[int] = []  # candidates fed to the head, in cache order
    feature_of: dict[int, torch.Tensor] = {}  # candidate -> its predicted feature (H,)
    forwards = 0
    for d in range(1, depth):
        # expand the top_k best nodes of depth d by cumulative score
        expand = sorted(frontier, key=lambda c: -cands[c][0])[:k]
        parents = [g[0] if cands[c][2] < 0 else feature_of[cands[c][2]] for c in expand]
        S = cache.length
        allowed = torch.zeros(len(expand), S + len(expand), dtype=torch.bool, device=device)
        allowed[:, : S - len(fed)] = True  # the true entries
        slot = {c: S - len(fed) + i for i, c in enumerate(fed)}
        for i, c in enumerate(expand):  # its ancestors among the drafts, and itself
            a = cands[c][2]
            while a >= 0:
                allowed[i, slot[a]] = True
                a = cands[a][2]
            allowed[i, S + i] = True
        out = head.step(cache, torch.stack(parents)[None], torch.tensor([[cands[c][4] for c in expand]], device=device),
                        torch.full((1, len(expand)), n + d - 1, device=device), allowed[None])  # (1, E, H)
        forwards += 1
        fed += expand
        child_logp = torch.log_softmax(head.logits(out[0]).float(), dim=-1)  # (E, V)
        top_s, top_t = child_logp.topk(k, dim=-1)  # (E, k)
        frontier = []
        for i, c in enumerate(expand):
            feature_of[c] = out[0, i]
            for r in range(k):
                frontier.append(len(cands))
                cands.append((cands[c][0] + float(top_s[i, r]), d + 1, c, r, int(top_t[i, r])))
    # the `nodes` best of all; ties go to the shallower node, so every parent precedes its child
    chosen = sorted(range(len(cands)), key=lambda c: (-cands[c][0], cands[c][1]))[:nodes]
    path_of: dict[int, tuple[int, ...]] = {}

    def path(c: int) -> tuple[int, ...]:
        if c not in path_of:
            parent = cands[c][2]
            path_of[c] = (path(parent) if parent >= 0 else ()) + (cands[c][3],)
        return path_of[c]

    chosen_set = set(chosen)
    assert all(cands[c][2] < 0 or cands[c][2] in chosen_set for c in chosen), "the draft tree lost an ancestor"
    ordered = sorted(chosen, key=lambda c: (cands[c][1], path(c)))
    layout = TreeLayout.from_paths([path(c) for c in ordered])
    return Tree.from_parents([root] + [cands[c][4] for c in ordered], layout.parent), forwards


def eagle_steps(
    model: torch.nn.Module | Runtime,
    head: Head,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    nodes: int,
    depth: int,
    top_k: int,
    max_new_tokens: int,
    eos: frozenset[int],
    stats: DecodeStats,
    head_cache: HeadCache | None = None,
) -> Iterator[list[int]]:
    """The decode loop as a generator: yields the tokens each target forward made final, cut at
    EOS or the budget. Counts into `stats` (target forwards in `forward_passes`, the head's in
    `draft_forward_passes`). `head_cache`, when given, is the head's cache (tests read it)."""
    runtime = as_runtime(model)
    prompt = prepare_prompt(runtime, input_ids, attention_mask, max_new_tokens)
    if prompt.batch_size != 1:
        raise ValueError(f"eagle_decode decodes one prompt at a time (batch 1), got {prompt.batch_size} rows")
    if max_new_tokens == 0:
        return
    ids = prompt.rows[0]
    P = len(ids)
    # 0. prefill: the target's features at every prompt position, and the first token
    session = runtime.session()
    (row,), out = session.open(prompt.rows, hidden=True, every=True)
    stats.forward_passes += 1
    device = out.hidden.device
    known: list[int] = []
    root = int(argmax(out.logits[0, -1]))
    done = finalize(known, [root], eos, max_new_tokens)[1]
    stats.count(0, 1)
    yield [root]
    try:
        if done:
            return
        # ... and the head's: inputs (f_i, x_{i+1}) at positions 0 .. P-1; its last output guesses x_{P+1}
        hc = head_cache if head_cache is not None else head.new_cache()
        nexts = torch.tensor([ids[1:] + [root]], device=device)  # (1, P)
        g = head.step(hc, out.hidden, nexts, torch.arange(P, device=device)[None])[:, -1]  # (1, H)
        stats.draft_forward_passes += 1
        while True:
            # 1. draft a tree, no deeper than the budget can use (so positions stay in range)
            levels = min(depth, max_new_tokens - len(known) - 1)
            if nodes > 0 and levels > 0:
                tree, forwards = draft_tree(head, hc, root, g, nodes=nodes, depth=levels, top_k=top_k)
                stats.draft_forward_passes += forwards
                hc.rewind(session.length(row))  # 3. (early) only true entries stay
            else:
                tree = Tree.root(root)
            # 2. verify root + tree in one target forward; the path and the output after it are final
            hiddens, path, new, done = verify_tree(session, row, tree, stats, eos, known, max_new_tokens)
            yield new
            if done:
                return
            # ... and the head is fed the path's true features f_n .. f_{n+m} with x_{n+1} .. x_{n+m+1}
            start = hc.length
            positions = torch.arange(start, start + len(path), device=device)[None]
            g = head.step(hc, hiddens[:, path], torch.tensor([new], device=device), positions)[:, -1]
            stats.draft_forward_passes += 1
            root = new[-1]
    finally:
        session.close([row])


@torch.inference_mode()
def eagle_decode(
    model: torch.nn.Module | Runtime,
    head: Head,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    nodes: int | None = None,
    depth: int | None = None,
    top_k: int | None = None,
    max_new_tokens: int = 128,
    eos_token_id: int | Iterable[int] | None = None,
) -> DecodeOutput:
    """Greedy decoding sped up by an EAGLE head: the same tokens as `greedy_decode`, fewer target
    forwards.

    Args:
        model: a causal LM (any transformers `*ForCausalLM`).
        head: its draft head (`cllm.modeling.eagle.EagleHead`, `cllm.models.load_eagle`; an
            untrained head stays exact, only slower).
        input_ids: (1, T) prompt token ids: one prompt (batch 1).
        attention_mask: (1, T), or None.
        nodes: draft tokens verified per target forward besides the root (None: the head's
            saved default, else `DEFAULT_NODES`); 0 decodes like greedy.
        depth: draft levels (None: the head's default, else `DEFAULT_DEPTH`).
        top_k: nodes expanded per level and children per expanded node (None: likewise).
        max_new_tokens: at most this many new tokens.
        eos_token_id: decoding stops after producing it (or any of them); it is included.

    Returns:
        DecodeOutput; `forward_passes` counts the target's calls, the prefill included
        (docs/method.md#counting); `stats.draft_forward_passes` the head's; `stats.fed` the
        tokens fed per target forward after the prefill (root + tree); `stats.sources` the new
        tokens made final as the output after a path ("ar") and as accepted drafts ("eagle").
    """
    nodes, depth, top_k = resolve_tree(head, nodes, depth, top_k)
    stats = DecodeStats()
    tokens: list[int] = []
    for new in eagle_steps(model, head, input_ids, attention_mask, nodes=nodes, depth=depth, top_k=top_k,
                           max_new_tokens=max_new_tokens, eos=eos_set(eos_token_id), stats=stats):
        tokens += new
    stats.new_tokens = len(tokens)
    forwards = len(stats.accepted)
    stats.sources = {s: n for s, n in (("ar", forwards), ("eagle", len(tokens) - forwards)) if n}
    return DecodeOutput(new_tokens=[tokens], forward_passes=stats.forward_passes, stats=stats)


def resolve_tree(head: Head, nodes: int | None, depth: int | None, top_k: int | None) -> tuple[int, int, int]:
    """`eagle_decode`'s tree settings: the arguments, else the head's saved defaults, else ours."""
    saved = getattr(head, "tree", None) or {}
    nodes = nodes if nodes is not None else int(saved.get("nodes", DEFAULT_NODES))
    depth = depth if depth is not None else int(saved.get("depth", DEFAULT_DEPTH))
    top_k = top_k if top_k is not None else int(saved.get("top_k", DEFAULT_TOP_K))
    if nodes < 0 or depth < 1 or top_k < 1:
        raise ValueError(f"an EAGLE tree needs nodes >= 0, depth >= 1 and top_k >= 1, got {nodes}, {depth}, {top_k}")
    return nodes, depth, top_k
