"""The lean runtime against transformers' own forward, on every architecture it takes: the same
logits (prefill, chain feeds over a cache with holes, tree feeds), the same greedy tokens
through the engine (block sizes 1 to 32, EOS inside a block, left-padded batches, recycling
trees) in float32; greedy in bfloat16 equal to transformers' bfloat16 greedy; and its cache kept
by the same bookkeeping as a DynamicCache, entry for entry."""

import pytest
import torch
import transformers as tf

from cllm import greedy_decode, jacobi_decode
from cllm.runtime import choose, hf, open_runtime
from cllm.runtime.lean import LeanRuntime, packed, why_not
from cllm.runtime.lean.kernels import packed_rows
from cllm.runtime.lean.runner import PackedWeights
from tests.decoding.conftest import MAX_POSITIONS, VOCAB, random_prompt

LEAN_ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
_MODELS: dict[tuple[str, torch.dtype], torch.nn.Module] = {}
# the lean runtime's options on each float32 CPU layout (`cpu_paths`): its oneDNN-packed weights,
# MKL's GEMM on the model's own weights feature-major, and token-major ("rows", its LM head on
# the packed copy at some widths: `head_plan`)
LAYOUTS = {"packed": {}, "mkl": {"packed": False}, "rows": {"path": "rows"}}


@pytest.fixture(params=list(LAYOUTS))
def layout(request) -> str:
    return request.param


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


VALID = [None, [5, 2, 4], [3, 3, 1], None, None]  # per forward of `feeds`: the positions each row reads


def feeds(runtime, lengths=(7, 3, 11)):
    """A run: three prompts opened in one prefill, chain feeds after which the rows keep different
    counts (holes in the cache), a tree feed (two branches), one token more. Returns the logits of
    each forward."""
    prompts = [random_prompt(s, n)[0].tolist() for s, n in zip((1, 2, 3), lengths, strict=True)]
    fed = torch.randint(2, VOCAB, (3, 5), generator=torch.Generator().manual_seed(4)).tolist()
    session = runtime.session()
    rows, first = session.open(prompts)
    logits = [first.logits[:, -1], session.feed(rows, [f[:n] for f, n in zip(fed, (5, 2, 4), strict=True)]).logits]
    session.keep(rows, [range(3), range(1), range(4)])  # different rows keep different counts: holes
    logits.append(session.feed(rows, [f[:n] for f, n in zip(fed, (3, 3, 1), strict=True)]).logits)
    session.keep(rows, [range(1), range(2), range(1)])
    logits.append(session.feed(rows, fed, parents=[[-1, 0, 1, 0, 3]] * 3).logits)  # branches 0-1-2, 0-3-4
    session.keep(rows, [[0, 3], [0, 1, 2], [0]])
    logits.append(session.feed(rows, [f[:1] for f in fed]).logits)
    session.close(rows)
    return [x.clone() for x in logits]


