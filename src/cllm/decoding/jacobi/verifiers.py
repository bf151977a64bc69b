"""Verifiers: one batched forward over what the rows feed, and what each row keeps of it.

A verifier's `step(session, rows, cfg, stats)` feeds every row's tokens in one forward of the
runtime's session (`cllm.runtime.protocol.Session`), decides per row which fed tokens are final,
moves the row (`state.advance`) and has the session keep exactly those tokens' entries:

- `LinearVerifier`: each row feeds its tail as a chain. Greedy: a token is final when every
  token before it is and it equals the argmax predicted for it (`rule.accepted_length`).
  Sampling: speculative sampling's acceptance (`sampling.verify_drafts`), which keeps the law
  exact.
- `TreeVerifier` (greedy recycling): each row feeds its tail and the tree drafters' branches as
  one token trie (`tree.Tree`, fed by its parent list); the longest path whose tokens all equal
  their predictions is final (`Tree.accept`), and the branch it lies on becomes the tail.
  A row whose session verifies chains only for it (`tree_leaves` 1: a llama.cpp stream of its
  own) feeds a chain instead, its best pool draft in the tail's draft positions (`chain_of`).
"""

from __future__ import annotations

from typing import Protocol

from cllm.decoding.argmax import argmax
from cllm.decoding.jacobi.drafters import Drafter, branches, fill
from cllm.decoding.jacobi.rule import accepted_length
from cllm.decoding.jacobi.state import (
    Row,
    Settings,
    advance,
    draft_origins,
    isolated,
    last_token,
    scored,
    set_drafts,
    swap_in_draft,
    tail,
)
from cllm.decoding.sampling import verify_drafts
from cllm.decoding.stats import DecodeStats
from cllm.decoding.tree import Tree
from cllm.runtime import Session


class Verifier(Protocol):
    def step(self, session: Session, rows: list[Row], cfg: Settings, stats: DecodeStats) -> None:
        """One batched forward in which every row of `rows` (all unfinished, in the session's
        order) advances."""
        ...


def choose_verifier(cfg: Settings) -> Verifier:
    return TreeVerifier() if cfg.drafters.tree else LinearVerifier()


class LinearVerifier:
    """Every row feeds its tail; the accepted prefix is kept (greedy or speculative sampling)."""

    def step(self, session: Session, rows: list[Row], cfg: Settings, stats: DecodeStats) -> None:
        if cfg.drafters.swap is not None:  # sampling with recycling: a pool draft replaces the Jacobi drafts
            isolated(rows, lambda r, row: swap_in_draft(row, cfg), lambda row: None)
        # 1. every row's tail (its first tokens, for a row feeding narrower: `fed_width`); a row that
        #    fails (here or below) feeds its last token and keeps nothing
        tails = isolated(rows, lambda r, row: tail(row)[: fed_width(row)], last_token)
        fed = [len(t) for t in tails]
        for row, n in zip(rows, fed, strict=True):  # a failed row's filler holds no draft
            stats.count_drafts(stats.drafted, draft_origins(row)[: n - 1])
        # 2. forward, argmax at every fed position: the one device sync of the iteration
        ids = [row.index for row in rows]
        logits = session.feed(ids, tails).logits  # (B, L, V)
        stats.forward_passes += 1
        stats.fed.append(max(fed))
        if cfg.sampling is None:
            outputs = argmax(logits).tolist()
            # 3. each row accepts what it can; the session keeps exactly the accepted entries
            keep = isolated(rows, lambda r, row: scored(row, cfg, logits[r], lambda: observed(row, fed[r], advance(
                row, outputs[r][: fed[r]], cfg, stats))), lambda row: 0)
        else:
            probs = cfg.sampling.probs(logits)  # (B, L, V)

            def accept(r: int, row: Row) -> int:
                block = row.block
                laws = block.laws[block.committed :] if block is not None else []
                out, _, fresh = verify_drafts(tails[r], laws, probs[r, : fed[r]], row.generator)
                return scored(row, cfg, probs[r], lambda: advance(row, out, cfg, stats, fresh))

            keep = isolated(rows, accept, lambda row: 0)
        session.keep(ids, [range(k) for k in keep])


