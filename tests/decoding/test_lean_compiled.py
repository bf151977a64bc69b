"""The lean runner's compiled forward (`compiled.compile_runner`) against transformers' own forward:
the same logits through prefill, feeds over a cache with holes and tree feeds, and the same
greedy tokens through the engine, on every architecture the runner takes, with one batch row and
several, one fed token and many; the compiled graphs really run (and only in inference mode); a
weight changed after compiling sends forwards back to the eager runner; where it cannot be
compiled, a reason, and the eager runner decodes.

Each model compiles once per module (Inductor: 10-40 s each here), on its own copy: the
shared models of `test_lean.py` stay uncompiled."""

import copy

import pytest
import torch

from cllm import greedy_decode, jacobi_decode
from cllm.decoding import cache as kv
from cllm.decoding import compiled, lean
from tests.decoding.conftest import random_prompt
from tests.decoding.test_lean import LEAN_ARCHS, SETTINGS, assert_same_logits, feeds, lean_model, padded_batch

NOT_HERE = compiled.why_not_compiled(lean_model("llama"))  # no C++ compiler, an older torch
pytestmark = pytest.mark.skipif(NOT_HERE is not None, reason=f"no compiled forward here: {NOT_HERE}")

_COMPILED: dict[str, torch.nn.Module] = {}


def compiled_model(arch: str) -> torch.nn.Module:
    if arch not in _COMPILED:
        with torch.inference_mode(False):
            model = copy.deepcopy(lean_model(arch))
        assert compiled.compile_runner(model) is None
        _COMPILED[arch] = model
    return _COMPILED[arch]


class Counting:
    """Counts calls of the compiled graphs: `one_row` and `rows` (batches of two rows or more)."""

    def __init__(self, model):
        self.forward = lean.compiled(model)
        self.graphs = {name: getattr(self.forward, name) for name in ("one_row", "rows")}
        self.graphs = {name: graph for name, graph in self.graphs.items() if graph is not None}
        self.counts = dict.fromkeys(("one_row", "rows"), 0)

    @property
    def calls(self):
        return sum(self.counts.values())

    def __enter__(self):
        for name, graph in self.graphs.items():
            def counted(*args, name=name, graph=graph):
                self.counts[name] += 1
                return graph(*args)

            setattr(self.forward, name, counted)
        return self

    def __exit__(self, *exc):
        for name, graph in self.graphs.items():
            setattr(self.forward, name, graph)


@pytest.mark.parametrize("arch", LEAN_ARCHS)
@torch.inference_mode()
def test_the_compiled_forward_computes_transformers_logits_through_feeds_holes_and_trees(arch):
    model = compiled_model(arch)
    assert "compiled forward" in lean.describe(model)
    run = feeds(model, (7, 3, 4))  # a prefill of 3 x 7 = 21 tokens: compiled too
    with Counting(model) as counted:
        got, kind = run()
    assert kind == "LeanKV" and counted.calls == 5  # every forward ran the compiled forward
    with lean.runner_enabled(False):
        want, _ = run()
    assert_same_logits(got, want)


@pytest.mark.parametrize("arch", LEAN_ARCHS)
@torch.inference_mode()
def test_one_row_and_one_token_forwards_compute_transformers_logits(arch):
    """One batch row runs its own graph; one fed token runs padded to two, and the padding leaves
    no trace in the cache: the forwards after it see what transformers' cache holds."""
    model = compiled_model(arch)
    ids = random_prompt(8, 6)
    fed = torch.randint(2, 50, (1, 4), generator=torch.Generator().manual_seed(8))
    tree = torch.tensor([[True] * 4] * 4).tril()
    tree[2, 1] = False  # node 2 hangs off node 0

    def run():
        rc, first = kv.prefill(model, ids, torch.ones_like(ids))
        logits = [first, kv.feed(model, rc, fed[:, :1], [1])]
        kv.commit(rc, [1], fed=1)
        logits.append(kv.feed(model, rc, fed[:, 1:2], [1]))
        kv.commit(rc, [1], fed=1)
        logits.append(kv.feed_tree(model, rc, fed, torch.tensor([[0, 1, 1, 2]]), tree[None]))
        kv.commit_kept(rc, [[0, 2]], fed=4)
        logits.append(kv.feed(model, rc, fed[:, :3], [3]))
        return [x.clone() for x in logits]

    with Counting(model) as counted:
        got = run()
    assert counted.counts == {"one_row": 5, "rows": 0}
    with lean.runner_enabled(False):
        want = run()
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", list(SETTINGS))
@pytest.mark.parametrize("arch", LEAN_ARCHS)
def test_the_engine_on_the_compiled_forward_gives_transformers_greedy_tokens(arch, name):
    model = compiled_model(arch)
    ids, mask, eos = padded_batch(model)
    with lean.runner_enabled(False):
        expected = greedy_decode(model, ids, mask, max_new_tokens=40, eos_token_id=eos).new_tokens
        alone = greedy_decode(model, ids[2:], mask[2:], max_new_tokens=40, eos_token_id=eos).new_tokens
    with Counting(model) as counted:
        got = jacobi_decode(model, ids, mask, max_new_tokens=40, eos_token_id=eos,
                            generator=torch.Generator().manual_seed(0), **SETTINGS[name])
        one = jacobi_decode(model, ids[2:], mask[2:], max_new_tokens=40, eos_token_id=eos,
                            generator=torch.Generator().manual_seed(0), **SETTINGS[name])
    assert got.new_tokens == expected and one.new_tokens == alone, (arch, name)
    assert eos in got.new_tokens[0]
    if name != "n=32":  # 32 tokens a step is past the compiled widths
        assert counted.calls > 0


