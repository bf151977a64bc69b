"""The lean runner against transformers' own forward, on every architecture it takes: the same
logits (prefill, causal feeds over a cache with holes, tree feeds), the same greedy tokens
through the engine (block sizes 1 to 32, EOS inside a block, left-padded batches, recycling
trees) in float32; greedy in bfloat16 equal to transformers' bfloat16 greedy; and its cache
edited by the adapter exactly as a DynamicCache is."""

import pytest
import torch
import transformers as tf

from cllm import greedy_decode, jacobi_decode
from cllm.runtime import hf_cache as kv
from cllm.runtime.lean import cpu_paths, packed
from cllm.runtime.lean import runner as lean
from tests.decoding.conftest import MAX_POSITIONS, VOCAB, random_prompt

LEAN_ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
_MODELS: dict[tuple[str, torch.dtype], torch.nn.Module] = {}


@pytest.fixture(autouse=True, params=["packed", "mkl", "rows"])
def packing(request):
    """Every test here runs on each float32 CPU path of the runner (`cpu_paths`): its
    oneDNN-packed weights, MKL's GEMM on the model's own feature-major, and token-major ("rows",
    its LM head on the packed copy at some widths: `head_plan`)."""
    with lean.packed_enabled(request.param != "mkl"), cpu_paths.forced("rows" if request.param == "rows" else None):
        yield request.param


def lean_model(arch: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    if (arch, dtype) not in _MODELS:
        sizes = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS,
                     initializer_range=0.2, bos_token_id=0, eos_token_id=1, pad_token_id=0)
        config = {"llama": tf.LlamaConfig, "mistral": tf.MistralConfig, "qwen2": tf.Qwen2Config,
                  "qwen3": tf.Qwen3Config}[arch](**sizes)
        torch.manual_seed(1234)
        with torch.inference_mode(False):  # ordinary parameters, even when built inside an inference-mode test
            _MODELS[arch, dtype] = tf.AutoModelForCausalLM.from_config(config).to(dtype).eval()
    return _MODELS[arch, dtype]


def both(model, fn):
    """fn() with the lean runner, then with transformers' forward."""
    with lean.runner_enabled(True):
        a = fn()
    with lean.runner_enabled(False):
        b = fn()
    return a, b


VALID = [None, [5, 2, 4], [3, 3, 1], None, None]  # per forward of `feeds`: the positions each row reads


