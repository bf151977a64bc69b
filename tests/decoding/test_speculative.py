"""Speculative decoding with a draft model equals greedy decoding of the target token for token,
on tiny random models of five architectures (float32): several draft lengths, drafts that are
always, sometimes and never accepted, EOS inside a drafted run, a budget that is not a multiple
of the draft length, left-padded batches against rows decoded alone; its forward counts; and,
when sampling, the exact autoregressive law of the target (`tests/chisquare.py`, as for Jacobi
sampling in test_sampling.py).
"""

import copy
import functools
import math
from collections import Counter

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import cllm.decoding.rivals.speculative as speculative_module
from cllm import greedy_decode, speculative_decode
from cllm.decoding.rivals.speculative import accepted_drafts, next_draft_tokens
from tests.chisquare import chi_square
from tests.decoding.conftest import (
    VOCAB,
    assert_same_tokens,
    left_padded,
    on_path,
    random_prompt,
    tiny_model,
    tiny_module,
)
from tests.decoding.law import exact_joint_law
from tests.decoding.test_sampling import resample_from_p

DRAFT_TOKENS = [1, 2, 4, 7]
MAX_NEW = 37  # a multiple of none of the draft lengths + 1 above 1
PROMPTS = [(11, 3), (12, 9), (13, 1), (14, 20)]  # (seed, length)


@functools.cache
def greedy(arch: str, seed: int, length: int, max_new: int = MAX_NEW, eos: int | None = None) -> list[int]:
    return greedy_decode(tiny_model(arch), random_prompt(seed, length), max_new_tokens=max_new,
                         eos_token_id=eos).new_tokens[0]


@functools.cache
def noisy_draft(arch: str, scale: float = 0.01):
    """The target with every weight nudged (on the target's runtime): it agrees with the target
    on some tokens, not all (measured when written: 1 to 5 tokens made final per target forward at
    k = 4)."""
    draft = copy.deepcopy(tiny_module(arch))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return on_path(arch, draft)


@functools.cache
def unrelated_draft(arch: str):
    """Another random model of the same shape: its drafts are (almost) never accepted."""
    torch.manual_seed(99)
    return on_path(arch, type(tiny_module(arch))(tiny_module(arch).config).float().eval())


@pytest.mark.parametrize("k", DRAFT_TOKENS)
def test_speculative_equals_greedy_with_a_draft_right_some_of_the_time(arch, k):
    model, draft = tiny_model(arch), noisy_draft(arch)
    made = Counter()
    for seed, length in PROMPTS:
        prompt = random_prompt(seed, length)
        out = speculative_decode(model, draft, prompt, draft_tokens=k, max_new_tokens=MAX_NEW)
        expected = greedy(arch, seed, length)
        assert_same_tokens(model, prompt[0].tolist(), expected, out.new_tokens[0], f"{arch} k={k}")
        # one target forward makes 1 .. k + 1 tokens final: never more forwards than greedy
        assert out.forward_passes == len(out.stats.accepted) <= len(expected)
        assert sum(out.stats.accepted) == out.stats.new_tokens == MAX_NEW
        assert max(out.stats.accepted) <= k + 1 and max(out.stats.fed) <= k + 1
        assert 0 < out.stats.draft_forward_passes <= k * out.forward_passes
        made.update(out.stats.accepted)
    # the rollback of partly accepted drafts was exercised, and so were rejected ones
    assert made[1] > 0 and sum(c for n, c in made.items() if n > 1) > 0


def test_speculative_equals_greedy_with_an_unrelated_draft(arch):
    model, draft = tiny_model(arch), unrelated_draft(arch)
    for seed, length in PROMPTS:
        prompt = random_prompt(seed, length)
        out = speculative_decode(model, draft, prompt, draft_tokens=4, max_new_tokens=MAX_NEW)
        assert_same_tokens(model, prompt[0].tolist(), greedy(arch, seed, length), out.new_tokens[0],
                           f"{arch} unrelated draft")
        assert out.forward_passes <= MAX_NEW


