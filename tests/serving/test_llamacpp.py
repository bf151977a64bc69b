"""The GGUF export in llama.cpp itself (llama-cpp-python; `make test-llamacpp`): the shipped
target and CLLM decode greedily token for token as `greedy_decode` does, llama.cpp tokenizes
the shipped prompt sets into the model tokenizer's ids, and the logits of tiny random models of
each supported shape (grouped-query attention, biases, untied output, Qwen2, other splits) equal
transformers'.

llama_cpp is imported inside the fixtures: `make test` deselects these tests without importing it.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from cllm.data.prompts import encode_prompts, load_prompts, prompt_ids
from cllm.data.tokenizer import train_tokenizer, wrap
from cllm.decoding import greedy_decode
from cllm.models import load_model, load_tokenizer
from cllm.runtime.gguf import PRE_TOKENIZERS, write_gguf
from tests.tiny import CODE_TEXTS

pytestmark = pytest.mark.llamacpp

NEW_TOKENS = 64


def llama(path, **kwargs):
    """llama-cpp-python on a GGUF file: CPU, f32 KV cache (exactness), quiet."""
    import llama_cpp

    settings = dict(n_ctx=512, n_batch=512, n_ubatch=512, n_threads=1, n_gpu_layers=0, seed=0,
                    type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32, verbose=False)
    return llama_cpp.Llama(model_path=str(path), **{**settings, **kwargs})


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """role -> (model, tokenizer, GGUF path) for the shipped target and CLLM, exported in f32."""
    folder, out = tmp_path_factory.mktemp("gguf"), {}
    for role, name in (("target", "stdlib-coder"), ("cllm", "stdlib-coder-cllm")):
        model, tokenizer = load_model(name), load_tokenizer(name)
        out[role] = model, tokenizer, write_gguf(model, tokenizer, folder / f"{role}.gguf").path
    return out


def llama_cpp_greedy(llm, prompt: list[int], max_new_tokens: int, eos: int) -> list[int]:
    """llama.cpp's greedy tokens after `prompt`, EOS kept, at most `max_new_tokens`."""
    llm.reset()
    out = []
    for token in llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0):
        out.append(int(token))
        if token == eos or len(out) >= max_new_tokens:
            break
    return out


def first_difference(model, prompt: list[int], got: list[int], want: list[int]) -> str:
    """Where two token lists part, with the model's top-2 logit margin there (a near-tie or a bug)."""
    k = next(i for i, (a, b) in enumerate(zip(got + [-1], want + [-2])) if a != b)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + want[:k]])).logits[0, -1]
    top = logits.topk(2).values
    return f"first difference at new token {k}, top-2 margin {float(top[0] - top[1]):.2e}"


@pytest.mark.parametrize("role", ["target", "cllm"])
def test_llama_cpp_decodes_the_shipped_models_as_greedy_decode_does(shipped, role):
    model, tokenizer, path = shipped[role]
    llm = llama(path)
    prompts = (encode_prompts("humaneval", tokenizer, limit=16, keep=512 - NEW_TOKENS)
               + encode_prompts("stdlib-val", tokenizer, limit=16, keep=512 - NEW_TOKENS))
    for prompt in prompts:  # one request after another on one llama.cpp context
        want = greedy_decode(model, torch.tensor([prompt.ids]), max_new_tokens=NEW_TOKENS,
                             eos_token_id=tokenizer.eos_token_id).new_tokens[0]
        got = llama_cpp_greedy(llm, prompt.ids, NEW_TOKENS, tokenizer.eos_token_id)
        assert got == want, f"{role} {prompt.id}: {first_difference(model, prompt.ids, got, want)}"


def llama_cpp_text(llm, ids: list[int]) -> str:
    """The text llama.cpp's tools print for `ids`: each token's piece (`llama_token_to_piece`), as
    llama-server streams them. Not llama-cpp-python's `detokenize`: it reads each piece into 32
    bytes, and the shipped vocabulary has 23 longer tokens (deep indentation runs), which come
    out cut (0.3.36, `_internals.LlamaModel`). Not `llama_detokenize` either: for the gpt-2
    split it applies the "clean up tokenization spaces" rule (`uses 'x'` -> `uses'x'`), which
    llama.cpp hard-codes by pre-tokenizer name and the shipped tokenizer does not."""
    import llama_cpp

    vocab, size = llama_cpp.llama_model_get_vocab(llm.model), 256
    piece, out = ctypes.create_string_buffer(size), b""
    for token in ids:
        n = llama_cpp.llama_token_to_piece(vocab, token, piece, size, 0, False)
        assert 0 <= n <= size, f"token {token}: llama_token_to_piece says {n}"
        out += piece.raw[:n]
    return out.decode("utf-8")


