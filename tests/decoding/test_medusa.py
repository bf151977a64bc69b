"""Medusa decoding equals greedy decoding token for token, on tiny random models of five
architectures (float32): untrained and random heads, several tree sizes, and scripted *oracle*
heads that know greedy's text, so that whole paths are accepted (EOS inside an accepted path, a
budget that cuts a path, the position limit) and the hidden state handed to the heads is checked
at every step. Plus the tree: building, closing under prefixes, vectorised acceptance.
"""

import functools
import itertools
import math

import pytest
import torch

from cllm import greedy_decode
from cllm.decoding.rivals.medusa import (
    TreeLayout,
    build_tree,
    check_tree,
    medusa_decode,
    prior_accuracies,
    resolve_tree,
)
from cllm.decoding.tree import Tree
from cllm.modeling.heads import MedusaHeads
from cllm.runtime import hf
from tests.decoding.conftest import (
    MAX_POSITIONS,
    VOCAB,
    assert_same_tokens,
    module_of,
    random_prompt,
    tiny_model,
)


@pytest.fixture
def arch(torch_arch):
    """On the torch runtimes only: Medusa's heads read the model's hidden states, which the llama.cpp
    runtime does not give."""
    return torch_arch


MAX_NEW = 37
PROMPTS = [(71, 1), (72, 6), (73, 15)]  # (seed, length)


@functools.cache
def greedy(arch: str, seed: int, length: int, max_new: int = MAX_NEW, eos: int | None = None) -> list[int]:
    return greedy_decode(tiny_model(arch), random_prompt(seed, length), max_new_tokens=max_new,
                         eos_token_id=eos).new_tokens[0]


def random_heads(model, num_heads: int, seed: int) -> MedusaHeads:
    """Heads whose residual blocks are random: they guess wrong tokens, sometimes right ones."""
    heads = MedusaHeads.for_model(module_of(model), num_heads=num_heads)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in heads.blocks:
            block.linear.weight.copy_(torch.randn(block.linear.weight.shape, generator=g))
    return heads


class OracleHeads:
    """Scripted heads that know greedy's text. From the hidden state they are given they find
    the position it belongs to (the nearest state of one full forward over prompt + text; it
    must be a near-exact match, so a decoder passing the wrong state fails here), then rank the
    true token k + 1 ahead at a random rank below `ranks` for head k, or, with probability
    `miss`, at rank `ranks` (outside a tree of ranks < `ranks`)."""

    def __init__(self, model, prompt: list[int], text: list[int], num_heads: int, *, ranks: int = 2,
                 miss: float = 0.0, seed: int = 0) -> None:
        self.num_heads, self.ranks, self.miss = num_heads, ranks, miss
        self.full = prompt + text
        self.states = hf.forward_hidden(module_of(model), torch.tensor([self.full])).hidden[0].detach()  # (T, H)
        self.g = torch.Generator().manual_seed(seed)
        self.calls = 0

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        distance = (self.states - hidden[0]).norm(dim=-1)
        t = int(distance.argmin())
        assert float(distance[t]) < 1e-3 * float(self.states[t].norm()), "the heads got a hidden state of no position"
        logits = torch.zeros(self.num_heads, 1, VOCAB)
        for k in range(1, self.num_heads + 1):
            order = torch.randperm(VOCAB, generator=self.g).tolist()
            if t + k + 1 < len(self.full):
                target = self.full[t + k + 1]
                hit = float(torch.rand(1, generator=self.g)) >= self.miss
                rank = int(torch.randint(self.ranks, (1,), generator=self.g)) if hit else self.ranks
                order.remove(target)
                order.insert(rank, target)
            logits[k - 1, 0, order] = torch.arange(VOCAB, 0, -1, dtype=torch.float)
        return logits


def full_tree(num_heads: int, ranks: int) -> list[tuple[int, ...]]:
    """Every path of ranks < `ranks`, one to `num_heads` deep."""
    return [p for depth in range(1, num_heads + 1) for p in itertools.product(range(ranks), repeat=depth)]


