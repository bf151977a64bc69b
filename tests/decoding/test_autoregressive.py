"""The greedy oracle's counting and EOS (its tokens against transformers' `generate` and a
no-cache argmax loop: test_oracles.py)."""

import torch

from cllm import greedy_decode, jacobi_decode
from tests.decoding.conftest import left_padded, random_prompt, tiny_model


def test_greedy_counts_one_forward_per_token_prefill_included():
    out = greedy_decode(tiny_model("gpt2"), random_prompt(43, 5), max_new_tokens=17)
    assert len(out.new_tokens[0]) == 17 == out.forward_passes
    assert out.stats.accepted_histogram() == {1: 17}
    assert out.stats.tokens_per_forward == 1.0
    assert out.stats.fed == [1] * 16 and out.stats.mean_fed == 1.0  # one token per step after the prefill


def test_greedy_stops_each_row_at_its_eos_and_includes_it():
    model = tiny_model("qwen2")
    ids, mask = left_padded([random_prompt(44, 6), random_prompt(45, 3)])
    full = greedy_decode(model, ids, mask, max_new_tokens=20).new_tokens
    eos = full[0][4]
    stop = full[0].index(eos)
    out = greedy_decode(model, ids, mask, max_new_tokens=20, eos_token_id=eos)
    assert out.new_tokens[0] == full[0][: stop + 1]
    other = full[1][: full[1].index(eos) + 1] if eos in full[1] else full[1]
    assert out.new_tokens[1] == other
    assert out.forward_passes == max(len(t) for t in out.new_tokens)


def test_zero_new_tokens_runs_no_forward():
    out = greedy_decode(tiny_model("llama"), random_prompt(46, 4), max_new_tokens=0)
    assert out.new_tokens == [[]] and out.forward_passes == 0


def test_decoders_run_in_the_models_dtype():
    model = tiny_model("llama")
    half = type(model)(model.config).to(torch.bfloat16).eval()
    half.load_state_dict(model.state_dict())
    assert len(greedy_decode(half, random_prompt(47, 4), max_new_tokens=5).new_tokens[0]) == 5
    out = jacobi_decode(half, random_prompt(47, 4), block_size=4, max_new_tokens=9)
    assert len(out.new_tokens[0]) == 9