class TreeVerifier:
    """Per row, the Jacobi tail and the tree drafters' branches as one token trie (shared
    prefixes fed once); the longest verified path is final, its entries are kept."""

    def step(self, session: Session, rows: list[Row], cfg: Settings, stats: DecodeStats) -> None:
        ids = [row.index for row in rows]
        leaves = session.tree_leaves(ids)  # per row: None, or the most leaves its runtime holds for it
        chained = [cfg.drafters.chain is not None and n == 1 for n in leaves]  # rows that verify a chain
        between = [row.block is None for row in rows]

        def trie_of(r: int, row: Row) -> tuple[Tree, list[str]]:
            if chained[r]:
                chain, source = chain_of(row, cfg, cfg.drafters.chain)
                return Tree.trie(chain, []), [source]
            t, budget = tail(row), cfg.recycle_budget
            if (width := fed_width(row)) is not None:  # this forward's width for the row
                if width < len(t):  # narrower than its tail: a chain, the pool's best draft in the tail's place
                    if cfg.drafters.chain is not None and row.block is not None and width > 1:
                        found = cfg.drafters.chain.propose(row.context(cfg), width - 1)
                        if found:
                            set_drafts(row, found[0], cfg.drafters.chain.source)
                            t = tail(row)
                    return Tree.trie(t[:width], []), ["jacobi"]
                budget = width if budget is None else min(width, budget)  # a server may lower the budget
            drafts, kinds = [], []
            # a draft may reach past the tail (its surplus rides as drafts of the next block);
            # between blocks (the tail is the last final token alone) drafts start the next
            # block, unless blocks in flight already hold its drafts; none are looked for when
            # the budget has no room left after the tail (the trie would add none of them)
            room = budget is None or len(t) < budget
            if room and (row.block is not None or cfg.blocks_in_flight == 1):
                width = min(cfg.recycle_width, row.max_new_tokens - len(row.known))
                drafts, kinds = branches(cfg.drafters.tree, row.context(cfg), t, width)
                if leaves[r] is not None:  # the tail's leaf, and one per draft at most
                    drafts, kinds = drafts[: leaves[r] - 1], kinds[: leaves[r] - 1]
            return Tree.trie(t, drafts, budget), ["jacobi", *kinds]  # kinds: per branch

        # a row that fails (here or below) feeds its last token and keeps it alone
        built = isolated(rows, trie_of, lambda row: (Tree.trie(last_token(row), []), ["jacobi"]))
        trees, branch_kinds = [tree for tree, _ in built], [kinds for _, kinds in built]
        chains = all(len(tree.tokens) == len(tree.path(tree.leaves[0])) for tree in trees)
        if chains and not any(chained):
            # no draft added a token: a plain Jacobi step (a chain, no tree mask to build)
            LinearVerifier().step(session, rows, cfg, stats)
            return
        for r, row in enumerate(rows):
            if row.error is None:
                stats.count_drafts(stats.drafted, fed_draft_sources(row, trees[r], branch_kinds[r], chained[r],
                                                                    between[r]))
        logits = session.feed(ids, [tree.tokens for tree in trees],
                              parents=None if chains else [tree.parent for tree in trees]).logits
        out = argmax(logits).tolist()
        stats.forward_passes += 1
        stats.fed.append(max(len(tree.tokens) for tree in trees))

        def accept(r: int, row: Row) -> list[int]:
            tree = trees[r]
            if chained[r]:
                if not between[r]:  # the tail's outputs (not the padding's)
                    return list(range(advance(row, out[r][: len(tail(row))], cfg, stats)))
                outputs = out[r][: len(tree.tokens)]
                row.ahead = outputs  # the fed draft's outputs draft the next block
                return list(range(advance(row, outputs, cfg, stats, accepted=accepted_length(tree.tokens, outputs),
                                          draft_source=branch_kinds[r][0])))
            accepted = tree.accept(out[r])
            # the first branch (the tail's, else a draft's) the accepted path lies on: its tokens
            # become the tail, its outputs the next state
            tail_path = tree.path(tree.leaves[0])
            b, branch = next((b, p) for b, p in enumerate((tail_path, *map(tree.path, tree.leaves[1:])))
                             if accepted[-1] in p)
            outputs = [out[r][i] for i in branch] + [out[r][i] for i in tail_path[len(branch) :]]
            if row.block is None:  # between blocks: the branch's outputs draft the next block
                row.ahead = outputs
            elif b > 0:
                set_drafts(row, [tree.tokens[i] for i in branch[1:]], branch_kinds[r][b])
            advance(row, outputs, cfg, stats, accepted=len(accepted), draft_source=branch_kinds[r][b])
            if row.width is not None:
                row.width.observe(len(tree.tokens), accepted)
            return accepted

        # final token j came from fed position accepted[j] (the kept indices `accept` returns)
        session.keep(ids, isolated(rows, lambda r, row: scored(row, cfg, logits[r], lambda: accept(r, row),
                                                               positions=lambda kept: kept), lambda row: [0]))


