"""The "lookup" initial guess: what followed the same n-gram earlier (prompt lookup's draft)."""

import pytest
import torch

from cllm import greedy_decode, jacobi_decode
from cllm.decoding.jacobi import lookup_continuation, pool_candidates
from tests.decoding.conftest import left_padded, tiny_model
from tests.decoding.scripted import Script, ScriptedLM, scripted_rule


def test_lookup_copies_what_followed_the_latest_longest_match():
    #          0  1  2  3  4  5  6  7  8  9
    history = [5, 6, 7, 8, 9, 6, 7, 1, 2, 6, 7]
    # last 3 tokens (2, 6, 7) never occurred before; (6, 7) did, latest at 5..6, followed by 1, 2
    assert lookup_continuation(history, 3) == [1, 2, 6]
    assert lookup_continuation(history, 1) == [1]
    # only a 1-gram match: 4 occurred at index 0
    assert lookup_continuation([4, 3, 2, 4], 5) == [3, 2, 4]
    # cut at the end of the history
    assert lookup_continuation([1, 2, 3, 1, 2], 10) == [3, 1, 2]
    assert lookup_continuation([1, 2, 3], 4) == []
    assert lookup_continuation([1], 4) == []


LOOP = Script(prompt=(2, 3, 20, 21, 22, 23, 24, 25, 2, 3), continuation=(20, 21, 22, 23, 24, 25, 2, 3) * 4)
PLAIN = Script(prompt=(4, 5, 6), continuation=tuple(range(50, 80)))  # nothing to look up


def test_lookup_guess_follows_a_loop_a_block_per_forward():
    """Block 8, 24 tokens of a loop the prompt already shows; JUNK after any wrong context.
    prefill -> 20; block (20 | 21..25 2 3) looked up: 1 forward accepts all 8 and hands over the
    next first token (20), twice more: 24 tokens in 1 + 3 forwards (greedy: 24)."""
    model = ScriptedLM(scripted_rule(LOOP))
    out = jacobi_decode(model, torch.tensor([LOOP.prompt]), block_size=8, max_new_tokens=24, guess="lookup")
    assert out.new_tokens[0] == list(LOOP.continuation[:24])
    assert out.forward_passes == model.calls == 4
    prompt_guess = jacobi_decode(ScriptedLM(scripted_rule(LOOP)), torch.tensor([LOOP.prompt]), block_size=8,
                                 max_new_tokens=24, guess="prompt", generator=torch.Generator().manual_seed(0))
    assert prompt_guess.new_tokens == out.new_tokens and prompt_guess.forward_passes > 4


def test_lookup_guess_in_a_padded_batch_equals_greedy():
    model = ScriptedLM(scripted_rule(LOOP, PLAIN))
    ids = torch.tensor([list(LOOP.prompt), [0] * 7 + list(PLAIN.prompt)])
    mask = (torch.arange(10)[None, :] >= torch.tensor([[0], [7]])).long()
    expected = greedy_decode(model, ids, mask, max_new_tokens=21).new_tokens
    out = jacobi_decode(model, ids, mask, block_size=5, max_new_tokens=21, guess="lookup",
                        generator=torch.Generator().manual_seed(1))
    assert out.new_tokens == expected
    assert expected[0] == list(LOOP.continuation[:21]) and expected[1] == list(PLAIN.continuation[:21])


# ------------------------------------------------------------------------------------------
# N-gram recycling: pool drafts verified beside the Jacobi tail in one tree-masked forward


def test_pool_candidates_search_the_history_then_recent_states():
    history = [1, 2, 3, 9, 2, 3, 7, 2, 3]
    # key (2, 3): latest earlier occurrence first (-> 7 2 3), then the earlier one (-> 9 2 3)
    assert pool_candidates(history, [], 3, 2) == [[7, 2, 3], [9, 2, 3]]
    # then recent Jacobi states; shorter keys after longer ones
    assert pool_candidates([5, 6], [[6, 8, 8]], 2, 3) == [[8, 8]]
    assert pool_candidates([5], [], 2, 3) == []


def _pool_by_slices(history, recent, width, count, max_ngram, min_ngram, halve_shorter):
    """pool_candidates' rule written out plainly: every start, latest first, compared as lists."""
    found = []
    for g in range(min(max_ngram, len(history)), min_ngram - 1, -1):
        key = history[-g:]
        w = max(1, width >> (max_ngram - g)) if halve_shorter else width
        for seq in [history, *reversed(recent)]:
            for start in range(len(seq) - g - 1, -1, -1):
                cand = seq[start + g : start + g + w]
                if seq[start : start + g] == key and cand and cand not in found:
                    found.append(cand)
                    if len(found) >= count:
                        return found
    return found


