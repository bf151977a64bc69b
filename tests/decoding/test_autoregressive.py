"""The greedy oracle's counting, EOS and dtype (its tokens against transformers' `generate` and
a no-cache argmax loop: test_oracles.py)."""

import copy

import pytest
import torch

from cllm import greedy_decode, jacobi_decode
from cllm.decoding.sampling import sample_decode
from cllm.runtime import open_runtime
from tests.decoding.conftest import VOCAB, Spied, left_padded, random_prompt, tiny_model


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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_decoders_run_in_the_models_dtype(dtype):
    """Every forward of every decoder (greedy and sampling) returns logits in the model's dtype
    and the model stays in it; the budget is decoded. (Tokens: test_jacobi_exact.py compares
    Jacobi with same-dtype greedy in both dtypes.)"""
    model = copy.deepcopy(tiny_model("llama")).to(dtype)
    for runtime in (Spied(open_runtime(model, "lean")), Spied(open_runtime(model, "transformers"))):
        prompt, g = random_prompt(47, 4), torch.Generator().manual_seed(0)
        outs = [greedy_decode(runtime, prompt, max_new_tokens=9),
                jacobi_decode(runtime, prompt, block_size=4, max_new_tokens=9),
                jacobi_decode(runtime, prompt, block_size=4, max_new_tokens=9, temperature=0.8,
                              generator=g),
                sample_decode(runtime, prompt, max_new_tokens=9, temperature=0.8, generator=g)]
        assert runtime.seen == [dtype] * sum(out.forward_passes for out in outs) == [dtype] * runtime.forwards
    assert all(p.dtype == dtype for p in model.parameters())
    for out in outs:
        assert len(out.new_tokens[0]) == 9 and all(0 <= t < VOCAB for t in out.new_tokens[0])