@pytest.mark.parametrize("k", DRAFT_TOKENS)
def test_a_draft_equal_to_the_target_is_always_accepted(k):
    """Every step makes k + 1 tokens final (fewer at the budget's end): the prefill's token, then
    ceil((MAX_NEW - 1) / (k + 1)) verify forwards; the draft feeds every draft token but each
    step's last (the first forward of a step feeds what its cache lacks)."""
    model = tiny_model("llama")
    seed, length = PROMPTS[1]
    out = speculative_decode(model, model, random_prompt(seed, length), draft_tokens=k, max_new_tokens=MAX_NEW)
    assert out.new_tokens[0] == greedy("llama", seed, length)
    steps = math.ceil((MAX_NEW - 1) / (k + 1))
    assert out.forward_passes == 1 + steps
    assert out.stats.draft_forward_passes == (MAX_NEW - 1) - steps  # n forwards for n drafts per step
    assert out.stats.accepted == [1] + [k + 1] * ((MAX_NEW - 1) // (k + 1)) + (
        [(MAX_NEW - 1) % (k + 1)] if (MAX_NEW - 1) % (k + 1) else [])


def test_the_heuristic_schedule_lengthens_the_drafts_while_all_are_accepted():
    model = tiny_model("gpt2")
    seed, length = PROMPTS[0]
    out = speculative_decode(model, model, random_prompt(seed, length), draft_tokens=2, max_new_tokens=MAX_NEW,
                             draft_schedule="heuristic")
    assert out.new_tokens[0] == greedy("gpt2", seed, length)
    assert out.stats.fed[:3] == [3, 5, 7]  # k = 2, 4, 6 drafts, then the budget caps them


def test_the_heuristic_schedule_stays_exact_with_a_noisy_draft(arch):
    model = tiny_model(arch)
    for seed, length in PROMPTS:
        prompt = random_prompt(seed, length)
        out = speculative_decode(model, noisy_draft(arch), prompt, draft_tokens=3, max_new_tokens=MAX_NEW,
                                 draft_schedule="heuristic")
        assert_same_tokens(model, prompt[0].tolist(), greedy(arch, seed, length), out.new_tokens[0],
                           f"{arch} heuristic")


@pytest.mark.parametrize("k", [4, 7])
def test_speculative_stops_at_eos_inside_a_drafted_run(arch, k):
    """With the target as its own draft, step s makes new tokens 1 + (k + 1)(s - 1) .. (k + 1)s
    final: an EOS strictly inside such a run stops the row there."""
    model = tiny_model(arch)
    seed, length = PROMPTS[1]
    full = greedy(arch, seed, length)
    i = next(i for i in range(2, len(full)) if (i - 1) % (k + 1) not in (0, k) and full[i] not in full[:i])
    eos = full[i]
    expected = greedy(arch, seed, length, eos=eos)
    assert expected == full[: i + 1]
    for draft in (model, noisy_draft(arch)):
        out = speculative_decode(model, draft, random_prompt(seed, length), draft_tokens=k,
                                 max_new_tokens=MAX_NEW, eos_token_id=eos)
        assert_same_tokens(model, random_prompt(seed, length)[0].tolist(), expected, out.new_tokens[0],
                           f"{arch} eos k={k}")
        assert out.stats.new_tokens == len(expected) == sum(out.stats.accepted)


@pytest.mark.parametrize("max_new", [0, 1, 2, 3, 6])
def test_tiny_budgets_are_exact_and_the_last_token_needs_no_draft(max_new):
    model = tiny_model("qwen2")
    seed, length = PROMPTS[0]
    out = speculative_decode(model, noisy_draft("qwen2"), random_prompt(seed, length), draft_tokens=4,
                             max_new_tokens=max_new)
    assert out.new_tokens == [greedy("qwen2", seed, length, max_new=max_new) if max_new else []]
    if max_new <= 2:  # the prefill's token, then (a budget of 2) one target step with no drafts
        assert out.forward_passes == max_new and out.stats.draft_forward_passes == 0


