"""Continuous batching (`BatchDecoder`): rows that join a running batch at different steps, with
their own budgets, and rows taken out early, each get exactly what they get decoded alone:
greedy rows `greedy_decode`'s tokens (and the forward passes `jacobi_decode` alone takes), seeded
sampled rows the same draws as `jacobi_decode` alone with the same seed.
"""

import pytest
import torch

from cllm import greedy_decode, jacobi_decode
from cllm.decoding import BatchDecoder
from cllm.decoding.draft_table import DraftTable
from cllm.runtime import as_runtime
from tests.decoding.conftest import assert_same_tokens, random_prompt, tiny_model

# (seed, prompt length, max_new_tokens, the step before which the row joins)
ARRIVALS = [(41, 5, 30, 0), (42, 12, 9, 0), (43, 3, 23, 2), (44, 17, 1, 3), (45, 8, 26, 5), (46, 2, 14, 11)]
SETTINGS = {
    "plain n=4": dict(block_size=4),
    "ar n=1": dict(block_size=1),
    "recycling": dict(block_size=4, recycle=8, recycle_budget=24),
    "blocks in flight": dict(block_size=5, blocks_in_flight=2),
}


def _run_staggered(decoder: BatchDecoder, arrivals, generator_for=None) -> dict[int, tuple[list[int], int]]:
    """Add each prompt before its step, step until every row is done; per arrival: (tokens,
    forward passes the row took part in)."""
    ids: dict[int, int] = {}
    step = 0
    while len(ids) < len(arrivals) or decoder.running:
        for k, (seed, length, budget, at) in enumerate(arrivals):
            if at == step:
                gen = generator_for(seed) if generator_for else torch.Generator().manual_seed(seed)
                (ids[k],) = decoder.add(random_prompt(seed, length), max_new_tokens=budget, generator=gen)
        decoder.step()
        step += 1
    return {k: (decoder.tokens(r), decoder.forward_passes(r)) for k, r in ids.items()}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_rows_joining_at_different_steps_get_greedy_tokens_and_their_own_forward_count(arch, name):
    model = tiny_model(arch)
    settings = SETTINGS[name]
    got = _run_staggered(BatchDecoder(model, **settings), ARRIVALS)
    for k, (seed, length, budget, _) in enumerate(ARRIVALS):
        prompt = random_prompt(seed, length)
        expected = greedy_decode(model, prompt, max_new_tokens=budget).new_tokens[0]
        assert_same_tokens(model, prompt[0].tolist(), expected, got[k][0], f"{arch} {name} row {k}")
        alone = jacobi_decode(model, prompt, max_new_tokens=budget, generator=torch.Generator().manual_seed(seed),
                              **settings)
        assert got[k][1] == alone.forward_passes, (arch, name, k)


def test_rows_with_eos_and_a_draft_table_join_and_leave_and_stay_greedy(arch):
    model = tiny_model(arch)
    full = greedy_decode(model, random_prompt(41, 5), max_new_tokens=30).new_tokens[0]
    stop = next(i for i in range(5, 30) if full[i] not in full[:i])
    eos = full[stop]  # a token the first row produces: it stops there, mid-batch
    seqs = [greedy_decode(model, random_prompt(s, 6), max_new_tokens=40).new_tokens[0] for s in range(3)]
    table = DraftTable.build(seqs, min_count=1, min_share=0.0)
    decoder = BatchDecoder(model, block_size=4, recycle=4, eos_token_id=eos, draft_table=table)
    got = _run_staggered(decoder, ARRIVALS)
    for k, (seed, length, budget, _) in enumerate(ARRIVALS):
        prompt = random_prompt(seed, length)
        expected = greedy_decode(model, prompt, max_new_tokens=budget, eos_token_id=eos).new_tokens[0]
        assert_same_tokens(model, prompt[0].tolist(), expected, got[k][0], f"{arch} row {k}")
    assert got[0][0] == full[: stop + 1]


class ChainsOnly:
    """A runtime whose sessions hold chains only (`tree_leaves` 1 for every row), as a row in a
    llama.cpp stream of its own does; every chain fed is recorded."""

    def __init__(self, runtime):
        self._runtime, self.fed = runtime, []

    def __getattr__(self, name):
        return getattr(self._runtime, name)

    def session(self):
        return _ChainsOnlySession(self._runtime.session(), self.fed)