def assert_same_logits(got, want):
    for g, w, valid in zip(got, want, VALID, strict=True):
        if valid is None:
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
        else:  # padded positions compute garbage nobody reads
            for r, n in enumerate(valid):
                torch.testing.assert_close(g[r, :n], w[r, :n], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", LEAN_ARCHS)
@torch.inference_mode()
def test_the_runtime_computes_transformers_logits_through_prefill_feeds_holes_and_trees(arch, layout):
    model = lean_model(arch)
    runtime = open_runtime(model, "lean", **LAYOUTS[layout])
    assert why_not(model) is None and runtime.describe().startswith("lean (")
    assert ("oneDNN-packed" in runtime.describe()) == (layout == "packed")
    got, want = feeds(runtime), feeds(open_runtime(model, "transformers"))
    assert (runtime.runner.packed is not None) == (layout == "packed")  # packed at its first forward
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
    ids = random_prompt(4, 6)[0].tolist()
    lean, reference = open_runtime(model, "lean"), open_runtime(model, "transformers")

    def logits(runtime):
        session = runtime.session()
        rows, out = session.open([ids])
        session.close(rows)
        return out.logits.clone()

    for change in ("in place", "replaced"):
        before = logits(lean)
        layer = model.model.layers[0]
        with torch.inference_mode(False), torch.no_grad():
            if change == "in place":
                layer.mlp.up_proj.weight.mul_(-1.5)
            else:
                layer.self_attn.v_proj.weight = torch.nn.Parameter(torch.randn_like(layer.self_attn.v_proj.weight))
        got, want = logits(lean), logits(reference)
        assert not torch.allclose(got, before, atol=1e-3), change
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_model_too_large_to_pack_computes_on_its_own_weights(monkeypatch):
    model = lean_model("llama")
    monkeypatch.setattr(PackedWeights, "MAX_BYTES", 1000)
    assert "MKL's GEMM: a packed copy would take" in LeanRuntime(model).describe()


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
    full = greedy_decode(open_runtime(model, "transformers"), torch.tensor([prompts[0]]),
                         max_new_tokens=40).new_tokens[0]
    eos = next((t for i, t in enumerate(full[3:30], 3) if t not in full[:i]), None)
    T = max(map(len, prompts))
    ids = torch.tensor([[0] * (T - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask, eos


@pytest.mark.parametrize("name", list(SETTINGS))
@pytest.mark.parametrize("arch", LEAN_ARCHS)
def test_the_engine_on_the_runtime_gives_transformers_greedy_tokens(arch, name, layout):
    model = lean_model(arch)
    ids, mask, eos = padded_batch(model)
    expected = greedy_decode(open_runtime(model, "transformers"), ids, mask, max_new_tokens=40,
                             eos_token_id=eos).new_tokens
    got = jacobi_decode(open_runtime(model, "lean", **LAYOUTS[layout]), ids, mask, max_new_tokens=40,
                        eos_token_id=eos, generator=torch.Generator().manual_seed(0), **SETTINGS[name])
    assert got.new_tokens == expected, (arch, name)
    assert eos in got.new_tokens[0]


@pytest.mark.parametrize("arch", LEAN_ARCHS)
def test_in_bfloat16_the_runtime_gives_same_dtype_transformers_greedy_tokens(arch):
    """Greedy decoding on the lean runtime equals transformers' in bfloat16 too. (Jacobi's
    exactness is a float32 promise on either forward: in bfloat16 a forward over k tokens rounds
    differently from k one-token forwards, so near-ties can go the other way.)"""
    model = lean_model(arch, torch.bfloat16)
    lean, reference = open_runtime(model, "lean"), open_runtime(model, "transformers")
    for seed in (8, 9, 10):
        prompt = random_prompt(seed, 10)
        expected = greedy_decode(reference, prompt, max_new_tokens=32).new_tokens
        assert greedy_decode(lean, prompt, max_new_tokens=32).new_tokens == expected, (arch, seed)


ROPE_VARIANTS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}


@pytest.mark.parametrize("variant", list(ROPE_VARIANTS))
@torch.inference_mode()
def test_rope_scaling_and_biases_match_transformers_past_the_first_rope_table(variant, layout):
    """Llama with a scaled RoPE, attention and MLP biases: the runtime's logits are transformers'
    through a prompt and feeds that reach past the first RoPE table (256 positions) and, for
    "dynamic", past the original context, where the frequencies change."""
    config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                            attention_bias=True, mlp_bias=True, initializer_range=0.2,
                            rope_parameters={"rope_theta": 10000.0, **ROPE_VARIANTS[variant]})
    torch.manual_seed(7)
    with torch.inference_mode(False):
        model = tf.LlamaForCausalLM(config).eval()
    assert why_not(model) is None
    ids = torch.randint(2, VOCAB, (2, 250), generator=torch.Generator().manual_seed(3)).tolist()
    fed = torch.randint(2, VOCAB, (2, 6), generator=torch.Generator().manual_seed(4)).tolist()

    def run(runtime):
        session = runtime.session()
        rows, first = session.open(ids)
        logits = [first.logits]
        for _ in range(3):  # 250 -> 268 positions
            logits.append(session.feed(rows, fed).logits)
            session.keep(rows, [range(6)] * 2)
        return [x.clone() for x in logits]

    got, want = run(open_runtime(model, "lean", **LAYOUTS[layout])), run(open_runtime(model, "transformers"))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_rows_leaving_and_joining_the_lean_cache_move_only_themselves():
    session = open_runtime(lean_model("llama"), "lean").session()
    rows, _ = session.open([random_prompt(21, 5)[0].tolist()] * 4)
    buffer = session.batch.storage.buffers[0][0]
    first_row = buffer[0, :, :5].clone()
    session.close([rows[1]])
    assert session.rows() == [rows[0], rows[3], rows[2]]  # the last row took the leaver's place
    other = random_prompt(22, 3)[0].tolist()
    (joined,), _ = session.open([other])  # joins in the row the leaver freed: no reallocation
    assert session.batch.storage.buffers[0][0] is buffer and session.batch.storage.rows == 4
    assert torch.equal(buffer[0, :, :5], first_row)
    alone = open_runtime(lean_model("llama"), "lean").session()
    alone.open([other])
    assert torch.equal(buffer[3, :, 2:5], alone.batch.storage.buffers[0][0][0, :, :3])
    assert session.rows()[-1] == joined


def test_other_models_and_training_keep_transformers_forward():
    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=VOCAB)).eval()
    name, why = choose(gpt2)
    assert name == "transformers" and "gpt2" in why and "gpt2" in why_not(gpt2)
    assert open_runtime(gpt2).describe().startswith("transformers' forward (auto: the lean runtime cannot run it")
    with pytest.raises(ValueError, match="cannot run this model: architecture 'gpt2'"):
        open_runtime(gpt2, "lean")
    windowed = tf.MistralForCausalLM(tf.MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                      num_hidden_layers=1, num_attention_heads=2,
                                                      num_key_value_heads=1, max_position_embeddings=512,
                                                      sliding_window=64)).eval()
    assert "sliding" in why_not(windowed)
    model = lean_model("llama")
    assert choose(model) == ("lean", "auto: a llama model, which the lean runtime runs")
    model.train()
    try:
        assert choose(model)[0] == "transformers"  # dropout and gradients: transformers' forward
    finally:
        model.eval()