def fed_width(row: Row) -> int | None:
    """How many tokens the row feeds this forward (`adaptive`: its `Width`'s choice, made by the
    decoder before the step); None: its tail whole and drafts up to the budget."""
    return None if row.width is None else row.width.width


def observed(row: Row, fed: int, accepted: int) -> int:
    """A chain forward of `fed` tokens kept its first `accepted`: the row's width learns it."""
    if row.width is not None:
        row.width.observe(fed, range(accepted))
    return accepted


def chain_of(row: Row, cfg: Settings, drafter: Drafter) -> tuple[list[int], str]:
    """What a row verifying chains only feeds, and where its draft came from: its tail, the
    drafter's best draft in the tail's draft positions (its surplus runs past the block), then
    padding; between blocks, the last final token and a draft of the next block (the drafter's,
    else the block drafters'), whose outputs then draft that block. The guess pads a chain to
    `block_size` tokens, so that every row feeds as many: llama.cpp computes the equal chains of
    consecutive streams in one pass, where unequal ones cost it more than the padding. Padding
    after a tail is fed and never kept (its outputs would draft the next block from guessed
    tokens)."""
    width = cfg.block_size
    context = row.context(cfg)  # the prompt and final tokens: what set_drafts below leaves as it is
    found = drafter.propose(context, width - 1)
    draft, source = (found[0], drafter.source) if found else ([], drafter.source)
    if row.block is None:
        if not draft:
            draft, origin = fill(cfg.drafters.block, context, width - 1)
            source = origin[0] if origin else source
        chain = [row.known[-1], *draft]
    else:
        if draft:
            set_drafts(row, draft, source)
        chain = tail(row)
    if len(chain) < width:
        chain += fill(cfg.drafters.ahead, context.after(chain[1:]), width - len(chain))[0]
    return chain, source


def fed_draft_sources(row: Row, tree: Tree, kinds: list[str], chained: bool, between: bool) -> list[str]:
    """Where each draft a row feeds in `tree` came from (every node but the root; a shared
    node once), as `advance` credits them: the tail's by their origin, a draft branch's own
    nodes by its drafter (the first branch through a node added it). A chain verified between
    blocks is its drafter's whole; within a block, its padding past the tail is never kept."""
    if chained:
        return [kinds[0]] * (len(tree.tokens) - 1) if between else draft_origins(row)
    sources = draft_origins(row)[: tree.leaves[0]]  # the tail's nodes, 1 .. leaves[0]
    for leaf, kind in zip(tree.leaves[1:], kinds[1:], strict=True):
        sources += [kind] * sum(node > len(sources) for node in tree.path(leaf))
    return sources