class _ChainsOnlySession:
    def __init__(self, session, fed):
        self._session, self._fed = session, fed

    def __getattr__(self, name):
        return getattr(self._session, name)

    def tree_leaves(self, rows):
        return [1] * len(rows)

    def feed(self, rows, tokens, *, parents=None, hidden=False):
        assert parents is None, "a tree fed to a session that holds chains only"
        self._fed.append([len(t) for t in tokens])
        return self._session.feed(rows, tokens, hidden=hidden)


@pytest.mark.parametrize("table", [False, True])
def test_where_trees_cannot_be_held_recycling_feeds_equal_chains_and_stays_greedy(arch, table):
    """Greedy recycling on a session that holds no trees: each row feeds a chain with its best
    pool draft in the tail's place, every chain a block long (llama.cpp computes equal chains
    of its streams in one pass); rows joining and leaving, EOS-free budgets, a draft table or
    none: each row's tokens are greedy's."""
    model = tiny_model(arch)
    seqs = [greedy_decode(model, random_prompt(s, 6), max_new_tokens=40).new_tokens[0] for s in range(3)]
    draft_table = DraftTable.build(seqs, min_count=1, min_share=0.0) if table else None
    chains = ChainsOnly(as_runtime(model))
    decoder = BatchDecoder(chains, block_size=4, recycle=8, recycle_budget=24, draft_table=draft_table)
    got = _run_staggered(decoder, ARRIVALS)
    for k, (seed, length, budget, _) in enumerate(ARRIVALS):
        prompt = random_prompt(seed, length)
        expected = greedy_decode(model, prompt, max_new_tokens=budget).new_tokens[0]
        assert_same_tokens(model, prompt[0].tolist(), expected, got[k][0], f"{arch} row {k}")
    assert chains.fed and all(n == 4 for step in chains.fed for n in step), [s for s in chains.fed if set(s) != {4}]
    assert decoder.take_stats().forward_passes < sum(budget for _, _, budget, _ in ARRIVALS)


def test_changing_the_recycling_budget_between_steps_keeps_every_row_greedy(arch):
    model = tiny_model(arch)
    decoder = BatchDecoder(model, block_size=4, recycle=8, recycle_budget=24)
    budgets = iter([1, 2, 40, None, 3] * 20)
    ids: dict[int, int] = {}
    step = 0
    while len(ids) < len(ARRIVALS) or decoder.running:
        for k, (seed, length, budget, at) in enumerate(ARRIVALS):
            if at == step:
                (ids[k],) = decoder.add(random_prompt(seed, length), max_new_tokens=budget)
        decoder.set_recycle_budget(next(budgets))
        decoder.step()
        step += 1
    for k, (seed, length, budget, _) in enumerate(ARRIVALS):
        prompt = random_prompt(seed, length)
        expected = greedy_decode(model, prompt, max_new_tokens=budget).new_tokens[0]
        assert_same_tokens(model, prompt[0].tolist(), expected, decoder.tokens(ids[k]), f"{arch} row {k}")
    with pytest.raises(ValueError, match="recycle_budget"):
        decoder.set_recycle_budget(-1)
    decoder.set_recycle_budget(0)  # 0 means no limit, as on the command line
    assert decoder.cfg.recycle_budget is None


def test_a_removed_row_stops_and_leaves_the_others_unchanged():
    model = tiny_model("llama")
    decoder = BatchDecoder(model, block_size=4, recycle=4)
    a, b, c = (decoder.add(random_prompt(s, 6), max_new_tokens=30)[0] for s in (51, 52, 53))
    for _ in range(3):
        decoder.step()
    decoder.remove(b)
    assert decoder.running == 2
    with pytest.raises(KeyError):
        decoder.tokens(b)
    while decoder.step():
        pass
    for row, seed in ((a, 51), (c, 53)):
        assert decoder.tokens(row) == greedy_decode(model, random_prompt(seed, 6), max_new_tokens=30).new_tokens[0]
    assert decoder.session.rows() == [] and decoder.running == 0  # nothing running: the session holds nothing