@pytest.mark.parametrize("tree", [0, 1, 6, 20, 64])
def test_untrained_and_random_heads_are_exact(arch, tree):
    model = tiny_model(arch)
    for seed, length in PROMPTS:
        prompt = random_prompt(seed, length)
        expected = greedy(arch, seed, length)
        for name, heads in (("untrained", MedusaHeads.for_model(module_of(model), num_heads=3)),
                            ("random", random_heads(model, 4, seed))):
            out = medusa_decode(model, heads, prompt, tree=tree, max_new_tokens=MAX_NEW)
            assert_same_tokens(model, prompt[0].tolist(), expected, out.new_tokens[0], f"{arch} {name} tree={tree}")
            assert out.forward_passes <= len(expected) == out.stats.new_tokens
            assert out.forward_passes == len(out.stats.accepted) == 1 + len(out.stats.fed)
            if tree == 0:
                assert out.forward_passes == len(expected)  # no candidates: greedy's one token per forward


@pytest.mark.parametrize("num_heads", [1, 3])
def test_oracle_heads_accept_whole_paths_and_stay_exact(arch, num_heads):
    model = tiny_model(arch)
    for seed, length in PROMPTS:
        prompt = random_prompt(seed, length)
        expected = greedy(arch, seed, length)
        heads = OracleHeads(model, prompt[0].tolist(), expected, num_heads, seed=seed)
        out = medusa_decode(model, heads, prompt, tree=full_tree(num_heads, 2), max_new_tokens=MAX_NEW)
        assert_same_tokens(model, prompt[0].tolist(), expected, out.new_tokens[0], f"{arch} oracle K={num_heads}")
        # every step accepts K nodes and the output after them; the last is cut by the budget
        assert out.forward_passes == 1 + math.ceil((MAX_NEW - 1) / (num_heads + 1))
        assert out.stats.accepted[0] == 1 and set(out.stats.accepted[1:-1]) == {num_heads + 1}


def test_oracle_heads_that_sometimes_miss_stay_exact(arch):
    model = tiny_model(arch)
    for seed, length in PROMPTS:
        prompt = random_prompt(seed, length)
        expected = greedy(arch, seed, length)
        heads = OracleHeads(model, prompt[0].tolist(), expected, 4, ranks=3, miss=0.3, seed=seed)
        out = medusa_decode(model, heads, prompt, tree=full_tree(3, 3) + [(0, 0, 0, 0), (1, 2, 0, 1)],
                            max_new_tokens=MAX_NEW)
        assert_same_tokens(model, prompt[0].tolist(), expected, out.new_tokens[0], f"{arch} oracle with misses")
        assert max(out.stats.accepted) >= 3 and out.forward_passes < MAX_NEW


@pytest.mark.parametrize("max_new", [1, 2, 5, 9, 10])
def test_a_budget_that_cuts_a_path_is_met_exactly(arch, max_new):
    model = tiny_model(arch)
    seed, length = PROMPTS[1]
    prompt = random_prompt(seed, length)
    expected = greedy(arch, seed, length, max_new)
    heads = OracleHeads(model, prompt[0].tolist(), expected, 3)
    out = medusa_decode(model, heads, prompt, tree=full_tree(3, 2), max_new_tokens=max_new)
    assert out.new_tokens[0] == expected and len(expected) == max_new
    assert out.forward_passes == 1 + math.ceil((max_new - 1) / 4)


def test_eos_inside_an_accepted_path_ends_the_output_there(arch):
    model = tiny_model(arch)
    seed, length = PROMPTS[2]
    full = greedy(arch, seed, length)
    # steps make tokens 1-4, 5-8, ...: an EOS at a path's second token, its first occurrence
    i = next(i for i in range(5, len(full)) if i % 4 == 2 and full[i] not in full[:i])
    expected = greedy(arch, seed, length, eos=full[i])
    assert expected == full[: i + 1]
    heads = OracleHeads(model, random_prompt(seed, length)[0].tolist(), full, 3)
    out = medusa_decode(model, heads, random_prompt(seed, length), tree=full_tree(3, 2), max_new_tokens=MAX_NEW,
                        eos_token_id=[full[i], 10**6])
    assert_same_tokens(model, random_prompt(seed, length)[0].tolist(), expected, out.new_tokens[0], f"{arch} eos")
    assert out.forward_passes == 1 + math.ceil(i / 4)


def test_the_tree_never_reaches_past_the_position_limit(arch):
    """prompt + budget = the model's position limit, oracle heads and a deep tree: a tree cut
    only by the heads would feed positions past it (GPT-2's learned positions would fail)."""
    model = tiny_model(arch)
    new = 23
    prompt = random_prompt(7, MAX_POSITIONS - new)
    expected = greedy_decode(model, prompt, max_new_tokens=new).new_tokens[0]
    heads = OracleHeads(model, prompt[0].tolist(), expected, 4)
    out = medusa_decode(model, heads, prompt, tree=full_tree(4, 2), max_new_tokens=new)
    assert out.new_tokens[0] == expected


