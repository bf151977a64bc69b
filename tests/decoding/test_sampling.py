"""Lossless Jacobi sampling: its output law equals plain AR sampling's.

Bound: for an empirical distribution of N samples over k outcomes, P(||emp - p||_1 >= eps) <=
2^k exp(-N eps^2 / 2) (Bretagnolle-Huber-Carol). With k = 64 outcomes (two tokens of an 8-token
vocabulary), N = 8000 samples per method and eps = sqrt(2 (k ln 2 + ln(2 / delta)) / N), each
empirical law is within eps of the true one except with probability delta = 1e-4, so two samples
of the same law have total-variation distance TV = ||e1 - e2||_1 / 2 <= eps (~0.117) except with
probability 2e-4. A wrong acceptance rule must exceed it.
"""

import math
from collections import Counter

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import cllm.decoding.jacobi as jacobi_module
from cllm import jacobi_decode
from cllm.decoding.sampling import Sampling, sample_decode, verify_drafts

VOCAB, N, DELTA = 8, 8000, 1e-4
BOUND = math.sqrt(2 * (VOCAB**2 * math.log(2) + math.log(2 / DELTA)) / N)
PROMPT = torch.tensor([[1, 5, 2, 7, 3]])


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    m = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():  # sharper than a random init: contexts then matter
        m.lm_head.weight.mul_(8)
    return m


def joint_law(decode, seed: int, **kwargs) -> Counter:
    """Empirical law of (token 2, token 3) over N seeded rows of one batch."""
    gens = [torch.Generator().manual_seed(seed * N + i) for i in range(N)]
    out = decode(PROMPT.expand(N, -1), max_new_tokens=3, generator=gens, **kwargs)
    return Counter(tuple(t[1:3]) for t in out.new_tokens)


def tv(a: Counter, b: Counter) -> float:
    return 0.5 * sum(abs(a[k] - b[k]) for k in set(a) | set(b)) / N


SETTINGS = [dict(temperature=1.0), dict(temperature=0.7), dict(temperature=1.0, top_k=4),
            dict(temperature=0.7, top_p=0.8)]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_jacobi_sampling_has_the_law_of_ar_sampling(model, settings):
    ar = joint_law(lambda ids, **kw: sample_decode(model, ids, **kw), 1, **settings)
    jac = joint_law(lambda ids, **kw: jacobi_decode(model, ids, block_size=4, **kw), 2, **settings)
    other_ar = joint_law(lambda ids, **kw: sample_decode(model, ids, **kw), 3, **settings)
    assert tv(ar, jac) < BOUND, (tv(ar, jac), BOUND)
    # the test has power: the law is far from uniform, and two AR samples agree as closely
    assert tv(ar, other_ar) < BOUND
    assert max(ar.values()) / N > 2 / VOCAB**2


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_jacobi_sampling_with_pool_drafts_keeps_the_law(model, temperature):
    """Recycling under sampling: pool drafts (point-mass laws) replace Jacobi drafts."""
    ar = joint_law(lambda ids, **kw: sample_decode(model, ids, **kw), 4, temperature=temperature)
    jac = joint_law(lambda ids, **kw: jacobi_decode(model, ids, block_size=4, recycle=1, **kw), 5,
                    temperature=temperature)
    assert tv(ar, jac) < BOUND, (tv(ar, jac), BOUND)


def test_a_wrong_acceptance_rule_fails_the_same_check(model, monkeypatch):
    def accept_everything(tail, laws, probs, generator):
        outputs, _, fresh = verify_drafts(tail, laws, probs, generator)
        outputs[: len(tail) - 1] = tail[1:]  # every draft "accepted"
        return outputs, len(tail) - 1, fresh

    settings = dict(temperature=1.0)
    ar = joint_law(lambda ids, **kw: sample_decode(model, ids, **kw), 1, **settings)
    monkeypatch.setattr(jacobi_module, "verify_drafts", accept_everything)
    wrong = joint_law(lambda ids, **kw: jacobi_decode(model, ids, block_size=4, **kw), 2, **settings)
    assert tv(ar, wrong) > BOUND


def test_same_seed_same_sample_and_greedy_when_temperature_is_zero(model):
    def run(seed, **kw):
        return jacobi_decode(model, PROMPT, block_size=4, max_new_tokens=20,
                             generator=torch.Generator().manual_seed(seed), **kw).new_tokens
    assert run(5, temperature=0.9, top_p=0.9) == run(5, temperature=0.9, top_p=0.9)
    assert run(5, temperature=0.9) != run(6, temperature=0.9) or run(5, temperature=0.9) != run(7, temperature=0.9)
    from cllm import greedy_decode
    assert run(5) == greedy_decode(model, PROMPT, max_new_tokens=20).new_tokens


def test_processed_law_top_k_and_top_p():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    assert torch.allclose(Sampling(1.0, top_k=2).probs(logits), torch.tensor([5 / 7, 2 / 7, 0, 0, 0]))
    # top-p 0.8: 0.5 + 0.2 < 0.8, so 0.15 is needed too; 0.1 and 0.05 are not
    assert torch.allclose(Sampling(1.0, top_p=0.8).probs(logits), torch.tensor([0.5, 0.2, 0.15, 0, 0]) / 0.85)
    assert torch.allclose(Sampling(0.5).probs(logits), torch.softmax(logits / 0.5, -1))
    with pytest.raises(ValueError):
        Sampling(0.0)
