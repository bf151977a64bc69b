"""Lossless sampling: the first tokens sampled by Jacobi sampling (and by `sample_decode`) have
exactly the autoregressive law, computed by enumeration from the model's logits.

The oracle (`law.py`) shares no code with the samplers: it recomputes the processed law
(temperature, top-k, top-p) in float64 from plain no-cache forwards and multiplies conditionals
along all 3^4 = 81 sequences of the first LENGTH = 4 tokens of a 3-token vocabulary. Each
sampler draws N = 4000 independent rows (one seeded generator per row); Pearson's chi-square
over the joint outcomes (`tests/chisquare.py`; cells expected below 20 pooled, 16-81 cells)
rejects at p < ALPHA = 1e-6. A correct sampler fails one of the 10 law tests with probability
about 1e-5 for a new set of seeds (the seeds are fixed, so a commit passes or fails for good);
10^7 simulated samples from these laws put the statistic below p = 1e-6 at rates 0.5-1.5e-6.

Power: the textbook bug, redrawing a rejected draft's replacement from p instead of the residual
max(0, p - q), is planted in `verify_drafts` by the negative controls below. At N = 4000 it gives
X2 = 460-1820 (p < 1e-84) where correct samplers give X2 = 8-81 on 15-80 df (p = 0.39-0.93);
the same bug on the Jacobi drafts alone (point-mass guesses verified correctly) gives X2 =
270-740 in the three settings tested for it.

Why a skewed prompt: Jacobi's initial guess is drawn from the prompt's tokens, and a guess drawn
uniformly over the whole vocabulary hides the residual bug exactly (sum_d g(d) [p(d) 1{x=d} +
(1 - p(d)) p(x)] = p(x) for uniform g). Mostly-2 prompt tokens make the guess law skewed.

Cost: each sampler run is one batched decode of 4000 rows, about 1 s on one CPU thread; 20 runs
(10 correct, 10 planted) and one of 8000 rows make about 25 s.
"""

import functools
import math
from collections import Counter

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import cllm.decoding.jacobi.verifiers as jacobi_module
from cllm import greedy_decode, jacobi_decode
from cllm.decoding.draft_table import DraftTable
from cllm.decoding.sampling import Sampling, draw, sample_decode, verify_drafts
from tests.chisquare import chi_square, chi_square_tail
from tests.decoding.law import exact_joint_law, processed_law

VOCAB, LENGTH, N = 3, 4, 4000
PROMPT = [2, 0, 2, 2, 1, 2, 2]
# a table whose chained continuation drafts every block whole (a point mass given the history)
TABLE = DraftTable((2,), {(a, b): (a + 2 * b + 1) % VOCAB for a in range(VOCAB)
                          for b in range(VOCAB)})


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    m = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():  # sharper than a random init: the context matters
        m.lm_head.weight.mul_(3)
    return m


LAW_KEYS = ("temperature", "top_k", "top_p")


@functools.cache
def _exact(model, temperature, top_k=None, top_p=None):
    return exact_joint_law(model, PROMPT, LENGTH, temperature=temperature, top_k=top_k, top_p=top_p)


def exact(model, settings: dict) -> dict:
    law = _exact(model, *(settings.get(k) for k in LAW_KEYS))
    if settings.get("top_k") or settings.get("top_p"):  # the truncation must bite
        assert len(law) < VOCAB**LENGTH
    return law


def sampled(decode, seed: int, n: int = N, **settings) -> Counter:
    """Counts of the first LENGTH tokens of `n` rows of one batch, row i seeded (seed, i)."""
    generators = [torch.Generator().manual_seed(1_000_003 * seed + i) for i in range(n)]
    ids = torch.tensor([PROMPT]).expand(n, -1)
    settings.setdefault("max_new_tokens", LENGTH)
    out = decode(ids, generator=generators, **settings)
    return Counter(tuple(t[:LENGTH]) for t in out.new_tokens)