def test_only_inference_mode_runs_the_compiled_forward():
    """Dynamo compiled them for inference-mode tensors: elsewhere (no_grad) the eager runner runs,
    rather than a recompile in the middle of a forward."""
    model = compiled_model("llama")
    ids = random_prompt(3, 8)

    def run():
        rc, _ = kv.prefill(model, ids, torch.ones_like(ids))
        return kv.feed(model, rc, ids[:, :4], [4]).clone()

    with Counting(model) as counted:
        with torch.no_grad():
            plain = run()
        assert counted.calls == 0
        with torch.inference_mode():
            inferred = run()
        assert counted.calls == 2
    torch.testing.assert_close(inferred, plain, rtol=1e-4, atol=1e-4)


def test_compiled_without_batches_one_row_runs_compiled_and_a_batch_eagerly():
    """`compile_runner(model, batches=False)` (one prompt at a time: generate, chat,
    load_for_decoding) compiles only the one-row graph; a batch still decodes exactly, eagerly."""
    with torch.inference_mode(False):
        model = copy.deepcopy(lean_model("llama"))
    assert compiled.compile_runner(model, batches=False) is None
    assert lean.compiled(model).rows is None
    ids, mask, eos = padded_batch(model)
    with lean.runner_enabled(False):
        expected = greedy_decode(model, ids, mask, max_new_tokens=24).new_tokens
    with Counting(model) as counted:
        got = jacobi_decode(model, ids, mask, max_new_tokens=24, **SETTINGS["recycling"])
        assert counted.calls == 0 and got.new_tokens == expected
        one = jacobi_decode(model, ids[2:], mask[2:], max_new_tokens=24, **SETTINGS["recycling"])
        assert counted.counts["one_row"] > 0 and one.new_tokens == expected[2:]


def test_a_weight_changed_after_compiling_sends_forwards_to_the_eager_runner():
    with torch.inference_mode(False):
        model = copy.deepcopy(lean_model("llama"))
    assert compiled.compile_runner(model) is None
    prompt = random_prompt(4, 10)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(-1.5)  # a real change, as training makes
    assert lean.compiled(model) is None and "compiled" not in lean.describe(model)
    with lean.runner_enabled(False):
        expected = greedy_decode(model, prompt, max_new_tokens=24).new_tokens
    assert jacobi_decode(model, prompt, max_new_tokens=24, block_size=4).new_tokens == expected
    assert compiled.compile_runner(model) is None and lean.compiled(model) is not None  # compiled anew
    assert jacobi_decode(model, prompt, max_new_tokens=24, block_size=4).new_tokens == expected


def test_where_the_forward_cannot_compile_a_reason_and_the_eager_runner_decodes(monkeypatch):
    assert "float32" in compiled.why_not_compiled(lean_model("llama", torch.bfloat16))
    with torch.inference_mode(False):
        model = copy.deepcopy(lean_model("qwen2"))
    monkeypatch.setattr(compiled.shutil, "which", lambda name: None)
    assert "C++ compiler" in compiled.compile_runner(model)
    monkeypatch.undo()

    def broken(self, runner):
        raise RuntimeError("C++ compile error\nmore detail")

    monkeypatch.setattr(compiled.CompiledForward, "warm_up", broken)
    assert compiled.compile_runner(model) == "compiling failed: C++ compile error"
    assert lean.compiled(model) is None and "compiled" not in lean.describe(model)
    prompt = random_prompt(5, 6)
    with lean.runner_enabled(False):
        expected = greedy_decode(model, prompt, max_new_tokens=16).new_tokens
    assert jacobi_decode(model, prompt, max_new_tokens=16, block_size=4).new_tokens == expected
