"""EAGLE decoding equals greedy decoding token for token, on tiny random models of five
architectures (float32): untrained heads and several tree sizes, and a scripted *oracle* head
that knows greedy's text, so whole drafted paths are accepted (EOS inside an accepted path, a
budget that cuts a path, the position limit) and every entry the head's cache keeps is checked
to be built from the target's TRUE features. Plus the cache adapter's head forward against the
uncached one.
"""

import functools
import math

import pytest
import torch

from cllm import eagle_decode, greedy_decode
from cllm.decoding.rivals.eagle import draft_tree, eagle_steps
from cllm.decoding.stats import DecodeStats
from cllm.modeling.eagle import EagleHead
from cllm.runtime import as_runtime, hf
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
    """On the torch runtimes only: EAGLE's head reads the model's hidden states, which the llama.cpp
    runtime does not give."""
    return torch_arch


MAX_NEW = 37
PROMPTS = [(81, 1), (82, 6), (83, 15)]  # (seed, length)


@functools.cache
def greedy(arch: str, seed: int, length: int, max_new: int = MAX_NEW, eos: int | None = None) -> list[int]:
    return greedy_decode(tiny_model(arch), random_prompt(seed, length), max_new_tokens=max_new,
                         eos_token_id=eos).new_tokens[0]


def untrained_head(model, seed: int = 0) -> EagleHead:
    torch.manual_seed(seed)
    return EagleHead.for_model(module_of(model)).eval()


class OracleHead:
    """A scripted head that knows greedy's text `full` (prompt + text). Its "feature" at head
    position i is the code [i, ok]: ok when everything it was built from is right, and then its
    logits rank greedy's token x_{i+2} first (else a wrong token), followed by distractors.

    It checks what it is fed: an entry the cache keeps (fed without a tree mask) must carry the
    target's TRUE feature f_i (compared with one full forward) and the true x_{i+1}, at the next
    free position; a draft entry must carry its parent's code. A real EAGLE layer holds the
    cache, so rollbacks and crops are the ones the decoder does."""

    def __init__(self, model, prompt: list[int], text: list[int]) -> None:
        self.full = prompt + text
        self.states = hf.forward_hidden(module_of(model), torch.tensor([self.full])).hidden[0].detach()  # (T, H)
        self.body = untrained_head(model)
        self.H = self.states.shape[1]
        self.kept_feeds = 0

    def _code(self, i: int, ok: bool) -> torch.Tensor:
        code = torch.zeros(self.H)
        code[0], code[1] = i, float(ok)
        return code

    def new_cache(self):
        return self.body.new_cache()

    def step(self, rc, features, next_tokens, position_ids, allowed=None):
        L = features.shape[1]
        positions = position_ids[0].tolist()
        out = []
        if allowed is None:  # entries the cache keeps: true features at consecutive positions
            assert positions == list(range(rc.length, rc.length + L)), "kept entries out of place"
            self.kept_feeds += 1
            for j, i in enumerate(positions):
                f = features[0, j]
                assert float((f - self.states[i]).norm()) < 1e-4 * (1 + float(self.states[i].norm())), \
                    f"the head's cache got a feature that is not the target's at position {i}"
                assert int(next_tokens[0, j]) == self.full[i + 1]
                out.append(self._code(i, True))
        else:  # draft entries: fed the parent's code (position i - 1) and a drafted token
            for j, i in enumerate(positions):
                parent = features[0, j]
                assert int(parent[0]) == i - 1, "a draft node was fed another node's feature"
                ok = bool(parent[1]) and i + 1 < len(self.full) and int(next_tokens[0, j]) == self.full[i + 1]
                out.append(self._code(i, ok))
        self.body.step(rc, self.states[:1].expand(1, L, -1), next_tokens, position_ids, allowed)  # the real cache
        return torch.stack(out)[None]

    def logits(self, features):
        flat = features.reshape(-1, self.H)
        logits = torch.zeros(flat.shape[0], VOCAB)
        for r, code in enumerate(flat):
            i, ok = int(code[0]), bool(code[1])
            target = self.full[i + 2] if ok and i + 2 < len(self.full) else (i * 31 + 7) % VOCAB
            for rank, token in enumerate([target] + [(target + 1 + 13 * k) % VOCAB for k in range(5)]):
                logits[r, token] = 20.0 - 5 * rank
        return logits.reshape(*features.shape[:-1], VOCAB)