def jacobi(model):
    return functools.partial(jacobi_decode, model)


JACOBI = {  # id -> jacobi_decode settings; every one but n1 verifies drafts
    "n2-T1-prompt": dict(block_size=2, temperature=1.0),
    "n3-T1.5-repeat": dict(block_size=3, temperature=1.5, guess="repeat"),
    "n4-T0.7-prompt": dict(block_size=4, temperature=0.7),
    "n4-T1-topk2-lookup": dict(block_size=4, temperature=1.0, top_k=2, guess="lookup"),
    "n3-T0.8-topp0.7": dict(block_size=3, temperature=0.8, top_p=0.7),
    "n4-T1.2-topk2-topp0.9-random": dict(block_size=4, temperature=1.2, top_k=2, top_p=0.9,
                                         guess="random"),
    "n4-T1-table": dict(block_size=4, temperature=1.0, draft_table=TABLE),
    "n1-T1": dict(block_size=1, temperature=1.0),  # the engine's AR sampling (bench, --method ar)
}


@pytest.mark.parametrize("name", list(JACOBI))
def test_jacobi_sampling_has_the_exact_autoregressive_law(model, name):
    settings = JACOBI[name]
    result = chi_square(sampled(jacobi(model), list(JACOBI).index(name), **settings),
                        exact(model, settings))
    assert not result.rejects(), f"{name}: {result}"


AR = {"T1": dict(temperature=1.0), "T0.8-topk2-topp0.7": dict(temperature=0.8, top_k=2, top_p=0.7)}


@pytest.mark.parametrize("name", list(AR))
def test_sample_decode_has_the_exact_autoregressive_law(model, name):
    """The baseline too: it shares `Sampling.probs` with Jacobi sampling, not with the oracle."""
    settings = AR[name]
    result = chi_square(sampled(functools.partial(sample_decode, model), 20 + list(AR).index(name),
                                **settings), exact(model, settings))
    assert not result.rejects(), str(result)


def test_jacobi_sampling_with_pool_drafts_has_the_exact_autoregressive_law(model):
    """Recycling under sampling: a pool draft (point-mass law) replaces the Jacobi drafts.

    N = 8000 and n = 6 (first 4 tokens compared) for a wide margin. When the pool could copy the
    current state's own drafts (the bug this test found): X2 = 313-344 on 80 df (p < 1e-28) over
    four seeds; with the current state left out of the pool: 74-98 (p > 0.08)."""
    settings = dict(block_size=6, max_new_tokens=6, temperature=1.0, recycle=1)
    result = chi_square(sampled(jacobi(model), 30, n=2 * N, **settings), exact(model, settings))
    assert not result.rejects(), str(result)


# ----------------------------------------------------------------------------------------------
# Negative controls: the test sees the textbook bug


def resample_from_p(tail, drafts_q, probs, generator, *, point_masses_too=True):
    """`verify_drafts` with the textbook bug: a rejected draft's replacement is drawn from p, not
    from the residual max(0, p - q) (for a point mass on the draft: p without the draft).
    `point_masses_too=False`: the bug only for drafts with a law (Jacobi's own drafts)."""
    if not point_masses_too and all(q is None for q in drafts_q):
        return verify_drafts(tail, drafts_q, probs, generator)
    outputs, accepted = [], 0
    for i, d in enumerate(tail[1:]):
        p, q = probs[i], drafts_q[i]
        qd = 1.0 if q is None else float(q[d])
        u = float(torch.rand((), generator=generator))
        if qd > 0 and u * qd < float(p[d]):
            outputs.append(d)
            accepted += 1
            continue
        outputs.append(draw(p, generator))  # the bug: p, not the residual
        break
    else:
        outputs.append(draw(probs[len(tail) - 1], generator))
    fresh = [probs[i] for i in range(len(outputs), len(tail))]
    outputs += [draw(p, generator) for p in fresh]
    return outputs, accepted, fresh