def test_the_decoder_is_reused_after_its_batch_emptied_and_finish_collects_rows():
    model = tiny_model("qwen2")
    decoder = BatchDecoder(model, block_size=3)
    first = decoder.add(random_prompt(61, 4), max_new_tokens=8)
    while decoder.step():
        pass
    second = decoder.add(random_prompt(62, 7), max_new_tokens=[12])
    while decoder.step():
        pass
    out = decoder.finish(first + second)
    assert out.new_tokens == [greedy_decode(model, random_prompt(s, n), max_new_tokens=m).new_tokens[0]
                              for s, n, m in ((61, 4, 8), (62, 7, 12))]
    assert out.stats.new_tokens == 20 and decoder.take_stats().forward_passes == 0
    with pytest.raises(KeyError):
        decoder.tokens(first[0])


@pytest.mark.parametrize("settings", [dict(block_size=4), dict(block_size=1), dict(block_size=4, recycle=4)])
def test_seeded_sampled_rows_draw_what_they_draw_alone_whatever_joins_them(settings):
    model = tiny_model("llama")
    sampling = dict(temperature=0.8, top_p=0.95)
    decoder = BatchDecoder(model, **settings, **sampling)
    got = _run_staggered(decoder, ARRIVALS, generator_for=lambda seed: torch.Generator().manual_seed(1000 + seed))
    for k, (seed, length, budget, _) in enumerate(ARRIVALS):
        alone = jacobi_decode(model, random_prompt(seed, length), max_new_tokens=budget, **settings, **sampling,
                              generator=torch.Generator().manual_seed(1000 + seed))
        assert got[k][0] == alone.new_tokens[0], (settings, k)
    greedy = greedy_decode(model, random_prompt(41, 5), max_new_tokens=30).new_tokens[0]
    assert got[0][0] != greedy  # the rows did sample


def test_add_checks_each_rows_budget_against_the_context():
    model = tiny_model("llama")  # 256 positions
    decoder = BatchDecoder(model, block_size=4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        decoder.add(random_prompt(1, 4), max_new_tokens=0)
    with pytest.raises(ValueError, match="one per row"):
        decoder.add(torch.ones(2, 4, dtype=torch.long), max_new_tokens=[5])
    with pytest.raises(ValueError, match="position limit 256"):
        decoder.add(random_prompt(1, 250), max_new_tokens=7)
    assert decoder.running == 0 and decoder.take_stats().forward_passes == 0


class Poison(RuntimeError):
    pass


def poison_row(monkeypatch, where: str, prompt_of_row: list[int], after: int = 0) -> None:
    """Make `where` (the verifiers' `tail` before the forward, or `advance` after it) raise for
    the row whose prompt is `prompt_of_row`, from that row's `after`-th call on."""
    import cllm.decoding.jacobi.verifiers as verifiers

    real, calls = getattr(verifiers, where), {"n": 0}

    def poisoned(row, *args, **kwargs):
        if row.prompt_list == prompt_of_row:
            calls["n"] += 1
            if calls["n"] > after:
                raise Poison("boom")
        return real(row, *args, **kwargs)

    monkeypatch.setattr(verifiers, where, poisoned)


@pytest.mark.parametrize("where", ["tail", "advance"])
@pytest.mark.parametrize("name", ["plain n=4", "ar n=1", "recycling", "sampling"])
def test_a_row_that_fails_mid_batch_fails_alone_and_its_mates_are_unchanged(monkeypatch, where, name):
    model = tiny_model("llama")
    settings = dict(block_size=4, temperature=0.8) if name == "sampling" else SETTINGS[name]
    prompts = [random_prompt(s, 5 + s % 3) for s in (61, 62, 63)]
    alone = [jacobi_decode(model, p, max_new_tokens=20, generator=torch.Generator().manual_seed(s), **settings)
             for s, p in zip((61, 62, 63), prompts)]
    poison_row(monkeypatch, where, prompts[1][0].tolist(), after=2)
    decoder = BatchDecoder(model, **settings)
    rows = [decoder.add(p, max_new_tokens=20, generator=torch.Generator().manual_seed(s))[0]
            for s, p in zip((61, 62, 63), prompts)]
    while decoder.step():
        pass
    assert isinstance(decoder.error(rows[1]), Poison) and decoder.done(rows[1])
    for k in (0, 2):
        assert decoder.error(rows[k]) is None and decoder.tokens(rows[k]) == alone[k].new_tokens[0], (name, k)
        assert decoder.forward_passes(rows[k]) == alone[k].forward_passes
    assert decoder.running == 0
    with pytest.raises(Poison):  # the library call raises it, as it always did
        jacobi_decode(model, prompts[1], max_new_tokens=20, **settings)