def kv_entries(session) -> list[torch.Tensor]:
    """Every layer's keys and values as the session's storage holds them, (B, H, S, D) each."""
    storage = session.batch.storage
    if isinstance(storage, hf.CacheStorage):
        return [x.clone() for layer in storage.cache.layers for x in (layer.keys, layer.values)]
    return [storage.view(which, i).clone() for i in range(len(storage.buffers[0])) for which in (0, 1)]


@torch.inference_mode()
def test_the_lean_cache_is_kept_as_a_dynamic_cache_is(layout):
    model = lean_model("qwen2")
    prompts = [random_prompt(seed, n)[0].tolist() for seed, n in ((11, 6), (12, 9), (13, 2))]
    fed = torch.randint(2, VOCAB, (3, 6), generator=torch.Generator().manual_seed(3)).tolist()

    def run(runtime):
        session = runtime.session()
        rows = [row for p in prompts for row in session.open([p])[0]]  # rows of different lengths join
        session.feed(rows, fed)
        session.keep(rows, [range(6)] * 3)
        session.rewind(rows, [session.length(r) - d for r, d in zip(rows, (2, 0, 1), strict=True)])
        session.feed(rows, [f[:4] for f in fed])
        session.keep(rows, [range(1), range(3), range(2)])  # holes
        session.close([rows[0]])  # the last row takes the first one's place
        assert session.rows() == [rows[2], rows[1]]
        # the second row's third output is its padding's, nobody's
        logits = session.feed(session.rows(), [fed[0][:3], fed[1][:2]]).logits[:, :2]
        session.keep(session.rows(), [range(1), range(2)])
        session.batch.compact()
        return kv_entries(session), [session.length(r) for r in session.rows()], logits.clone()

    (got, got_lengths, got_logits) = run(open_runtime(model, "lean", **LAYOUTS[layout]))
    (want, want_lengths, want_logits) = run(open_runtime(model, "transformers"))
    assert got_lengths == want_lengths
    torch.testing.assert_close(got_logits[0, :1], want_logits[0, :1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_logits[1], want_logits[1], rtol=1e-4, atol=1e-4)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_packed_forwards_run_on_few_widths_each_at_least_the_tokens_fed():
    widths = [packed_rows(t) for t in range(1, 4097)]
    assert widths[:32] == list(range(1, 33))  # decoding steps: exactly their tokens
    assert all(w >= t for t, w in enumerate(widths, 1)) and widths == sorted(widths)
    assert len(set(widths)) <= 32 + 14 + 12 + 12  # oneDNN builds kernels for each width it meets
    assert max(w / t for t, w in enumerate(widths, 1)) < 1.5


def test_prepare_packs_and_warms_before_the_first_forward_and_leaves_other_models_alone(layout):
    torch.manual_seed(5)
    with torch.inference_mode(False):
        model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                   num_hidden_layers=1, num_attention_heads=2)).eval()
    runtime = open_runtime(model, "lean", **LAYOUTS[layout])
    runtime.prepare()
    assert (runtime.runner.packed is not None) == (layout != "mkl")
    assert runtime.runner.plan is not None and "the layout measured fastest here" in runtime.describe() \
        or layout == "rows"
    ids = random_prompt(6, 5)
    expected = greedy_decode(open_runtime(model, "transformers"), ids, max_new_tokens=12).new_tokens
    assert jacobi_decode(runtime, ids, max_new_tokens=12, block_size=4).new_tokens == expected
    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=VOCAB)).eval()
    open_runtime(gpt2).prepare()  # transformers' forward: nothing to do


