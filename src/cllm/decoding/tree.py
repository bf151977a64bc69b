"""The one tree every tree verifier feeds: Jacobi recycling's branches, Medusa's candidates,
EAGLE's drafts. A tree is its parent list (what llama.cpp's sequence ids and a runtime's
`feed(parents=...)` take): node 0 is the root, the row's last final token (not yet in the
cache), node i's parent is an earlier node, and siblings hold distinct tokens (a token trie).

Greedy acceptance (`accept`) is the same for all of them: from the root, descend to the child
holding the token the model predicted at the current node while there is one; the nodes walked
are final, and so is the prediction at the last of them (made from an all-correct prefix).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class Tree:
    """Tokens fed in one forward as a token trie (module docstring)."""

    tokens: list[int]
    parent: list[int]  # parent[0] = -1: the root's parent is the row's last kept token
    depth: list[int]  # the position offset from the root
    children: list[dict[int, int]]  # per node: token -> child node
    leaves: list[int] = field(default_factory=list)  # per branch added (`trie`): its last node

    @classmethod
    def root(cls, token: int) -> Tree:
        return cls(tokens=[token], parent=[-1], depth=[0], children=[{}])

    def child(self, node: int, token: int) -> int:
        """The child of `node` holding `token`, added when there is none."""
        found = self.children[node].get(token)
        if found is None:
            found = len(self.tokens)
            self.tokens.append(token)
            self.parent.append(node)
            self.depth.append(self.depth[node] + 1)
            self.children.append({})
            self.children[node][token] = found
        return found

    @classmethod
    def trie(cls, tail: Sequence[int], drafts: Sequence[Sequence[int]], budget: int | None = None) -> Tree:
        """Jacobi recycling's tree: the tail whole (its first token the root), then each draft,
        which shares the longest prefix it can with the branches before it and adds only the
        rest, while the tree holds at most `budget` tokens (a draft's nodes past it are cut;
        None: no limit). `leaves[b]`: the last node of branch b (the tail first)."""
        tree = cls.root(tail[0])
        for b, branch in enumerate((tail[1:], *drafts)):
            node = 0
            for token in branch:
                if b > 0 and budget is not None and token not in tree.children[node] and len(tree.tokens) >= budget:
                    break
                node = tree.child(node, token)
            tree.leaves.append(node)
        return tree

    @classmethod
    def from_parents(cls, tokens: Sequence[int], parents: Sequence[int]) -> Tree:
        """A tree given node by node (Medusa's and EAGLE's): parents[0] = -1, parents[i] < i, and
        siblings holding distinct tokens."""
        tree = cls.root(tokens[0])
        for token, parent in zip(tokens[1:], parents[1:], strict=True):
            if not 0 <= parent < len(tree.tokens) or token in tree.children[parent]:
                raise ValueError("a tree's node needs an earlier parent and a token none of its siblings holds")
            tree.child(parent, token)
        return tree

    def path(self, node: int) -> list[int]:
        """The nodes from the root to `node`, in order (increasing indices)."""
        nodes = []
        while node >= 0:
            nodes.append(node)
            node = self.parent[node]
        return nodes[::-1]

    def accept(self, outputs: Sequence[int]) -> list[int]:
        """Greedy verification (`outputs[i]`: the token predicted after node i): the final nodes,
        root first."""
        nodes = [0]
        while (child := self.children[nodes[-1]].get(outputs[nodes[-1]])) is not None:
            nodes.append(child)
        return nodes
