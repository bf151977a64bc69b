"""The lean runner's compiled segments (`segments.compile_runner`) against transformers' own forward:
the same logits through prefill, feeds over a cache with holes and tree feeds, and the same
greedy tokens through the engine, on every architecture the runner takes; the segments really
run (and only in inference mode); a weight changed after compiling sends forwards back to the
eager runner; where they cannot be compiled, a reason, and the eager runner decodes.

Each model compiles once per module (Inductor: several seconds each), on its own copy: the
shared models of `test_lean.py` stay uncompiled."""

import copy

import pytest
import torch

from cllm import greedy_decode, jacobi_decode
from cllm.decoding import cache as kv
from cllm.decoding import lean, segments
from tests.decoding.conftest import random_prompt
from tests.decoding.test_lean import LEAN_ARCHS, SETTINGS, assert_same_logits, feeds, lean_model, padded_batch

NOT_HERE = segments.why_not_compiled(lean_model("llama"))  # no C++ compiler, an older torch
pytestmark = pytest.mark.skipif(NOT_HERE is not None, reason=f"no compiled segments here: {NOT_HERE}")

_COMPILED: dict[str, torch.nn.Module] = {}


def compiled_model(arch: str) -> torch.nn.Module:
    if arch not in _COMPILED:
        with torch.inference_mode(False):
            model = copy.deepcopy(lean_model(arch))
        assert segments.compile_runner(model) is None
        _COMPILED[arch] = model
    return _COMPILED[arch]


class Counting:
    """Counts calls of the compiled head (one per compiled forward)."""

    def __init__(self, model):
        self.segments = lean.compiled(model)
        self.head, self.calls = self.segments.head, 0

    def __enter__(self):
        def head(*args):
            self.calls += 1
            return self.head(*args)

        self.segments.head = head
        return self

    def __exit__(self, *exc):
        self.segments.head = self.head


@pytest.mark.parametrize("arch", LEAN_ARCHS)
@torch.inference_mode()
def test_compiled_segments_compute_transformers_logits_through_feeds_holes_and_trees(arch):
    model = compiled_model(arch)
    assert "compiled segments" in lean.describe(model)
    run = feeds(model, (7, 3, 4))  # a prefill of 3 x 7 = 21 tokens: compiled too
    with Counting(model) as counted:
        got, kind = run()
    assert kind == "LeanKV" and counted.calls == 5  # every forward ran the compiled segments
    with lean.runner_enabled(False):
        want, _ = run()
    assert_same_logits(got, want)


@pytest.mark.parametrize("name", list(SETTINGS))
@pytest.mark.parametrize("arch", LEAN_ARCHS)
def test_the_engine_on_compiled_segments_gives_transformers_greedy_tokens(arch, name):
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


def test_only_inference_mode_runs_the_compiled_segments():
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


def test_a_weight_changed_after_compiling_sends_forwards_to_the_eager_runner():
    with torch.inference_mode(False):
        model = copy.deepcopy(lean_model("llama"))
    assert segments.compile_runner(model) is None
    prompt = random_prompt(4, 10)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(-1.5)  # a real change, as training makes
    assert lean.compiled(model) is None and "compiled" not in lean.describe(model)
    with lean.runner_enabled(False):
        expected = greedy_decode(model, prompt, max_new_tokens=24).new_tokens
    assert jacobi_decode(model, prompt, max_new_tokens=24, block_size=4).new_tokens == expected
    assert segments.compile_runner(model) is None and lean.compiled(model) is not None  # compiled anew
    assert jacobi_decode(model, prompt, max_new_tokens=24, block_size=4).new_tokens == expected


def test_where_the_segments_cannot_compile_a_reason_and_the_eager_runner_decodes(monkeypatch):
    assert "float32" in segments.why_not_compiled(lean_model("llama", torch.bfloat16))
    with torch.inference_mode(False):
        model = copy.deepcopy(lean_model("qwen2"))
    monkeypatch.setattr(segments.shutil, "which", lambda name: None)
    assert "C++ compiler" in segments.compile_runner(model)
    monkeypatch.undo()

    def broken(self, runner):
        raise RuntimeError("C++ compile error\nmore detail")

    monkeypatch.setattr(segments.CompiledSegments, "warm_up", broken)
    assert segments.compile_runner(model) == "compiling failed: C++ compile error"
    assert lean.compiled(model) is None and "compiled" not in lean.describe(model)
    prompt = random_prompt(5, 6)
    with lean.runner_enabled(False):
        expected = greedy_decode(model, prompt, max_new_tokens=16).new_tokens
    assert jacobi_decode(model, prompt, max_new_tokens=16, block_size=4).new_tokens == expected