@pytest.mark.parametrize(("nodes", "depth"), [(0, 3), (1, 1), (1, 5), (4, 2), (4, 3), (16, 4), (16, 5)])
def test_untrained_heads_are_exact(arch, nodes, depth):
    model = tiny_model(arch)
    head = untrained_head(model)
    for seed, length in PROMPTS:
        prompt = random_prompt(seed, length)
        expected = greedy(arch, seed, length)
        out = eagle_decode(model, head, prompt, nodes=nodes, depth=depth, top_k=4, max_new_tokens=MAX_NEW)
        assert_same_tokens(model, prompt[0].tolist(), expected, out.new_tokens[0], f"{arch} nodes={nodes} d={depth}")
        assert out.forward_passes <= len(expected) == out.stats.new_tokens
        assert out.forward_passes == len(out.stats.accepted) == 1 + len(out.stats.fed)
        assert max(out.stats.fed) <= nodes + 1
        if nodes == 0:
            assert out.forward_passes == len(expected)  # no drafts: greedy's one token per forward


@pytest.mark.parametrize("depth", [1, 2, 3, 5])
def test_oracle_head_accepts_the_full_depth_every_step(arch, depth):
    """The oracle's drafts are greedy's, so every step accepts `depth` drafts and the output
    after them; only the budget cuts the last. The oracle asserts that the head's cache only
    ever keeps true features, fed once per step."""
    model = tiny_model(arch)
    for seed, length in PROMPTS:
        prompt = random_prompt(seed, length)
        expected = greedy(arch, seed, length)
        head = OracleHead(model, prompt[0].tolist(), expected)
        out = eagle_decode(model, head, prompt, nodes=16, depth=depth, top_k=3, max_new_tokens=MAX_NEW)
        assert_same_tokens(model, prompt[0].tolist(), expected, out.new_tokens[0], f"{arch} oracle depth={depth}")
        assert out.forward_passes == 1 + math.ceil((MAX_NEW - 1) / (depth + 1))
        assert out.stats.accepted[0] == 1 and set(out.stats.accepted[1:-1]) == {depth + 1}
        assert out.stats.sources == {"ar": out.forward_passes, "eagle": MAX_NEW - out.forward_passes}
        # the head: its prefill, (depth - 1) draft levels and one kept chunk per step but the last
        steps = out.forward_passes - 1
        assert head.kept_feeds == steps and out.stats.draft_forward_passes == steps * depth


def test_the_head_cache_holds_exactly_the_accepted_positions_after_each_step():
    """Between steps the head's cache holds positions 0 .. n-1 (n: the root's position), the
    target's holds as many, and no draft entry is left behind."""
    model = tiny_model("llama")
    seed, length = PROMPTS[1]
    prompt = random_prompt(seed, length)
    expected = greedy("llama", seed, length)
    head = OracleHead(model, prompt[0].tolist(), expected)
    hc = head.new_cache()
    written = 0
    with torch.inference_mode():
        for new in eagle_steps(model, head, prompt, None, nodes=8, depth=3, top_k=2, max_new_tokens=MAX_NEW,
                               eos=frozenset(), stats=DecodeStats(), head_cache=hc):
            if written:  # after the prefill's token the head has not been fed yet
                assert hc.length == hc.cache.get_seq_length() == length + written - 1  # the step's root position
            written += len(new)
    assert written == MAX_NEW


@pytest.mark.parametrize("max_new", [1, 2, 3, 5, 8, 13])
def test_budget_cuts_an_accepted_path(max_new):
    model = tiny_model("qwen2")
    seed, length = PROMPTS[2]
    prompt = random_prompt(seed, length)
    expected = greedy("qwen2", seed, length, max_new)
    head = OracleHead(model, prompt[0].tolist(), greedy("qwen2", seed, length))
    out = eagle_decode(model, head, prompt, nodes=8, depth=4, top_k=2, max_new_tokens=max_new)
    assert out.new_tokens[0] == expected and len(expected) == max_new
    assert out.forward_passes == 1 + math.ceil((max_new - 1) / 5)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "phi3"])