def test_a_larger_model_is_readied_at_a_few_widths_in_one_round(monkeypatch):
    """Past `WARM_MAX_BYTES` of packed weights, `prepare` times the layouts at `LARGE_WIDTHS` only
    (each forward of such a model costs tens of milliseconds on a CPU), and still plans."""
    from cllm.runtime.lean import runner as lean_runner

    monkeypatch.setattr(lean_runner, "WARM_MAX_BYTES", 1000)
    runtime = open_runtime(lean_model("llama"), "lean")
    runtime.prepare()
    assert runtime.runner.plan.widths == lean_runner.LARGE_WIDTHS


def test_where_the_onednn_kernels_do_not_compute_what_f_linear_does_the_plain_weights_decode(monkeypatch):
    """A torch whose oneDNN ops changed meaning (here: SiLU made wrong for the check) is refused
    in one line and decoded exactly on the MKL path."""
    monkeypatch.setattr(packed.F, "silu", lambda t: t * 2)
    packed.packing_available.cache_clear()
    try:
        assert not packed.packing_available()
        torch.manual_seed(9)
        with torch.inference_mode(False):
            model = tf.LlamaForCausalLM(tf.LlamaConfig(
                vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2)).eval()
        runtime = open_runtime(model, "lean")
        assert runtime.describe().startswith(
            "lean (llama, float32; MKL's GEMM: this torch has no oneDNN linear kernels)")
        monkeypatch.undo()  # the decoding below runs on the real SiLU
        ids = random_prompt(7, 6)
        expected = greedy_decode(open_runtime(model, "transformers"), ids, max_new_tokens=12).new_tokens
        assert jacobi_decode(runtime, ids, max_new_tokens=12, block_size=4).new_tokens == expected
        assert runtime.runner.packed is None
    finally:
        packed.packing_available.cache_clear()