@pytest.mark.parametrize("k", [2, 7])
@pytest.mark.parametrize("schedule", ["constant", "heuristic"])
def test_left_padded_batch_rows_equal_rows_decoded_alone(arch, k, schedule):
    model = tiny_model(arch)
    shapes = [(21, 3), (22, 10), (23, 6)]
    ids, mask = left_padded([random_prompt(s, n) for s, n in shapes])
    out = speculative_decode(model, noisy_draft(arch), ids, mask, draft_tokens=k, max_new_tokens=MAX_NEW,
                             draft_schedule=schedule)
    for r, (seed, length) in enumerate(shapes):
        prompt = random_prompt(seed, length)[0].tolist()
        assert_same_tokens(model, prompt, greedy(arch, seed, length), out.new_tokens[r], f"{arch} k={k} row {r}")


def test_batch_rows_finish_at_their_own_eos_and_the_cache_is_compacted_at_every_step(arch, monkeypatch):
    from cllm.runtime import rows as batched

    monkeypatch.setattr(batched, "COMPACT_MIN_WASTE", 1)
    monkeypatch.setattr(batched, "COMPACT_WASTE_FRACTION", 0.0)
    model = tiny_model(arch)
    shapes = [(21, 3), (22, 10), (23, 6), (24, 2)]
    ids, mask = left_padded([random_prompt(s, n) for s, n in shapes])
    eos = greedy(arch, *shapes[1])[5]  # row 1 stops early; the others when it comes, or at the budget
    out = speculative_decode(model, noisy_draft(arch), ids, mask, draft_tokens=3, max_new_tokens=MAX_NEW,
                             eos_token_id=eos)
    for r, (seed, length) in enumerate(shapes):
        prompt = random_prompt(seed, length)[0].tolist()
        assert_same_tokens(model, prompt, greedy(arch, seed, length, eos=eos), out.new_tokens[r], f"{arch} row {r}")


def test_the_acceptance_rule_and_the_schedule():
    drafts = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 7], [1, 6, 7]])
    outputs = torch.tensor([[5, 6, 7, 8], [5, 9, 7, 8], [5, 6, 9, 8], [5, 6, 7, 8]])
    # a draft after a rejected one is never accepted, even when it matches
    assert accepted_drafts(drafts, outputs).tolist() == [3, 1, 2, 0]
    assert accepted_drafts(torch.zeros(2, 0, dtype=torch.long), torch.ones(2, 1, dtype=torch.long)).tolist() == [0, 0]
    assert next_draft_tokens(4, True, "constant") == next_draft_tokens(4, False, "constant") == 4
    assert next_draft_tokens(4, True, "heuristic") == 6 and next_draft_tokens(4, False, "heuristic") == 3
    assert next_draft_tokens(1, False, "heuristic") == 1


@pytest.mark.parametrize("bad", [dict(draft_tokens=0), dict(draft_tokens=2.0), dict(draft_schedule="eager"),
                                 dict(temperature=-1.0), dict(max_new_tokens=-1)])
def test_bad_settings_are_value_errors(bad):
    model = tiny_model("llama")
    with pytest.raises(ValueError):
        speculative_decode(model, model, random_prompt(1, 4), **bad)


def test_a_draft_with_another_vocabulary_is_refused():
    model = tiny_model("llama")
    other = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB + 1, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2)).eval()
    with pytest.raises(ValueError, match="vocabulary"):
        speculative_decode(model, other, random_prompt(1, 4))


# ----------------------------------------------------------------------------------------------
# Sampling: the law of the target's AR sampling, whatever the draft (the setting of
# test_sampling.py: 3 tokens, the first 4 sampled tokens enumerated, N rows in one batch)

