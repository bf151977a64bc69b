"""Jacobi decoding on a scripted model, against trajectories worked out by hand.

Script of row A (prompt 2 3, greedy continuation 10 11 12 ...): the model predicts the next
continuation token after a correct context and JUNK after a wrong one, except at continuation
index 3, which it always gets right (a stationary token). With block_size 4 and guess "repeat"
(fill the block with its known first token):

    prefill                      -> 10                       block 0 opens: (10 10 10 10)
    iteration 1  feed 10 10 10 10 -> 11 J  13 J   accept 1    state (10 11 J  13), final 10 11
    iteration 2  feed 11 J  13    -> 12 13 J      accept 1    state (10 11 12 13), final ... 12
    iteration 3  feed 12 13       -> 13 14        accept 2    state unchanged: converged, 14 free

so 5 tokens cost 4 forwards (greedy: 5), accepted per forward 1 1 1 2, the correct prefix goes
1 -> 2 -> 4 -> 4 (fast-forwarded 1, 2, 0) and token 13 is stationary.
"""

import pytest
import torch

from cllm import greedy_decode, jacobi_decode
from tests.decoding.scripted import JUNK, Script, ScriptedLM, scripted_rule

ROW_A = Script(prompt=(2, 3), continuation=tuple(range(10, 40)), robust=frozenset({3}))
ROW_B = Script(prompt=(4, 5, 6), continuation=tuple(range(50, 80)))  # no robust tokens: AR pace
EOS = 99
ROW_EOS = Script(prompt=(7,), continuation=(10, 11, EOS, 12, 13, 14))
SAME = Script(prompt=(8, 9), continuation=(7,) * 30)  # guess "repeat" is right at once


def decode(script_rows, **kwargs):
    model = ScriptedLM(scripted_rule(*script_rows))
    longest = max(len(s.prompt) for s in script_rows)
    ids = torch.tensor([[0] * (longest - len(s.prompt)) + list(s.prompt) for s in script_rows])
    mask = torch.tensor(
        [[0] * (longest - len(s.prompt)) + [1] * len(s.prompt) for s in script_rows]
    )
    events = []
    out = jacobi_decode(model, ids, mask, on_iteration=events.append, **kwargs)
    assert out.forward_passes == model.calls
    return out, events


def test_hand_computed_trajectory_counts():
    out, events = decode([ROW_A], block_size=4, max_new_tokens=5, guess="repeat")
    assert out.new_tokens == [[10, 11, 12, 13, 14]]
    assert out.forward_passes == 4
    assert out.stats.accepted_histogram() == {1: 3, 2: 1}
    assert out.stats.iterations_per_block == [3, 0]
    assert out.stats.fast_forwarded == [1, 2, 0]
    assert out.stats.stationary == [1, 0]
    assert [(e.block_index, e.iteration, e.state, e.committed, e.converged) for e in events] == [
        (0, 0, (10, 10, 10, 10), 1, False),
        (0, 1, (10, 11, JUNK, 13), 2, False),
        (0, 2, (10, 11, 12, 13), 3, False),
        (0, 3, (10, 11, 12, 13), 4, True),
        (1, 0, (14,), 1, True),
    ]


def test_right_guesses_fast_forward_a_whole_block_per_forward():
    out, _ = decode([SAME], block_size=4, max_new_tokens=8, guess="repeat")
    assert out.new_tokens == [[7] * 8]
    # prefill, then one forward per block: 4 accepted + the next block's first token for free;
    # the second block's last forward is cut by the budget
    assert out.forward_passes == 3
    assert out.stats.accepted == [1, 4, 3]
    assert out.stats.iterations_per_block == [1, 1]
    assert out.stats.fast_forwarded == [0, 0]  # the guess was already the fixed point
    assert out.stats.stationary == [0, 0]