def test_eos_inside_an_accepted_path_stops_there(arch):
    model = tiny_model(arch)
    for seed, length in PROMPTS:
        prompt = random_prompt(seed, length)
        text = greedy(arch, seed, length)
        for stop_at in (3, 10, 21):  # an EOS that falls inside a depth-4 path
            eos = text[stop_at]
            expected = greedy(arch, seed, length, eos=eos)
            assert expected[-1] == eos and len(expected) <= stop_at + 1
            head = OracleHead(model, prompt[0].tolist(), text)
            out = eagle_decode(model, head, prompt, nodes=8, depth=4, top_k=2, max_new_tokens=MAX_NEW,
                               eos_token_id=eos)
            assert out.new_tokens[0] == expected, (arch, stop_at)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_position_limit(arch):
    """A prompt that leaves exactly max_new_tokens positions decodes to the end with deep
    trees (cut where they could pass the limit); one more token is refused."""
    model = tiny_model(arch)
    prompt = random_prompt(5, MAX_POSITIONS - 20)
    expected = greedy_decode(model, prompt, max_new_tokens=20).new_tokens[0]
    for head in (untrained_head(model), OracleHead(model, prompt[0].tolist(), expected)):
        out = eagle_decode(model, head, prompt, nodes=16, depth=5, top_k=4, max_new_tokens=20)
        assert out.new_tokens[0] == expected
    with pytest.raises(ValueError, match="position limit"):
        eagle_decode(model, untrained_head(model), prompt, max_new_tokens=21)


def test_left_padding_and_bad_arguments():
    model = tiny_model("llama")
    head = untrained_head(model)
    prompt = random_prompt(9, 5)
    expected = eagle_decode(model, head, prompt, max_new_tokens=12).new_tokens
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(prompt)], dim=1)
    assert eagle_decode(model, head, padded, mask, max_new_tokens=12).new_tokens == expected
    with pytest.raises(ValueError, match="batch 1"):
        eagle_decode(model, head, torch.cat([prompt, prompt]), max_new_tokens=4)
    with pytest.raises(ValueError, match="nodes >= 0"):
        eagle_decode(model, head, prompt, nodes=-1, max_new_tokens=4)
    assert eagle_decode(model, head, prompt, max_new_tokens=0).new_tokens == [[]]


def test_head_defaults_come_from_its_saved_tree():
    model = tiny_model("llama")
    head = untrained_head(model)
    head.tree = {"nodes": 2, "depth": 1, "top_k": 2}
    out = eagle_decode(model, head, random_prompt(4, 6), max_new_tokens=10)
    assert set(out.stats.fed) <= {1, 3} and out.stats.draft_forward_passes == len(out.stats.fed)


def test_draft_tree_is_ancestor_closed_and_in_depth_order():
    model = tiny_model("llama")
    head = untrained_head(model, seed=3)
    ids = random_prompt(11, 8)
    with torch.inference_mode():
        session = as_runtime(model).session()
        _, out = session.open([ids[0].tolist()], hidden=True, every=True)
        hc = head.new_cache()
        nexts = torch.cat([ids[:, 1:], out.logits[:, -1:].argmax(-1)], dim=1)
        g = head.step(hc, out.hidden, nexts, torch.arange(8)[None])[:, -1]
        for nodes, depth, top_k in ((1, 3, 2), (6, 3, 3), (16, 5, 4), (40, 3, 3)):
            tree, forwards = draft_tree(head, hc, 5, g, nodes=nodes, depth=depth, top_k=top_k)
            assert forwards == depth - 1 and len(tree.tokens) == len(tree.depth) == len(tree.parent)
            assert len(tree.tokens) == 1 + min(nodes, top_k + (depth - 1) * top_k * top_k)
            assert all(tree.depth[p] == d - 1 for p, d in zip(tree.parent[1:], tree.depth[1:], strict=True))
            assert all(p < i for i, p in enumerate(tree.parent))
            hc.rewind(8)
            assert hc.length == hc.cache.get_seq_length() == 8


def test_the_cached_head_forward_equals_the_uncached_one():
    """The head's layer with a cache (`hf.EmbedsCache`), chunk by chunk, computes what one causal
    forward does."""
    model = tiny_model("gpt-neox")
    head = untrained_head(model, seed=1)
    ids = random_prompt(12, 14)
    with torch.inference_mode():
        features = hf.forward_hidden(module_of(model), ids).hidden  # (1, 14, H)
        whole = head(features[:, :-1], ids[:, 1:])
        hc = head.new_cache()
        parts = [head.step(hc, features[:, a:b], ids[:, a + 1 : b + 1], torch.arange(a, b)[None])
                 for a, b in ((0, 5), (5, 6), (6, 13))]
    torch.testing.assert_close(torch.cat(parts, dim=1), whole, atol=1e-5, rtol=1e-4)