def test_a_left_padded_prompt_decodes_as_the_bare_prompt():
    model = tiny_model("llama")
    prompt = random_prompt(3, 6)
    padded = torch.cat([torch.zeros(1, 4, dtype=torch.long), prompt], dim=1)
    mask = torch.cat([torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 6, dtype=torch.long)], dim=1)
    heads = random_heads(model, 3, 0)
    bare = medusa_decode(model, heads, prompt, max_new_tokens=MAX_NEW).new_tokens
    assert medusa_decode(model, heads, padded, mask, max_new_tokens=MAX_NEW).new_tokens == bare
    assert bare[0] == greedy("llama", 3, 6)


def test_bad_inputs_and_an_empty_budget():
    model = tiny_model("llama")
    heads = MedusaHeads.for_model(module_of(model), num_heads=2)
    with pytest.raises(ValueError, match="batch 1"):
        medusa_decode(model, heads, torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="1 to 2 ranks"):
        medusa_decode(model, heads, torch.ones(1, 3, dtype=torch.long), tree=[(0, 0, 0)])
    out = medusa_decode(model, heads, torch.ones(1, 3, dtype=torch.long), max_new_tokens=0)
    assert out.new_tokens == [[]] and out.forward_passes == 0


# ------------------------------------------------------------------------------- the tree


def test_build_tree_keeps_the_likeliest_paths_closed_under_prefixes():
    accuracies = [[0.6, 0.25, 0.1], [0.5, 0.1, 0.05], [0.4, 0.1, 0.01]]
    tree = build_tree(accuracies, nodes=6, top_k=3)
    # chances 0.6 (0), 0.3 (0,0), 0.25 (1), 0.125 (1,0), 0.12 (0,0,0), 0.1 (2); then 0.06 (0,1)
    assert tree == ((0,), (1,), (2,), (0, 0), (1, 0), (0, 0, 0))
    assert all(p[:-1] in tree for p in tree if len(p) > 1)
    assert build_tree(accuracies, nodes=100, top_k=2) == tuple(sorted(full_tree(3, 2), key=lambda p: (len(p), p)))
    assert len(build_tree(prior_accuracies(5), nodes=24)) == 24


def test_check_tree_adds_prefixes_and_refuses_bad_paths():
    assert check_tree([(1, 2), [0]], num_heads=2) == ((0,), (1,), (1, 2))
    for bad in ([()], [(0, 0, 0)], [(0, -1)]):
        with pytest.raises(ValueError):
            check_tree(bad, num_heads=2)


def test_a_trained_heads_tree_and_accuracies_shape_the_default():
    model = tiny_model("llama")
    heads = MedusaHeads.for_model(module_of(model), num_heads=2)
    assert len(resolve_tree(heads, None).paths) == 20
    heads.accuracies = [[0.9, 0.5], [0.5, 0.0]]  # chances 0.9 (0), 0.5 (1), 0.45 (0,0), 0.25 (1,0)
    assert resolve_tree(heads, 3, top_k=2).paths == ((0,), (1,), (0, 0))
    heads.tree = [[0], [0, 0]]
    assert resolve_tree(heads, None).paths == ((0,), (0, 0))


def test_a_layouts_tree_accepts_the_matching_path():
    layout = TreeLayout.from_paths(((0,), (1,), (0, 0), (1, 0), (1, 1)))  # nodes 1..5
    assert layout.parent == [-1, 0, 0, 1, 2, 2]
    tree = Tree.from_parents([7, 3, 4, 9, 5, 6], layout.parent)  # depth 1: 3 | 4; depth 2: 9 under 3, 5 | 6 under 4
    # the root predicts 4 (node 2), node 2 predicts 6 (node 5): path 0 -> 2 -> 5
    assert tree.accept([4, 0, 6, 0, 0, 0]) == [0, 2, 5]
    assert tree.accept([8, 0, 6, 0, 0, 0]) == [0]  # nothing under the root
    assert tree.accept([3, 9, 0, 0, 0, 0]) == [0, 1, 3]
    # a node whose token matches but whose parent did not is not accepted
    assert tree.accept([3, 1, 6, 0, 0, 0]) == [0, 1]
