"""The draft table (`cllm.decoding.draft_table`): what it keeps, how it chains, that it round-trips
through its file, and that Jacobi decoding with it stays greedy decoding, token for token."""

import pytest
import torch

from cllm import greedy_decode, jacobi_decode
from cllm.decoding.draft_table import DraftTable
from tests.decoding.conftest import left_padded, tiny_model
from tests.decoding.scripted import Script, ScriptedLM, scripted_rule


def test_the_table_keeps_the_most_frequent_next_token_of_frequent_enough_contexts():
    seqs = [[1, 2, 3, 4, 9], [1, 2, 3, 4, 9], [1, 2, 3, 4, 8],  # (1, 2, 3, 4) -> 9 twice, 8 once
            [5, 6, 7, 1, 5, 6, 7, 2]]  # (5, 6, 7) -> 1 once, 2 once: below min_count 2
    table = DraftTable.build(seqs, orders=(4, 3), min_count=2, min_share=0.5)
    assert table.next_token[(1, 2, 3, 4)] == 9
    assert table.next_token[(1, 2, 3)] == 4 and table.next_token[(2, 3, 4)] == 9
    assert (5, 6, 7) not in table.next_token
    # a share of 2/3 passes 0.5 but not 0.7
    assert (1, 2, 3, 4) not in DraftTable.build(seqs, orders=(4,), min_count=2, min_share=0.7).next_token
    # windows never cross from one sequence into the next
    assert (4, 9, 1) not in DraftTable.build(seqs * 3, orders=(3,), min_count=1, min_share=0.0).next_token


def test_continuation_chains_the_longest_known_context_and_stops_at_an_unknown_one():
    table = DraftTable(orders=(4, 3), next_token={(1, 2, 3, 4): 5, (3, 4, 5): 6, (4, 5, 6): 7, (9, 9, 9, 9): 1})
    assert table.continuation([0, 1, 2, 3, 4], 10) == [5, 6, 7]  # 4-gram, then 3-gram back-off twice
    assert table.continuation([0, 1, 2, 3, 4], 2) == [5, 6]
    assert table.continuation([7, 3, 4], 3) == []  # (7, 3, 4) and the 4-gram are unknown
    assert table.continuation([4], 3) == [] and table.continuation([], 3) == []
    assert table.continuation([9, 9, 9, 9], 3) == [1]  # (9, 9, 9, 1) / (9, 9, 1) unknown
    table.next_token[(4, 5, 6, 7)] = 8  # the 4-gram wins over a 3-gram when both are known
    table.next_token[(5, 6, 7)] = 0
    assert table.continuation([1, 2, 3, 4], 4) == [5, 6, 7, 8]


def test_the_table_round_trips_through_its_file(tmp_path):
    seqs = [list(range(10, 40)) * 3, [5, 6, 7, 8, 5, 6, 7, 8]]
    table = DraftTable.build(seqs, meta={"model": "m", "tokenizer": "abc"})
    path = table.save(tmp_path / "drafts" / "ngram.safetensors")
    loaded = DraftTable.load(path)
    assert loaded.next_token == table.next_token and len(loaded) == len(table) > 0
    assert loaded.orders == (4, 3, 2) and loaded.meta["model"] == "m" and loaded.meta["min_count"] == 2
    assert not list((tmp_path / "drafts").glob("*.tmp"))


def test_a_file_that_is_not_a_table_is_refused(tmp_path):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not a cllm draft table"):
        DraftTable.load(tmp_path / "other.safetensors")
    with pytest.raises(FileNotFoundError):
        DraftTable.load(tmp_path / "missing.safetensors")


def _own_table(model, seed: int) -> DraftTable:
    """A table from the model's own greedy continuations of other random prompts."""
    prompts = [torch.randint(2, 64, (1, 5), generator=torch.Generator().manual_seed(seed + i)) for i in range(6)]
    seqs = [p[0].tolist() + greedy_decode(model, p, max_new_tokens=40).new_tokens[0] for p in prompts]
    return DraftTable.build(seqs, min_count=1, min_share=0.0)


@pytest.mark.parametrize("recycle", [0, 3])
@pytest.mark.parametrize("block_size", [3, 8])
def test_jacobi_with_the_models_own_table_equals_greedy(arch, block_size, recycle):
    model = tiny_model(arch)
    table = _own_table(model, 100)
    assert len(table) > 0
    for seed in (31, 32):
        prompt = torch.randint(2, 64, (1, 7), generator=torch.Generator().manual_seed(seed))
        expected = greedy_decode(model, prompt, max_new_tokens=33).new_tokens
        out = jacobi_decode(model, prompt, block_size=block_size, max_new_tokens=33, recycle=recycle,
                            draft_table=table, generator=torch.Generator().manual_seed(seed))
        assert out.new_tokens == expected, (arch, block_size, recycle, seed)