def feeds(model, lengths=(7, 3, 11)):
    """A run on `model`: a prefill of three left-padded prompts, causal feeds after which the rows
    keep different counts (holes in the cache), a tree feed, one token more. run() returns the
    logits of each forward and the cache's type."""
    prompts = [random_prompt(s, n)[0].tolist() for s, n in zip((1, 2, 3), lengths, strict=True)]
    T = max(map(len, prompts))
    ids = torch.tensor([[0] * (T - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    fed = torch.randint(2, VOCAB, (3, 5), generator=torch.Generator().manual_seed(4))
    tree = torch.tensor([[True] * 5] * 5).tril()
    tree[3, 1:3] = False  # node 3 hangs off node 0: a second branch
    offsets = torch.tensor([[0, 1, 2, 1, 2]] * 3)

    def run():
        rc, first = kv.prefill(model, ids, mask)
        logits = [first, kv.feed(model, rc, fed, [5, 2, 4])]
        kv.commit(rc, [3, 1, 4], fed=5)  # different rows keep different counts: holes
        logits.append(kv.feed(model, rc, fed[:, :3], [3, 3, 1]))
        kv.commit(rc, [1, 2, 1], fed=3)
        logits.append(kv.feed_tree(model, rc, fed, offsets, tree[None].expand(3, 5, 5)))
        kv.commit_kept(rc, [[0, 3], [0, 1, 2], [0]], fed=5)
        logits.append(kv.feed(model, rc, fed[:, :1], [1, 1, 1]))
        return [x.clone() for x in logits], type(rc.kv).__name__

    return run


def assert_same_logits(got, want):
    for g, w, valid in zip(got, want, VALID, strict=True):
        if valid is None:
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
        else:  # padded positions compute garbage nobody reads
            for r, n in enumerate(valid):
                torch.testing.assert_close(g[r, :n], w[r, :n], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", LEAN_ARCHS)
@torch.inference_mode()
def test_the_runner_computes_transformers_logits_through_prefill_feeds_holes_and_trees(arch, packing):
    model = lean_model(arch)
    assert lean.why_not(model) is None and lean.describe(model).startswith("lean runner")
    assert ("oneDNN-packed" in lean.describe(model)) == (packing == "packed")
    (got, kind), (want, other) = both(model, feeds(model))
    assert kind == "LeanKV" and other == "DynamicCache"
    assert packing != "packed" or lean.runner_for(model).packed is not None
    assert_same_logits(got, want)


@torch.inference_mode()
def test_weights_changed_after_packing_are_packed_again():
    """An optimizer step changes the weights in place, loading a checkpoint replaces them: the
    next forward computes with the new ones either way."""
    torch.manual_seed(3)
    with torch.inference_mode(False):
        model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                   num_hidden_layers=1, num_attention_heads=2,
                                                   initializer_range=0.2)).eval()
    ids = random_prompt(4, 6)

    def logits():
        return kv.prefill(model, ids, torch.ones_like(ids))[1].clone()

    for change in ("in place", "replaced"):
        before = both(model, logits)[0]
        layer = model.model.layers[0]
        with torch.inference_mode(False), torch.no_grad():
            if change == "in place":
                layer.mlp.up_proj.weight.mul_(-1.5)
            else:
                layer.self_attn.v_proj.weight = torch.nn.Parameter(torch.randn_like(layer.self_attn.v_proj.weight))
        got, want = both(model, logits)
        assert not torch.allclose(got, before, atol=1e-3), change
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_model_too_large_to_pack_computes_on_its_own_weights(monkeypatch):
    model = lean_model("llama")
    monkeypatch.setattr(lean.PackedWeights, "MAX_BYTES", 1000)
    with lean.packed_enabled(True), cpu_paths.forced(None):
        assert "MKL's GEMM: a packed copy would take" in lean.describe(model)


SETTINGS = {
    "ar": dict(block_size=1),
    "n=4": dict(block_size=4),
    "n=16": dict(block_size=16),
    "n=32": dict(block_size=32),
    "recycling": dict(block_size=4, recycle=8, recycle_budget=24),
}


def padded_batch(model):
    """Three left-padded prompts (ids, mask) and an EOS that the first one's greedy text reaches
    mid-block (the first token there not seen before)."""
    prompts = [random_prompt(s, n)[0].tolist() for s, n in ((5, 9), (6, 4), (7, 14))]
    with lean.runner_enabled(False):
        full = greedy_decode(model, torch.tensor([prompts[0]]), max_new_tokens=40).new_tokens[0]
    eos = next((t for i, t in enumerate(full[3:30], 3) if t not in full[:i]), None)
    T = max(map(len, prompts))
    ids = torch.tensor([[0] * (T - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask, eos


@pytest.mark.parametrize("name", list(SETTINGS))
@pytest.mark.parametrize("arch", LEAN_ARCHS)
def test_the_engine_on_the_runner_gives_transformers_greedy_tokens(arch, name):
    model = lean_model(arch)
    ids, mask, eos = padded_batch(model)
    with lean.runner_enabled(False):
        expected = greedy_decode(model, ids, mask, max_new_tokens=40, eos_token_id=eos).new_tokens
    with lean.runner_enabled(True):
        got = jacobi_decode(model, ids, mask, max_new_tokens=40, eos_token_id=eos,
                            generator=torch.Generator().manual_seed(0), **SETTINGS[name])
    assert got.new_tokens == expected, (arch, name)
    assert eos in got.new_tokens[0]


@pytest.mark.parametrize("arch", LEAN_ARCHS)
def test_in_bfloat16_the_runner_gives_same_dtype_transformers_greedy_tokens(arch):
    """Greedy decoding on the runner equals transformers' in bfloat16 too. (Jacobi's exactness is
    a float32 promise on either forward: in bfloat16 a forward over k tokens rounds differently
    from k one-token forwards, so near-ties can go the other way.)"""
    model = lean_model(arch, torch.bfloat16)
    for seed in (8, 9, 10):
        prompt = random_prompt(seed, 10)
        with lean.runner_enabled(False):
            expected = greedy_decode(model, prompt, max_new_tokens=32).new_tokens
        with lean.runner_enabled(True):
            assert greedy_decode(model, prompt, max_new_tokens=32).new_tokens == expected, (arch, seed)


ROPE_VARIANTS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}


@pytest.mark.parametrize("variant", list(ROPE_VARIANTS))
@torch.inference_mode()
def test_rope_scaling_and_biases_match_transformers_past_the_first_rope_table(variant):
    """Llama with a scaled RoPE, attention and MLP biases: the runner's logits are transformers'
    through a prompt and feeds that reach past the first RoPE table (256 positions) and, for
    "dynamic", past the original context, where the frequencies change."""
    config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                            attention_bias=True, mlp_bias=True, initializer_range=0.2,
                            rope_parameters={"rope_theta": 10000.0, **ROPE_VARIANTS[variant]})
    torch.manual_seed(7)
    with torch.inference_mode(False):
        model = tf.LlamaForCausalLM(config).eval()
    assert lean.why_not(model) is None
    ids = torch.randint(2, VOCAB, (2, 250), generator=torch.Generator().manual_seed(3))
    fed = torch.randint(2, VOCAB, (2, 6), generator=torch.Generator().manual_seed(4))

    def run():
        rc, first = kv.prefill(model, ids, torch.ones_like(ids))
        logits = [first]
        for _ in range(3):  # 250 -> 268 positions
            logits.append(kv.feed(model, rc, fed, [6, 6]))
            kv.commit(rc, [6, 6], fed=6)
        return [x.clone() for x in logits]

    got, want = both(model, run)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_rows_leaving_and_joining_the_lean_cache_move_only_themselves():
    model = lean_model("llama")
    rc, _ = kv.prefill(model, random_prompt(21, 5).repeat(4, 1), torch.ones(4, 5, dtype=torch.long))
    buffer = rc.kv.buffers[0][0]
    first_row = buffer[0, :, :5].clone()
    kv.keep_rows(rc, [0, 2, 3])
    other, _ = kv.prefill(model, random_prompt(22, 3), torch.ones(1, 3, dtype=torch.long))
    kv.append_rows(rc, other)  # joins in the row the leaver freed: no reallocation
    assert rc.kv.buffers[0][0] is buffer and rc.kv.rows == 4
    assert torch.equal(buffer[0, :, :5], first_row)
    assert torch.equal(buffer[3, :, 2:5], other.kv.buffers[0][0][0, :, :3])


def test_other_models_and_training_keep_transformers_forward():
    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=VOCAB)).eval()
    assert "gpt2" in lean.why_not(gpt2) and lean.runner_for(gpt2) is None
    assert lean.describe(gpt2).startswith("transformers' forward: ")
    windowed = tf.MistralForCausalLM(tf.MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                      num_hidden_layers=1, num_attention_heads=2,
                                                      num_key_value_heads=1, max_position_embeddings=512,
                                                      sliding_window=64)).eval()
    assert "sliding" in lean.why_not(windowed)
    model = lean_model("llama")
    model.train()
    try:
        assert lean.runner_for(model) is None  # dropout and gradients: transformers' forward
    finally:
        model.eval()
    with torch.enable_grad():  # a training forward never gets the lean cache
        rc, _ = kv.prefill(model, random_prompt(1, 4), torch.ones(1, 4, dtype=torch.long))
        assert type(rc.kv).__name__ == "DynamicCache"


