"""The one tree every tree verifier feeds (`cllm.decoding.tree.Tree`): recycling's trie shares
prefixes and keeps to its budget, a tree given by parents keeps siblings distinct, and greedy
acceptance walks the longest verified path."""

import pytest

from cllm.decoding.tree import Tree


def test_trie_feeds_shared_prefixes_once_and_verifies_the_longest_path():
    # tail 5 | 1 2 3; drafts 1 2 9 (shares "1 2") and 4 4 (a new branch from the root)
    tree = Tree.trie([5, 1, 2, 3], [[1, 2, 9], [4, 4]])
    assert tree.tokens == [5, 1, 2, 3, 9, 4, 4]
    assert tree.parent == [-1, 0, 1, 2, 2, 0, 5]
    assert tree.depth == [0, 1, 2, 3, 3, 1, 2]
    assert tree.leaves == [3, 4, 6] and tree.path(4) == [0, 1, 2, 4]
    # predictions per node: after 5 comes 1, after 5 1 comes 2, after 5 1 2 comes 9, after 9 comes 7
    assert tree.accept([1, 2, 9, 0, 7, 0, 0]) == [0, 1, 2, 4]
    assert tree.accept([4, 0, 0, 0, 0, 4, 8]) == [0, 5, 6]  # the second draft, whole
    assert tree.accept([8, 0, 0, 0, 0, 0, 0]) == [0]  # nothing matches: the root only
    assert Tree.trie([5, 1, 2], [[1, 2]]).tokens == [5, 1, 2]  # a draft inside the tail adds nothing


def test_trie_budget_cuts_drafts_but_never_the_tail():
    tail, drafts = [5, 1, 2, 3], [[1, 2, 9, 9], [4, 4, 4]]
    assert Tree.trie(tail, drafts).tokens == [5, 1, 2, 3, 9, 9, 4, 4, 4]
    tree = Tree.trie(tail, drafts, budget=6)  # the first draft shares 1, 2 and adds 9, 9
    assert tree.tokens == [5, 1, 2, 3, 9, 9] and tree.leaves == [3, 5, 0]  # the second: cut whole
    assert Tree.trie(tail, drafts, budget=5).tokens == [5, 1, 2, 3, 9]  # a draft cut inside
    assert Tree.trie(tail, drafts, budget=2).tokens == [5, 1, 2, 3]  # the tail is fed whole


def test_a_tree_given_by_parents_is_the_same_tree_and_refuses_twin_siblings():
    trie = Tree.trie([5, 1, 2, 3], [[1, 2, 9], [4, 4]])
    tree = Tree.from_parents(trie.tokens, trie.parent)
    assert (tree.tokens, tree.parent, tree.depth, tree.children) == (trie.tokens, trie.parent, trie.depth,
                                                                     trie.children)
    assert tree.accept([1, 2, 9, 0, 7, 0, 0]) == trie.accept([1, 2, 9, 0, 7, 0, 0])
    with pytest.raises(ValueError, match="siblings"):
        Tree.from_parents([5, 7, 7], [-1, 0, 0])  # two children of the root holding one token
    with pytest.raises(ValueError, match="earlier parent"):
        Tree.from_parents([5, 7, 8], [-1, 2, 0])