@pytest.mark.parametrize("name", [n for n in JACOBI if n != "n1-T1"])
def test_resampling_from_p_instead_of_the_residual_is_rejected(model, name, monkeypatch):
    monkeypatch.setattr(jacobi_module, "verify_drafts", resample_from_p)
    settings = JACOBI[name]
    result = chi_square(sampled(jacobi(model), list(JACOBI).index(name), **settings),
                        exact(model, settings))
    assert result.rejects(), f"{name}: the planted bug passed: {result}"


@pytest.mark.parametrize("name", ["n4-T1-topk2-lookup", "n3-T0.8-topp0.7",
                                  "n4-T1.2-topk2-topp0.9-random"])
def test_the_residual_bug_on_jacobi_drafts_alone_is_rejected(model, name, monkeypatch):
    """Point-mass guesses verified correctly, drafts drawn from an earlier p verified wrongly."""
    monkeypatch.setattr(jacobi_module, "verify_drafts",
                        functools.partial(resample_from_p, point_masses_too=False))
    settings = JACOBI[name]
    result = chi_square(sampled(jacobi(model), list(JACOBI).index(name), **settings),
                        exact(model, settings))
    assert result.rejects(), f"{name}: the planted bug passed: {result}"


# ----------------------------------------------------------------------------------------------
# The oracle and the statistic, against hand-computed values


def test_the_oracles_processed_law_and_sampling_probs_match_hand_computed_values():
    probs = (0.5, 0.2, 0.15, 0.1, 0.05)
    logits = [math.log(x) for x in probs]
    top_k = [5 / 7, 2 / 7, 0, 0, 0]
    # top-p 0.8: 0.5 + 0.2 < 0.8, so 0.15 is needed too; 0.1 and 0.05 are not
    top_p = [0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85, 0, 0]
    tempered = [x * x / sum(y * y for y in probs) for x in probs]  # temperature 0.5 squares p
    for settings, expected in [(dict(top_k=2), top_k), (dict(top_p=0.8), top_p), ({}, tempered)]:
        temperature = 0.5 if not settings else 1.0
        assert processed_law(logits, temperature, **settings) == pytest.approx(expected, abs=1e-9)
        ours = Sampling(temperature, **settings).probs(torch.tensor(logits))
        assert ours.tolist() == pytest.approx(expected, abs=1e-6)
    with pytest.raises(ValueError):
        Sampling(0.0)


def test_the_chi_square_tail_and_pooling():
    for x in (0.5, 3.0, 40.0):  # closed forms: df = 2 is exponential, df = 1 a squared normal
        assert chi_square_tail(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-9)
        assert chi_square_tail(x, 1) == pytest.approx(math.erfc(math.sqrt(x / 2)), rel=1e-9)
    law = {"a": 0.5, "b": 0.49, "c": 0.006, "d": 0.004, "never": 0.0}
    # n = 1000: c and d expect 6 and 4, pooled into one cell of 10, still < 20: b joins them
    result = chi_square(Counter(a=500, b=490, c=6, d=4), law)
    assert result.df == 1 and result.statistic == pytest.approx(0.0) and not result.rejects()
    assert chi_square(Counter(a=500, b=489, never=1), law).impossible == 1


def test_same_seed_same_sample_other_seed_other_sample_and_greedy_at_temperature_zero(model):
    prompt = torch.tensor([PROMPT])

    def run(seed, **kw):
        return jacobi_decode(model, prompt, block_size=4, max_new_tokens=20,
                             generator=torch.Generator().manual_seed(seed), **kw).new_tokens
    assert run(5, temperature=0.9, top_p=0.9) == run(5, temperature=0.9, top_p=0.9)
    assert run(5, temperature=0.9) != run(6, temperature=0.9)  # 20 sampled tokens: seeds tell apart
    assert run(5) == greedy_decode(model, prompt, max_new_tokens=20).new_tokens