def test_a_wrong_table_cannot_change_the_output_in_a_padded_batch_with_eos(arch):
    model = tiny_model(arch)
    junk = DraftTable.build([torch.randint(2, 64, (200,), generator=torch.Generator().manual_seed(5)).tolist() * 2],
                            min_count=1, min_share=0.0)  # confident, and unrelated to the model
    prompts = [torch.randint(2, 64, (1, n), generator=torch.Generator().manual_seed(n)) for n in (3, 8, 5)]
    ids, mask = left_padded(prompts)
    eos = greedy_decode(model, ids, mask, max_new_tokens=30).new_tokens[1][9]
    expected = greedy_decode(model, ids, mask, max_new_tokens=30, eos_token_id=eos).new_tokens
    for recycle in (0, 2):
        out = jacobi_decode(model, ids, mask, block_size=6, max_new_tokens=30, eos_token_id=eos, recycle=recycle,
                            draft_table=junk, generator=torch.Generator().manual_seed(0))
        assert out.new_tokens == expected, (arch, recycle)


def test_jacobi_sampling_with_a_table_still_verifies_every_token():
    """Sampling: the table sets guesses only, and verification accepts a guess only as a draw of
    the model's law; with top_k = 1 that law is greedy's, so the output must be greedy's."""
    model = tiny_model("llama")
    table = _own_table(model, 200)
    prompt = torch.randint(2, 64, (1, 6), generator=torch.Generator().manual_seed(9))
    expected = greedy_decode(model, prompt, max_new_tokens=25).new_tokens
    out = jacobi_decode(model, prompt, block_size=5, max_new_tokens=25, temperature=0.8, top_k=1,
                        draft_table=table, generator=torch.Generator().manual_seed(0))
    assert out.new_tokens == expected


PLAIN = Script(prompt=(4, 5, 6), continuation=tuple(range(50, 82)))  # nothing in the prompt to look up


def test_a_table_of_the_continuation_makes_blocks_converge_in_one_forward():
    """The scripted model writes 50, 51, ... after (4, 5, 6) and JUNK after any wrong context:
    plain Jacobi (random guesses) gains nothing, and recycling finds nothing in the prompt; a
    table that knows the continuation guesses every block right: a block per forward."""
    table = DraftTable.build([list(PLAIN.prompt + PLAIN.continuation)], min_count=1, min_share=0.0)
    runs = {}
    for name, kwargs in {"plain": {}, "recycle": {"recycle": 2}, "table": {"draft_table": table},
                         "table+recycle": {"draft_table": table, "recycle": 2}}.items():
        model = ScriptedLM(scripted_rule(PLAIN))
        out = jacobi_decode(model, torch.tensor([PLAIN.prompt]), block_size=8, max_new_tokens=32, guess="random",
                            generator=torch.Generator().manual_seed(0), **kwargs)
        assert out.new_tokens == [list(PLAIN.continuation)], name
        runs[name] = out.forward_passes
    assert runs["plain"] >= 16 and runs["recycle"] >= 16
    # prefill, then each 8-token block's tail accepted whole (and the next first token with it)
    assert runs["table"] <= 5 and runs["table+recycle"] <= 5


def test_table_drafts_are_counted_as_the_tables():
    """The table knows the scripted continuation: every token a block starts with comes from
    it, the rest are the one token each forward makes final; per-block sources add up."""
    table = DraftTable.build([list(PLAIN.prompt + PLAIN.continuation)], min_count=1, min_share=0.0)
    events = []
    out = jacobi_decode(ScriptedLM(scripted_rule(PLAIN)), torch.tensor([PLAIN.prompt]), block_size=8,
                        max_new_tokens=32, guess="random", generator=torch.Generator().manual_seed(0),
                        draft_table=table, on_iteration=events.append)
    sources = out.stats.sources
    assert set(sources) == {"ar", "table"} and sum(sources.values()) == 32
    assert out.forward_passes - 1 <= sources["ar"] <= out.forward_passes  # one per forward (the last may be cut)
    per_block = [s for e in events if e.converged for s in e.sources]  # each block's final tokens
    assert len(per_block) == 32 and {s: per_block.count(s) for s in sources} == sources