def test_eos_inside_a_block_ends_the_row_there():
    out, events = decode(
        [ROW_EOS], block_size=4, max_new_tokens=10, guess="repeat", eos_token_id=EOS
    )
    assert out.new_tokens == [[10, 11, EOS]]
    assert out.forward_passes == 3
    last = events[-1]
    assert (last.iteration, last.state[:3], last.committed, last.converged) == (
        2,
        (10, 11, EOS),
        3,
        True,
    )


def test_block_size_one_uses_one_forward_per_token():
    model = ScriptedLM(scripted_rule(ROW_A))
    out = jacobi_decode(model, torch.tensor([ROW_A.prompt]), block_size=1, max_new_tokens=9)
    assert out.new_tokens == [list(ROW_A.continuation[:9])]
    assert out.forward_passes == 9 == model.calls
    assert out.stats.accepted_histogram() == {1: 9}


@pytest.mark.parametrize("block_size", [1, 2, 3, 4, 7, 16])
@pytest.mark.parametrize("guess", ["prompt", "repeat", "random"])
def test_never_more_forwards_than_greedy(block_size, guess):
    for script in (ROW_A, ROW_B, SAME):
        model = ScriptedLM(scripted_rule(script))
        ids = torch.tensor([script.prompt])
        greedy = greedy_decode(model, ids, max_new_tokens=23)
        out = jacobi_decode(
            model,
            ids,
            block_size=block_size,
            max_new_tokens=23,
            guess=guess,
            generator=torch.Generator().manual_seed(0),
        )
        assert out.new_tokens == greedy.new_tokens
        assert out.forward_passes <= greedy.forward_passes == 23


def test_batch_rows_with_different_acceptance_match_each_row_alone():
    # rows accept different numbers of tokens per iteration: the cache gets holes; the mock
    # reads its context back from the cache, so a wrong rollback would change its output
    rows = [ROW_A, ROW_B, SAME]
    alone = [decode([s], block_size=4, max_new_tokens=13, guess="repeat") for s in rows]
    together, events = decode(rows, block_size=4, max_new_tokens=13, guess="repeat")
    assert together.new_tokens == [out.new_tokens[0] for out, _ in alone]
    assert together.forward_passes == max(out.forward_passes for out, _ in alone)
    for r, (_, row_events) in enumerate(alone):
        mine = [e for e in events if e.row == r]
        assert [(e.state, e.committed) for e in mine] == [
            (e.state, e.committed) for e in row_events
        ]


def test_compaction_keeps_rows_exact(monkeypatch):
    # compact at every opportunity: holes are gathered away many times during the run
    from cllm.runtime import rows as batched

    monkeypatch.setattr(batched, "COMPACT_MIN_WASTE", 1)
    monkeypatch.setattr(batched, "COMPACT_WASTE_FRACTION", 0.0)
    rows = [ROW_A, ROW_B, SAME]
    together, _ = decode(rows, block_size=5, max_new_tokens=21, guess="repeat")
    assert together.new_tokens == [list(s.continuation[:21]) for s in rows]


def test_each_final_token_says_where_it_came_from():
    """The trajectory in the module docstring: 10, 11, 12 are each the one token a forward makes
    final anyway ("ar"), 13 was predicted two updates earlier and verified ("jacobi"), 14 "ar";
    with guess "repeat" on a constant continuation the guesses themselves are verified."""
    out, events = decode([ROW_A], block_size=4, max_new_tokens=5, guess="repeat")
    assert out.new_tokens == [[10, 11, 12, 13, 14]]
    block0 = [e for e in events if e.block_index == 0 and e.converged][0]
    assert block0.sources == ("ar", "ar", "ar", "jacobi")
    assert [len(e.sources) for e in events] == [e.committed for e in events]
    assert out.stats.sources == {"ar": 4, "jacobi": 1}
    out, events = decode([SAME], block_size=4, max_new_tokens=8, guess="repeat")
    assert out.stats.sources == {"ar": 2, "guess": 6}  # prefill + 3 guesses + the free token, twice