def sample_train(count: int):
    texts = load_prompts("stdlib-train")
    return [texts[i * len(texts) // count] for i in range(count)]


def test_llama_cpp_tokenizes_the_shipped_prompt_sets_into_the_tokenizers_ids(shipped):
    _, tokenizer, path = shipped["target"]
    llm = llama(path, vocab_only=True)
    sets = {"stdlib-val": load_prompts("stdlib-val"), "humaneval": load_prompts("humaneval"),
            "stdlib-train (sample)": sample_train(400)}
    for name, texts in sets.items():
        assert len(texts) > 100, name
        for p in texts:
            want = prompt_ids(tokenizer, p.text)
            assert llm.tokenize(p.text.encode("utf-8"), add_bos=False, special=True) == want, (name, p.id)
            assert llama_cpp_text(llm, want) == tokenizer.decode(want), (name, p.id)


def test_the_bench_decoder_tokenizes_like_the_tokenizer_too(shipped, tmp_path):
    from cllm.bench.llamacpp import LlamaCppDecoder

    _, tokenizer, path = shipped["target"]
    decoder = LlamaCppDecoder(path, threads=1, context=512, max_new_tokens=8, eos=tokenizer.eos_token_id)
    for p in load_prompts("humaneval", limit=20):
        assert decoder.tokenize(p.text) == prompt_ids(tokenizer, p.text)


def tiny_models():
    torch.manual_seed(0)
    base = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=256, initializer_range=0.1, bos_token_id=0, eos_token_id=0)
    yield "llama, grouped-query attention, untied", LlamaForCausalLM(LlamaConfig(
        **base, num_key_value_heads=2, tie_word_embeddings=False))
    yield "llama, biases, tied, rope base 500", LlamaForCausalLM(LlamaConfig(
        **base, attention_bias=True, mlp_bias=True, tie_word_embeddings=True, rope_theta=500.0))
    yield "llama, head_dim 32 != hidden / heads", LlamaForCausalLM(LlamaConfig(
        **base, head_dim=32, num_key_value_heads=4, tie_word_embeddings=False))
    yield "qwen2", Qwen2ForCausalLM(Qwen2Config(**base, num_key_value_heads=2, tie_word_embeddings=False))


def llama_cpp_logits(path, ids: list[int]) -> np.ndarray:
    llm = llama(path, logits_all=True)
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)])


@pytest.mark.parametrize("out_type, tolerance", [("f32", 1e-4), ("f16", 2e-2), ("bf16", 1e-1)])
def test_llama_cpp_logits_equal_transformers_for_every_supported_shape(tmp_path, out_type, tolerance):
    tokenizer = train_tokenizer(CODE_TEXTS * 3, vocab_size=320, min_frequency=1)
    ids = prompt_ids(tokenizer, "def add(a, b):\n    return a + b\nclass Point:\n    def __init__(self, x):")
    for i, (what, model) in enumerate(tiny_models()):
        model.eval()
        path = write_gguf(model, tokenizer, tmp_path / f"{i}.gguf", out_type=out_type).path
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0].numpy()
        got = llama_cpp_logits(path, ids)
        scale = np.abs(want).max()
        assert np.abs(got - want).max() <= tolerance * scale, (what, out_type, np.abs(got - want).max(), scale)


SPLIT_TEXTS = CODE_TEXTS + ["x = 12345 + 678\n", "naïve café = 'über'\n", "it's I'LL we'd\r\n  \n\tok 3.14"]


def split_tokenizer(regex: str) -> PreTrainedTokenizerFast:
    """A byte-level BPE whose pre-tokenizer is a Split on `regex`, as Qwen2's and Llama 3's are."""
    tok = Tokenizer(models.BPE(ignore_merges=PRE_TOKENIZERS[regex] == "llama-bpe"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(SPLIT_TEXTS * 3, trainers.BpeTrainer(
        vocab_size=400, min_frequency=1, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return wrap(tok)


@pytest.mark.parametrize("regex", list(PRE_TOKENIZERS), ids=list(PRE_TOKENIZERS.values()))
def test_the_qwen2_and_llama3_splits_tokenize_in_llama_cpp_as_in_the_tokenizer(tmp_path, regex):
    tokenizer = split_tokenizer(regex)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, max_position_embeddings=64))
    llm = llama(write_gguf(model, tokenizer, tmp_path / "m.gguf").path, vocab_only=True)
    texts = SPLIT_TEXTS + [p.text for p in load_prompts("humaneval", limit=40)]
    for text in texts:
        want = tokenizer(text)["input_ids"]
        assert llm.tokenize(text.encode("utf-8"), add_bos=False, special=True) == want, text