def test_pool_candidates_find_what_a_plain_scan_finds_in_its_order():
    generator = torch.Generator().manual_seed(0)
    for trial in range(300):
        vocab = [3, 6, 300][trial % 3]  # few token ids: many matches, overlapping ones too
        history = torch.randint(vocab, (int(torch.randint(1, 60, (1,), generator=generator)),),
                                generator=generator).tolist()
        recent = [torch.randint(vocab, (n,), generator=generator).tolist() for n in (0, 1, 5, 9)]
        for width, count, min_ngram, halve in ((4, 3, 2, True), (16, 9, 1, False), (1, 1, 1, False)):
            got = pool_candidates(history, recent, width, count, min_ngram=min_ngram, halve_shorter=halve)
            assert got == _pool_by_slices(history, recent, width, count, 3, min_ngram, halve), (history, recent)
    assert pool_candidates([2**40, 7, 2**40], [], 2, 1) == [[7, 2**40]]  # any id a tokenizer may have
    # the n-gram (0, 0) also matches the bytes of 0, 256 one byte later: not a match, and the
    # one a byte before it still is
    assert pool_candidates([0, 0, 256, 7, 0, 0], [], 2, 1) == [[256, 7]]


@pytest.mark.parametrize("min_ngram", [1, 2])
@pytest.mark.parametrize("recycle", [1, 3])
@pytest.mark.parametrize("block_size", [2, 7, 16])
def test_recycling_equals_greedy(arch, block_size, recycle, min_ngram):
    model = tiny_model(arch)
    for seed, length in [(21, 4), (22, 15)]:
        g = torch.Generator().manual_seed(seed)
        prompt = torch.randint(2, 64, (1, length), generator=g).repeat(1, 3)  # repeats: the pool has hits
        expected = greedy_decode(model, prompt, max_new_tokens=37).new_tokens
        out = jacobi_decode(model, prompt, block_size=block_size, max_new_tokens=37, recycle=recycle,
                            recycle_min_ngram=min_ngram, generator=torch.Generator().manual_seed(seed))
        assert out.new_tokens == expected, (arch, block_size, recycle, min_ngram, seed)
        assert out.forward_passes <= 37
        # every forward after the prefill reports its width: the tail plus the drafts' new nodes
        assert len(out.stats.fed) == out.forward_passes - 1
        assert all(1 <= f <= block_size + recycle * 16 for f in out.stats.fed)


@pytest.mark.parametrize("budget", [None, 3, 9])
def test_recycling_with_a_budget_equals_greedy(arch, budget):
    model = tiny_model(arch)
    g = torch.Generator().manual_seed(23)
    prompt = torch.randint(2, 64, (1, 6), generator=g).repeat(1, 4)
    expected = greedy_decode(model, prompt, max_new_tokens=40).new_tokens
    out = jacobi_decode(model, prompt, block_size=5, max_new_tokens=40, recycle=4, recycle_min_ngram=1,
                        recycle_budget=budget, generator=torch.Generator().manual_seed(0))
    assert out.new_tokens == expected, (arch, budget)
    if budget is not None:  # the tail (at most n tokens) is fed whole, drafts only within the budget
        assert max(out.stats.fed) <= max(budget, 5)


def test_pool_drafts_need_a_match_of_min_ngram_tokens():
    #          0  1  2  3  4  5  6  7
    history = [7, 1, 2, 9, 3, 2, 5, 2]  # only the last token (2) occurred before: at 5, then at 2
    assert pool_candidates(history, (), 2, 4) == [[5, 2], [9, 3]]
    assert pool_candidates(history, (), 2, 4, min_ngram=2) == []
    history = [4, 2, 6, 8, 4, 2]  # (4, 2) occurred at 0..1, followed by 6, 8
    assert pool_candidates(history, (), 2, 4, min_ngram=2) == [[6, 8]]
    assert pool_candidates(history, (), 2, 4, min_ngram=3) == []