@torch.inference_mode()
def test_the_lean_cache_is_edited_by_the_adapter_as_a_dynamic_cache_is():
    model = lean_model("qwen2")
    a, b, c = random_prompt(11, 6), random_prompt(12, 9), random_prompt(13, 2)

    def run():
        rc, _ = kv.prefill(model, a, torch.ones_like(a))
        for prompt in (b, c):  # rows of different lengths: the shorter part padded, hidden
            other, _ = kv.prefill(model, prompt, torch.ones_like(prompt))
            kv.append_rows(rc, other)
        fed = torch.randint(2, VOCAB, (3, 6), generator=torch.Generator().manual_seed(3))
        kv.feed(model, rc, fed, [6, 6, 6])
        kv.commit(rc, [6, 6, 6], fed=6)
        kv.rollback(rc, [2, 0, 1])  # a draft model's rejected tokens: forgotten
        kv.feed(model, rc, fed[:, :4], [4, 4, 4])
        kv.commit(rc, [1, 3, 2], fed=4)  # holes
        assert kv.keep_rows(rc, [1, 2]) == [2, 1]  # the last row takes the place of the first
        logits = kv.feed(model, rc, fed[:2, :3], [3, 2])[:, :2]  # the padding's outputs are nobody's
        kv.compact(rc)
        kv.select_rows(rc, [1])
        return [(layer.keys.clone(), layer.values.clone()) for layer in rc.kv.layers], rc.lengths, logits.clone()

    (got, got_lengths, got_logits), (want, want_lengths, want_logits) = both(model, run)
    assert got_lengths == want_lengths
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4)
    for (gk, gv), (wk, wv) in zip(got, want, strict=True):
        torch.testing.assert_close(gk, wk, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gv, wv, rtol=1e-5, atol=1e-5)


