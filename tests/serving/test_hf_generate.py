"""Jacobi decoding from transformers' `model.generate(custom_generate=jacobi_generate)`: the same
sequences as transformers' own greedy `generate` (a padded batch, EOS inside the budget), with
plain Jacobi and with the CLI's setting; what it cannot reproduce is refused."""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import GenerationMixin

from cllm import RECOMMENDED
from cllm.serving.hf_generate import jacobi_generate
from tests.decoding.conftest import left_padded, random_prompt, tiny_model

pytestmark = pytest.mark.skipif("custom_generate" not in inspect.signature(GenerationMixin.generate).parameters,
                                reason="this transformers has no custom_generate")


@pytest.mark.parametrize("settings", [{}, {"block_size": 3}, dict(RECOMMENDED)])
def test_generate_with_jacobi_equals_transformers_greedy(settings, monkeypatch):
    import cllm.serving.hf_generate as module

    calls = []
    real = module.jacobi_decode
    monkeypatch.setattr(module, "jacobi_decode", lambda *a, **k: calls.append(k) or real(*a, **k))
    model = tiny_model("llama")
    ids, mask = left_padded([random_prompt(1, 5), random_prompt(2, 9)])
    common = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    expected = model.generate(ids, **common)
    eos = int(expected[0, ids.shape[1] + 5])  # a token row 0 writes early: EOS inside the budget
    expected = model.generate(ids, eos_token_id=eos, **common)
    got = model.generate(ids, eos_token_id=eos, custom_generate=jacobi_generate, **common, **settings)
    assert torch.equal(got, expected)
    assert len(calls) == 1 and all(calls[0][k] == v for k, v in settings.items())  # our loop decoded it
    assert (got[0, ids.shape[1]:] == eos).any()  # row 0 stopped at EOS, then padding


def test_what_jacobi_cannot_reproduce_is_refused():
    model = tiny_model("llama")
    ids = random_prompt(3, 6)
    with pytest.raises(ValueError, match="greedily"):
        model.generate(ids, max_new_tokens=8, do_sample=True, custom_generate=jacobi_generate)
    with pytest.raises(ValueError, match="greedily"):
        model.generate(ids, max_new_tokens=8, do_sample=False, repetition_penalty=1.3, custom_generate=jacobi_generate)