LAW_VOCAB, LENGTH, N = 3, 4, 4000
LAW_PROMPT = [2, 0, 2, 2, 1, 2, 2]


def _law_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=LAW_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    m = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():  # sharper than a random init: the context matters
        m.lm_head.weight.mul_(3)
    return m


@pytest.fixture(scope="module")
def law_models() -> tuple[torch.nn.Module, torch.nn.Module]:
    """The target of test_sampling.py and a draft whose law differs from it (another seed;
    seed 2 gives the negative controls the most power of seeds 1-3)."""
    return _law_model(0), _law_model(2)


@functools.cache
def _exact(model, temperature, top_k=None, top_p=None):
    return exact_joint_law(model, LAW_PROMPT, LENGTH, temperature=temperature, top_k=top_k, top_p=top_p)


def sampled(target, draft, seed: int, **settings) -> Counter:
    """Counts of the first LENGTH tokens of N rows of one batch, row i seeded (seed, i)."""
    generators = [torch.Generator().manual_seed(1_000_003 * seed + i) for i in range(N)]
    ids = torch.tensor([LAW_PROMPT]).expand(N, -1)
    out = speculative_decode(target, draft, ids, generator=generators, max_new_tokens=LENGTH, **settings)
    return Counter(tuple(t[:LENGTH]) for t in out.new_tokens)


SAMPLING = {  # id -> speculative_decode settings
    "k2-T1": dict(draft_tokens=2, temperature=1.0),
    "k3-T0.8-topk2": dict(draft_tokens=3, temperature=0.8, top_k=2),
    "k4-T1.2-topp0.9-heuristic": dict(draft_tokens=4, temperature=1.2, top_p=0.9, draft_schedule="heuristic"),
}


def _law(target, settings):
    return _exact(target, settings["temperature"], settings.get("top_k"), settings.get("top_p"))


@pytest.mark.parametrize("name", list(SAMPLING))
def test_speculative_sampling_has_the_exact_autoregressive_law(law_models, name):
    target, draft = law_models
    settings = SAMPLING[name]
    result = chi_square(sampled(target, draft, 40 + list(SAMPLING).index(name), **settings), _law(target, settings))
    assert not result.rejects(), f"{name}: {result}"


@pytest.mark.parametrize("name", list(SAMPLING))
def test_resampling_from_p_instead_of_the_residual_is_rejected(law_models, name, monkeypatch):
    """The negative control: the textbook bug planted in the verification, the test sees it.
    Measured when written: X2 = 334-807 (p < 1e-32) where the correct verification gives X2 =
    14-88 on 15-79 df (p = 0.22-0.75)."""
    monkeypatch.setattr(speculative_module, "verify_drafts", resample_from_p)
    target, draft = law_models
    settings = SAMPLING[name]
    result = chi_square(sampled(target, draft, 40 + list(SAMPLING).index(name), **settings), _law(target, settings))
    assert result.rejects(), f"{name}: the planted bug passed: {result}"


def test_sampling_with_the_target_as_draft_accepts_every_draft_and_is_seeded(law_models):
    target, _ = law_models
    prompt = torch.tensor([LAW_PROMPT])

    def run(seed):
        return speculative_decode(target, target, prompt, draft_tokens=3, max_new_tokens=9, temperature=1.0,
                                  generator=torch.Generator().manual_seed(seed))

    out = run(0)
    assert out.stats.accepted == [1, 4, 4]  # q = p: every draft accepted
    assert run(0).new_tokens == out.new_tokens  # same seed, same sample
    assert len({tuple(run(s).new_tokens[0]) for s in range(8)}) > 1
    greedy_out = speculative_decode(target, target, prompt, max_new_tokens=9, temperature=0.0)
    assert greedy_out.new_tokens == greedy_decode(target, prompt, max_new_tokens=9).new_tokens