def test_shorter_matches_draft_shorter_when_halving():
    #          0  1  2  3  4  5  6  7  8  9 10 11 12 13 14
    history = [1, 2, 3, 4, 5, 6, 7, 8, 9, 5, 2, 3, 9, 2, 3]  # (9, 2, 3) never before; (2, 3) twice
    assert pool_candidates(history, (), 8, 2) == [[9, 2, 3], [4, 5, 6, 7, 8, 9, 5, 2]]
    # a 2-token match drafts half the width, a 1-token match a quarter
    assert pool_candidates(history, (), 8, 3, halve_shorter=True) == [[9, 2, 3], [4, 5, 6, 7], [9, 2]]
    history = [8, 1, 2, 3, 4, 5, 6, 7, 9, 7, 1, 2, 3, 4, 5, 6, 1, 2, 3]  # (1, 2, 3) twice before: full width
    assert pool_candidates(history, (), 8, 2, halve_shorter=True) == [[4, 5, 6, 1, 2, 3], [4, 5, 6, 7, 9, 7, 1, 2]]


def test_recycling_in_a_padded_batch_with_eos_equals_greedy(arch):
    model = tiny_model(arch)
    prompts = [torch.randint(2, 64, (1, n), generator=torch.Generator().manual_seed(n)).repeat(1, 2) for n in (3, 8, 5)]
    ids, mask = left_padded(prompts)
    full = greedy_decode(model, ids, mask, max_new_tokens=30).new_tokens
    eos = full[1][9]
    expected = greedy_decode(model, ids, mask, max_new_tokens=30, eos_token_id=eos).new_tokens
    out = jacobi_decode(model, ids, mask, block_size=6, max_new_tokens=30, eos_token_id=eos, recycle=2,
                        generator=torch.Generator().manual_seed(0))
    assert out.new_tokens == expected


def test_recycling_follows_a_loop_even_with_junk_guesses():
    """The scripted loop with guess "random": plain Jacobi crawls (JUNK after any wrong token);
    recycling finds the loop in the prompt and verifies it beside the junk tail."""
    model = ScriptedLM(scripted_rule(LOOP))
    plain = jacobi_decode(model, torch.tensor([LOOP.prompt]), block_size=8, max_new_tokens=24, guess="random",
                          generator=torch.Generator().manual_seed(0))
    model = ScriptedLM(scripted_rule(LOOP))
    recycled = jacobi_decode(model, torch.tensor([LOOP.prompt]), block_size=8, max_new_tokens=24, guess="random",
                             generator=torch.Generator().manual_seed(0), recycle=1)
    assert recycled.new_tokens == plain.new_tokens == [list(LOOP.continuation[:24])]
    assert recycled.forward_passes <= 7 < plain.forward_passes


def test_recycled_drafts_are_counted_as_the_pools():
    """The loop with junk guesses: what recycling verified is "pool", the rest "ar"."""
    model = ScriptedLM(scripted_rule(LOOP))
    out = jacobi_decode(model, torch.tensor([LOOP.prompt]), block_size=8, max_new_tokens=24, guess="random",
                        generator=torch.Generator().manual_seed(0), recycle=1)
    sources = out.stats.sources
    assert sum(sources.values()) == 24 and sources["ar"] <= out.forward_passes
    assert sources["pool"] > 24 / 2  # most tokens: junk guesses give Jacobi little to verify
    assert set(sources) <= {"ar", "pool", "guess", "jacobi"}


@pytest.mark.parametrize("settings", [{}, {"recycle": 1}, {"recycle": 2, "recycle_budget": 9},
                                      {"guess": "lookup", "temperature": 0.8}])
def test_drafts_are_counted_by_source_as_fed_and_as_accepted(settings):
    """At batch 1, every fed token but a forward's first is a draft, counted once by its source;
    the drafts made final are the final tokens not credited "ar", and no source has more
    accepted than fed (linear, tree and sampling verifiers)."""
    model = tiny_model("llama")
    prompt = torch.randint(2, 64, (1, 6), generator=torch.Generator().manual_seed(24)).repeat(1, 3)
    out = jacobi_decode(model, prompt, block_size=5, max_new_tokens=40, recycle_min_ngram=1,
                        generator=torch.Generator().manual_seed(0), **settings)
    stats = out.stats
    assert sum(stats.drafted.values()) == sum(f - 1 for f in stats.fed) > 0
    assert stats.drafts_accepted == {s: n for s, n in stats.sources.items() if s != "ar"}
    assert all(n <= stats.drafted.get(s, 0) for s, n in stats.drafts_accepted.items())
    if settings.get("recycle"):
        assert stats.drafted.get("pool", 0) > 0
