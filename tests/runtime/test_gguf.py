"""The GGUF exporter. Without `gguf` (`make test`): every weight under llama.cpp's name and equal
to the model's (the q/k rows reordered for llama.cpp's rotation, checked against both
rotations), the half types, the hyperparameters, the vocabulary and its split, the one-line
refusals. With `gguf` (marked `llamacpp`, run by `make test-llamacpp`): files written and read
back with `gguf.GGUFReader`, the constants this module keeps equal to `gguf`'s. `cllm export`
itself is tested in tests/serving/test_export.py.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from cllm.cli import main
from cllm.core.errors import UserError
from cllm.data.tokenizer import train_tokenizer
from cllm.runtime.gguf import (
    CONTROL,
    FILE_TYPES,
    LAYER_TENSORS,
    NORMAL,
    SOURCE_KEY,
    TOP_TENSORS,
    UNUSED,
    USER_DEFINED,
    architecture,
    gguf_tensors,
    gguf_vocab,
    import_gguf,
    pair_rotation,
    pre_tokenizer_name,
    read_source,
    write_gguf,
)
from tests.tiny import CODE_TEXTS

VOCAB = 320


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(CODE_TEXTS * 3, vocab_size=VOCAB, min_frequency=1)


def tiny_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    settings = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
                    tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(LlamaConfig(**{**settings, **overrides})).eval()


def tiny_qwen2(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                        tie_word_embeddings=True)).eval()


def expected_weights(model, heads: int, kv_heads: int, *, permute: bool) -> dict[str, torch.Tensor]:
    """llama.cpp's name -> the weight it must hold, from the Hugging Face state dict (names
    spelled out here, not taken from the module under test)."""
    out = {}
    for name, w in model.state_dict().items():
        parts = name.split(".")
        if name.startswith("model.layers."):
            block, hf = parts[2], ".".join(parts[3:-1])
            role = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                    "mlp.down_proj": "ffn_down"}[hf]
            if permute and role in ("attn_q", "attn_k"):
                w = pair_rotation(w, heads if role == "attn_q" else kv_heads)
            out[f"blk.{block}.{role}.{parts[-1]}"] = w
        else:
            out[{"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}[name]] = w
    return out


def planned(model, out_type: str = "f32") -> dict[str, np.ndarray]:
    return dict(gguf_tensors(model, architecture(model.config), out_type))


# ---------------------------------------------------------------------------- without gguf


def test_every_weight_gets_llama_cpps_name_and_equals_the_models():
    model = tiny_llama(attention_bias=True, mlp_bias=True)
    arrays, expected = planned(model), expected_weights(model, 4, 2, permute=True)
    assert set(arrays) == set(expected)
    for name, weight in expected.items():
        assert arrays[name].dtype == np.float32, name
        np.testing.assert_array_equal(arrays[name], weight.numpy(), name)


@pytest.mark.parametrize("out_type, numpy_of", [
    ("f16", lambda w: w.half().numpy()),
    ("bf16", lambda w: w.bfloat16().view(torch.uint8).numpy()),
])
def test_half_types_round_the_matrices_and_keep_the_norms_f32(out_type, numpy_of):
    model = tiny_llama()
    arrays = planned(model, out_type)
    for name, weight in expected_weights(model, 4, 2, permute=True).items():
        if weight.dim() == 1:
            assert arrays[name].dtype == np.float32, name
            np.testing.assert_array_equal(arrays[name], weight.numpy())
        else:
            np.testing.assert_array_equal(arrays[name].reshape(-1).view(np.uint8),
                                          numpy_of(weight).reshape(-1).view(np.uint8))


def test_qwen2_keeps_its_rotation_and_its_biases_and_ties_the_output():
    model = tiny_qwen2()
    arch = architecture(model.config)
    assert arch.name == "qwen2" and not arch.permute_qk and arch.tied
    arrays, expected = planned(model), expected_weights(model, 4, 2, permute=False)
    expected.pop("output.weight")  # tied: llama.cpp uses token_embd
    assert set(arrays) == set(expected) and "blk.0.attn_q.bias" in arrays
    for name, weight in expected.items():
        np.testing.assert_array_equal(arrays[name], weight.numpy(), name)


def test_the_architecture_is_the_models_shape():
    arch = architecture(tiny_llama(rope_theta=5000.0).config)
    assert (arch.name, arch.permute_qk, arch.tied) == ("llama", True, False)
    assert (arch.context, arch.hidden, arch.layers, arch.ffn, arch.heads, arch.kv_heads, arch.head_dim) == (
        128, 32, 2, 64, 4, 2, 8)
    assert arch.rope_theta == pytest.approx(5000.0) and arch.rms_eps == pytest.approx(1e-5)
    assert architecture(tiny_llama(head_dim=16).config).head_dim == 16


def _rope_half_split(x: torch.Tensor, pos: int, base: float = 10000.0) -> torch.Tensor:
    """Hugging Face's rotation of one head (d,): pairs (i, i + d/2)."""
    d = x.shape[0]
    angle = pos * base ** (-torch.arange(d // 2, dtype=torch.float64) * 2 / d)
    a, b = x[: d // 2], x[d // 2:]
    return torch.cat([a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()])


def _rope_adjacent(x: torch.Tensor, pos: int, base: float = 10000.0) -> torch.Tensor:
    """llama.cpp's rotation of one head for Llama (LLAMA_ROPE_TYPE_NORM): pairs (2i, 2i + 1)."""
    d = x.shape[0]
    angle = pos * base ** (-torch.arange(d // 2, dtype=torch.float64) * 2 / d)
    a, b = x[0::2], x[1::2]
    out = torch.empty_like(x)
    out[0::2], out[1::2] = a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()
    return out


def test_reordered_projections_rotated_adjacently_equal_the_reordered_half_split_rotation():
    """What the reordering is for: llama.cpp rotating the reordered query gives the reordered
    version of what Hugging Face computes, so every q.k product is the same."""
    torch.manual_seed(0)
    heads, d, hidden = 3, 8, 12
    weight, x = torch.randn(heads * d, hidden, dtype=torch.float64), torch.randn(hidden, dtype=torch.float64)
    hf = (weight @ x).reshape(heads, d)
    ours = (pair_rotation(weight, heads) @ x).reshape(heads, d)
    for pos in (0, 1, 7, 100):
        want = pair_rotation(torch.stack([_rope_half_split(h, pos) for h in hf]).reshape(-1, 1), heads)
        got = torch.stack([_rope_adjacent(h, pos) for h in ours]).reshape(-1, 1)
        torch.testing.assert_close(got, want)
    bias = torch.arange(heads * d, dtype=torch.float64)  # a bias vector is reordered the same way
    assert pair_rotation(bias, heads)[:4].tolist() == [0, 4, 1, 5]


def test_the_vocabulary_is_the_tokenizers_with_the_gpt2_split(tokenizer):
    vocab = gguf_vocab(tokenizer, VOCAB)
    assert vocab.tokens == [tokenizer.convert_ids_to_tokens(i) for i in range(VOCAB)]
    assert vocab.types[0] == CONTROL and set(vocab.types[1:]) == {NORMAL}  # <|endoftext|> = 0
    assert vocab.pre == "gpt-2"
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    assert vocab.merges == [m if isinstance(m, str) else " ".join(m) for m in merges]
    assert vocab.special == {"bos": 0, "eos": 0, "pad": 0, "unk": None}
    assert not vocab.add_bos and not vocab.add_eos  # the tokenizer adds nothing on its own


def test_a_vocabulary_smaller_than_the_embedding_is_padded_with_unused_tokens(tokenizer):
    vocab = gguf_vocab(tokenizer, VOCAB + 8)
    assert len(vocab.tokens) == VOCAB + 8 and vocab.tokens[-1] == f"[PAD{VOCAB + 7}]"
    assert set(vocab.types[VOCAB:]) == {UNUSED}
    with pytest.raises(UserError, match="beyond the model's"):
        gguf_vocab(tokenizer, VOCAB - 1)


def test_added_tokens_keep_their_text_and_kind():
    tokenizer = train_tokenizer(CODE_TEXTS * 3, vocab_size=VOCAB, min_frequency=1)
    tokenizer.add_tokens(["<fim>"])
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|sep|>"]})
    vocab = gguf_vocab(tokenizer, VOCAB + 2)
    assert vocab.tokens[VOCAB:] == ["<fim>", "<|sep|>"] and vocab.types[VOCAB:] == [USER_DEFINED, CONTROL]


def test_pre_tokenizers_llama_cpp_has_no_name_for_are_refused(tokenizer):
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    assert pre_tokenizer_name(spec) == "gpt-2"
    for change in ({"pre_tokenizer": {"type": "Whitespace"}},
                   {"pre_tokenizer": {**spec["pre_tokenizer"], "add_prefix_space": True}},
                   {"normalizer": {"type": "Lowercase"}},
                   {"model": {**spec["model"], "type": "WordPiece"}},
                   {"model": {**spec["model"], "byte_fallback": True}}):
        with pytest.raises(UserError):
            pre_tokenizer_name({**spec, **change})


def test_other_architectures_scaled_rope_and_unknown_weights_are_refused():
    model = tiny_llama()
    model.config.model_type = "gpt2"
    with pytest.raises(UserError, match="Llama and Qwen2"):
        architecture(model.config)
    with pytest.raises(UserError, match="rope scaling"):
        architecture(tiny_llama(rope_scaling={"rope_type": "linear", "factor": 2.0}).config)
    with pytest.raises(UserError, match="activation"):
        architecture(tiny_llama(hidden_act="gelu").config)
    model = tiny_llama()
    model.register_buffer("extra", torch.zeros(2))
    with pytest.raises(UserError, match="no place in llama.cpp"):
        planned(model)


def test_without_gguf_export_says_what_to_install_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` raises ImportError
    with pytest.raises(UserError, match="pip install"):
        import_gguf()
    assert main(["export", "--model", "stdlib-coder", "--gguf", str(tmp_path / "m.gguf")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install 'gguf" in err and "cllm[llamacpp]" in err
    assert not (tmp_path / "m.gguf").exists()


# ---------------------------------------------------------------------------- with gguf


@pytest.fixture(scope="module")
def gguf():
    return import_gguf()


def read(gguf, path):
    reader = gguf.GGUFReader(str(path))
    return reader, {t.name: t for t in reader.tensors}


def value(reader, key):
    return reader.get_field(key).contents()


@pytest.mark.llamacpp
def test_the_constants_kept_here_are_ggufs(gguf):
    names = {gguf.TENSOR_NAMES[m] for m in gguf.MODEL_TENSOR}
    assert set(TOP_TENSORS.values()) <= names
    assert {f"blk.{{bid}}.{n}" for n in LAYER_TENSORS.values()} <= names
    assert FILE_TYPES == {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                          "bf16": gguf.LlamaFileType.MOSTLY_BF16}
    assert (NORMAL, CONTROL, USER_DEFINED, UNUSED) == (gguf.TokenType.NORMAL, gguf.TokenType.CONTROL,
                                                        gguf.TokenType.USER_DEFINED, gguf.TokenType.UNUSED)


@pytest.mark.llamacpp
@pytest.mark.parametrize("out_type", ["f32", "f16", "bf16"])
def test_the_file_holds_every_weight_where_llama_cpp_reads_it(gguf, tokenizer, tmp_path, out_type):
    model = tiny_llama(attention_bias=True, mlp_bias=True)
    summary = write_gguf(model, tokenizer, tmp_path / "m.gguf", out_type=out_type, source={"model": "tiny"})
    reader, tensors = read(gguf, summary.path)
    arrays = planned(model, out_type)
    assert set(tensors) == set(arrays) and summary.tensors == len(arrays)
    kind = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
            "bf16": gguf.GGMLQuantizationType.BF16}[out_type]
    for name, array in arrays.items():
        assert tensors[name].tensor_type == (kind if array.ndim > 1 else gguf.GGMLQuantizationType.F32), name
        np.testing.assert_array_equal(np.asarray(tensors[name].data).reshape(-1).view(np.uint8),
                                      array.reshape(-1).view(np.uint8), name)
    assert summary.parameters == sum(p.numel() for p in model.parameters())
    assert read_source(summary.path)["model"] == "tiny" and not list(tmp_path.glob("*.tmp"))


@pytest.mark.llamacpp
def test_the_files_metadata_is_the_models_and_the_tokenizers(gguf, tokenizer, tmp_path):
    reader, _ = read(gguf, write_gguf(tiny_llama(rope_theta=5000.0), tokenizer, tmp_path / "m.gguf").path)
    assert value(reader, "general.architecture") == "llama"
    assert value(reader, "general.file_type") == int(gguf.LlamaFileType.ALL_F32)
    expected = {"context_length": 128, "embedding_length": 32, "block_count": 2, "feed_forward_length": 64,
                "attention.head_count": 4, "attention.head_count_kv": 2, "attention.key_length": 8,
                "attention.value_length": 8, "rope.dimension_count": 8, "vocab_size": VOCAB}
    for key, want in expected.items():
        assert value(reader, f"llama.{key}") == want, key
    assert value(reader, "llama.rope.freq_base") == pytest.approx(5000.0)
    assert value(reader, "llama.attention.layer_norm_rms_epsilon") == pytest.approx(1e-5)
    vocab = gguf_vocab(tokenizer, VOCAB)
    assert value(reader, "tokenizer.ggml.tokens") == vocab.tokens
    assert value(reader, "tokenizer.ggml.token_type") == vocab.types
    assert value(reader, "tokenizer.ggml.merges") == vocab.merges
    assert value(reader, "tokenizer.ggml.model") == "gpt2" and value(reader, "tokenizer.ggml.pre") == "gpt-2"
    assert value(reader, "tokenizer.ggml.bos_token_id") == value(reader, "tokenizer.ggml.eos_token_id") == 0
    assert value(reader, "tokenizer.ggml.add_bos_token") is False


@pytest.mark.llamacpp
def test_the_source_is_recorded_and_other_files_have_none(gguf, tokenizer, tmp_path):
    path = write_gguf(tiny_llama(), tokenizer, tmp_path / "m.gguf", source={"fingerprint": "abc"}).path
    reader, _ = read(gguf, path)
    assert '"fingerprint": "abc"' in value(reader, SOURCE_KEY)
    (tmp_path / "other.gguf").write_bytes(b"not a gguf file")
    assert read_source(tmp_path / "other.gguf") is None