def test_the_blocked_argmax_gives_torchs_indices_on_feature_major_logits_ties_included():
    generator = torch.Generator().manual_seed(5)
    by_vocab = torch.randn(1024, 3 * 40, generator=generator)  # (V, B * L), as the runner makes them
    by_vocab[700, 0] = by_vocab[900, 0] = by_vocab[10, 0] = 9.0  # a tie across blocks: the first wins
    by_vocab[300, 1] = by_vocab[301, 1] = 9.0  # a tie within a block
    by_vocab[:, 2] = 0.0  # a tie everywhere
    logits = by_vocab.t().view(3, 40, 1024)
    got = lean.argmax(logits)
    assert torch.equal(got, logits.argmax(-1))
    assert got[0, :3].tolist() == [10, 300, 0]
    assert torch.equal(lean.argmax(logits.contiguous()), logits.argmax(-1))  # other layouts: torch's own


def test_packed_forwards_run_on_few_widths_each_at_least_the_tokens_fed():
    widths = [lean.packed_rows(t) for t in range(1, 4097)]
    assert widths[:32] == list(range(1, 33))  # decoding steps: exactly their tokens
    assert all(w >= t for t, w in enumerate(widths, 1)) and widths == sorted(widths)
    assert len(set(widths)) <= 32 + 14 + 12 + 12  # oneDNN builds kernels for each width it meets
    assert max(w / t for t, w in enumerate(widths, 1)) < 1.5


def test_prepare_packs_and_warms_before_the_first_forward_and_leaves_other_models_alone(packing):
    torch.manual_seed(5)
    with torch.inference_mode(False):
        model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                   num_hidden_layers=1, num_attention_heads=2)).eval()
    lean.prepare(model)
    assert (lean.runner_for(model).packed is not None) == (packing != "mkl")
    ids = random_prompt(6, 5)
    with lean.runner_enabled(False):
        expected = greedy_decode(model, ids, max_new_tokens=12).new_tokens
    assert jacobi_decode(model, ids, max_new_tokens=12, block_size=4).new_tokens == expected
    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=VOCAB)).eval()
    lean.prepare(gpt2)  # no runner: nothing to do
    assert lean.runner_for(gpt2) is None


def test_where_the_onednn_kernels_do_not_compute_what_f_linear_does_the_plain_weights_decode(monkeypatch):
    """A torch whose oneDNN ops changed meaning (here: SiLU made wrong for the check) is refused
    in one line and decoded exactly on the MKL path."""
    monkeypatch.setattr(packed.F, "silu", lambda t: t * 2)
    packed.packing_available.cache_clear()
    with lean.packed_enabled(True), cpu_paths.forced(None):
        try:
            assert not packed.packing_available()
            torch.manual_seed(9)
            with torch.inference_mode(False):
                model = tf.LlamaForCausalLM(tf.LlamaConfig(
                    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                    num_attention_heads=2)).eval()
            assert lean.describe(model).endswith("MKL's GEMM: this torch has no oneDNN linear kernels)")
            monkeypatch.undo()  # the decoding below runs on the real SiLU
            ids = random_prompt(7, 6)
            with lean.runner_enabled(False):
                expected = greedy_decode(model, ids, max_new_tokens=12).new_tokens
            assert jacobi_decode(model, ids, max_new_tokens=12, block_size=4).new_tokens == expected
            assert lean.runner_for(model).packed is None
        finally:
            packed.packing_available.cache_clear()
