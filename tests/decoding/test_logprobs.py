"""Log-probabilities read off the verifying forwards (`BatchDecoder.add(..., logprobs=k)`): for
greedy rows, each final token's log-probability and top k equal the log-softmax of the logits
greedy (autoregressive) decoding computes at that token; for sampled rows, the log of the
distribution the token was drawn from (temperature, top-k, top-p applied), at that prefix."""

import pytest
import torch

from cllm.decoding import BatchDecoder
from cllm.decoding.argmax import argmax
from cllm.decoding.autoregressive import autoregressive
from cllm.decoding.sampling import Sampling
from cllm.runtime import as_runtime
from tests.decoding.conftest import random_prompt, tiny_model

SETTINGS = {
    "plain n=4": dict(block_size=4),
    "ar n=1": dict(block_size=1),
    "recycling": dict(block_size=4, recycle=8, recycle_budget=24),
    "blocks in flight": dict(block_size=5, blocks_in_flight=2),
}
K = 3
TOL = 2e-4  # a batched forward of several fed tokens rounds differently from a one-token one


@torch.inference_mode()
def _greedy_with_logits(model, prompt: torch.Tensor, budget: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding's tokens and the logits (V,) it chose each from."""
    seen: list[torch.Tensor] = []

    def choose(logits: torch.Tensor) -> list[int]:
        seen.append(logits[0].float().clone())
        return argmax(logits).tolist()

    out = autoregressive(model, prompt, None, max_new_tokens=budget, eos_token_id=None, choose=choose)
    return out.new_tokens[0], seen


@torch.inference_mode()
def _teacher_forced(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The model's logits (n, V) before each of `tokens`, from one forward over the whole text."""
    session = as_runtime(model).session()
    rows, out = session.open([prompt + tokens[:-1]], every=True)
    session.close(rows)
    return out.logits[0, len(prompt) - 1 :].float()


@pytest.mark.parametrize("name", list(SETTINGS))
def test_greedy_logprobs_equal_autoregressive_decodings_log_softmax(arch, name):
    model = tiny_model(arch)
    decoder = BatchDecoder(model, **SETTINGS[name])
    prompts = [(random_prompt(seed, length), budget) for seed, length, budget in [(51, 6, 24), (52, 11, 17)]]
    rows = []
    for prompt, budget in prompts:  # the second joins the first mid-decode; one row keeps none
        (row,) = decoder.add(prompt, max_new_tokens=budget, logprobs=K)
        rows.append(row)
        decoder.step()
    (quiet,) = decoder.add(random_prompt(53, 4), max_new_tokens=9)
    while decoder.running:
        decoder.step()
    assert decoder.logprobs(quiet) == []
    for (prompt, budget), row in zip(prompts, rows, strict=True):
        tokens, logits = _greedy_with_logits(model, prompt, budget)
        got = decoder.logprobs(row)
        assert decoder.tokens(row) == tokens and [e.token for e in got] == tokens, (arch, name)
        for i, (entry, step_logits) in enumerate(zip(got, logits, strict=True)):
            expected = step_logits.log_softmax(-1)
            assert entry.logprob == pytest.approx(expected[entry.token].item(), abs=TOL), (arch, name, i)
            values, ids = expected.topk(K)
            assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=TOL), (arch, name, i)
            assert entry.top[0][0] == entry.token == ids[0].item()  # greedy: the chosen token leads
            assert [v for _, v in entry.top] == sorted((v for _, v in entry.top), reverse=True)


def test_sampled_logprobs_are_of_the_distribution_drawn_from(torch_arch):
    model = tiny_model(torch_arch)
    law = dict(temperature=0.7, top_k=20, top_p=0.9)
    decoder = BatchDecoder(model, block_size=4, **law)
    prompt = random_prompt(61, 7)
    (row,) = decoder.add(prompt, max_new_tokens=20, generator=torch.Generator().manual_seed(5), logprobs=2)
    while decoder.running:
        decoder.step()
    tokens, got = decoder.tokens(row), decoder.logprobs(row)
    probs = Sampling(**law).probs(_teacher_forced(model, prompt[0].tolist(), tokens))
    assert [e.token for e in got] == tokens
    for i, entry in enumerate(got):
        assert entry.logprob == pytest.approx(probs[i, entry.token].log().item(), abs=TOL), i
        assert entry.logprob > -float("inf")  # a drawn token has probability > 0
        assert all(v > -float("inf") for _, v in entry.top) and len(entry.top) <= 2


def test_zero_alternatives_keeps_the_chosen_tokens_only(torch_arch):
    model = tiny_model(torch_arch)
    decoder = BatchDecoder(model, block_size=4)
    (row,) = decoder.add(random_prompt(71, 5), max_new_tokens=8, logprobs=0)
    while decoder.running:
        decoder.step()
    assert len(decoder.logprobs(row)) == 8 and all(e.top == () for e in decoder.logprobs(row))
    with pytest.raises(ValueError, match="logprobs"):
        decoder.add(random_prompt(72, 5), logprobs=-1)
