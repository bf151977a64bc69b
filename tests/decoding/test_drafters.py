"""Drafters alone (what each proposes), how the engine composes them, and a drafter plugged in
from outside: speed moves, the output never does."""

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from cllm import greedy_decode, jacobi_decode
from cllm.decoding import BatchDecoder, JacobiConfig
from cllm.decoding.draft_table import DraftTable
from cllm.decoding.jacobi.drafters import (
    GUESS_DRAFTERS,
    CarriedDrafts,
    DraftContext,
    Drafters,
    LookupGuess,
    PoolDrafter,
    PromptGuess,
    RandomGuess,
    RepeatGuess,
    TableDrafter,
    branches,
    fill,
)
from cllm.decoding.settings import GUESSES
from tests.decoding.conftest import random_prompt, tiny_model
from tests.decoding.scripted import Script, ScriptedLM, scripted_rule


def context(history, **kw) -> DraftContext:
    return DraftContext(list(history), **kw)


def test_guesses_fill_the_width():
    prompt = torch.tensor([7, 8, 9])
    g = torch.Generator().manual_seed(0)
    (drawn,) = PromptGuess().propose(context([7, 8, 9, 4], prompt_tokens=prompt, generator=g), 50)
    assert len(drawn) == 50 and set(drawn) <= {7, 8, 9} and len(set(drawn)) == 3
    again = PromptGuess().propose(context([4], prompt_tokens=prompt, generator=torch.Generator().manual_seed(0)), 50)
    assert again == [drawn]  # seeded by the row's generator
    assert RepeatGuess().propose(context([3, 4, 5]), 4) == [[5, 5, 5, 5]]
    (rand,) = RandomGuess().propose(context([1], vocab_size=6, generator=torch.Generator().manual_seed(1)), 40)
    assert len(rand) == 40 and set(rand) <= set(range(6)) and len(set(rand)) > 3
    # lookup: what followed (6, 7) earlier, then the prompt guess for the rest
    (looked,) = LookupGuess().propose(context([5, 6, 7, 1, 2, 6, 7], prompt_tokens=torch.tensor([9])), 5)
    assert looked == [1, 2, 6, 7, 9]
    assert tuple(GUESS_DRAFTERS) == GUESSES  # one drafter per `--guess` choice


def test_carried_table_and_pool_drafters_propose_nothing_when_they_know_nothing():
    assert CarriedDrafts().propose(context([1], carried=[4, 5, 6]), 2) == [[4, 5]]
    assert CarriedDrafts().propose(context([1]), 2) == []
    table = DraftTable(orders=(2,), next_token={(1, 2): 3, (2, 3): 4, (3, 4): 5})
    assert TableDrafter(table).propose(context([9, 1, 2]), 10) == [[3, 4, 5]]  # the chain stops at (4, 5)
    assert TableDrafter(table, max_width=2).propose(context([9, 1, 2]), 10) == [[3, 4]]
    assert TableDrafter(table).propose(context([9, 9]), 10) == []
    pool = PoolDrafter(most=2, min_ngram=1, halve_shorter=False)
    # (1, 2) was followed by 3 in the history, by 8 in the latest Jacobi state
    assert pool.propose(context([1, 2, 3, 0, 1, 2], recent=[[5, 1, 2, 8]]), 1) == [[3], [8]]
    skipping = PoolDrafter(most=2, min_ngram=2, halve_shorter=False, skip_current=True)
    assert skipping.propose(context([1, 2, 3, 0, 1, 2], recent=[[5, 1, 2, 8]]), 1) == [[3]]
    assert PoolDrafter(most=1, min_ngram=2).propose(context([1, 2]), 4) == []


def test_a_fill_chain_uses_each_drafter_in_turn_and_ends_with_a_guess():
    table = DraftTable(orders=(1,), next_token={(4,): 5, (5,): 6})
    chain = (CarriedDrafts(), TableDrafter(table), RepeatGuess())
    tokens, sources = fill(chain, context([1, 2], carried=[3, 4]), 6)
    # carried 3, 4; the table continues after 4: 5, 6; the guess repeats the last token
    assert tokens == [3, 4, 5, 6, 6, 6]
    assert sources == ["jacobi", "jacobi", "table", "table", "guess", "guess"]
    assert fill(chain, context([1], carried=[3, 4, 5]), 2) == ([3, 4], ["jacobi", "jacobi"])
    assert fill(chain, context([1]), 0) == ([], [])


def test_branches_skip_the_tails_own_drafts_duplicates_and_extras():
    @dataclass(frozen=True)
    class Fixed:
        drafts: tuple
        most: int
        source: ClassVar[str] = "pool"

        def propose(self, ctx, width):
            return [list(d[:width]) for d in self.drafts]

    tail = [1, 2, 3]
    a = Fixed(drafts=((2, 3), (2, 9), (4,), (5,)), most=2)  # (2, 3) is the tail's own continuation
    b = Fixed(drafts=((4,), (6, 6)), most=1)
    drafts, kinds = branches((a, b), context([1]), tail, 8)
    assert drafts == [[2, 9], [4], [6, 6]] and kinds == ["pool"] * 3


def test_the_settings_choose_the_drafters():
    table = DraftTable(orders=(1,), next_token={(1,): 2})
    plain = Drafters.from_settings(JacobiConfig(), None, sampling=False)
    assert plain.block == (CarriedDrafts(), PromptGuess()) and not plain.tree and plain.swap is None
    greedy = Drafters.from_settings(JacobiConfig(recycle=3, guess="lookup", block_size=5), table, sampling=False)
    assert greedy.block[-1] == LookupGuess() and isinstance(greedy.block[1], TableDrafter)
    assert [type(d) for d in greedy.tree] == [PoolDrafter, TableDrafter]
    assert greedy.tree[0].most == 3 and greedy.tree[1].max_width == 5
    sampled = Drafters.from_settings(JacobiConfig(recycle=3), None, sampling=True)
    assert not sampled.tree and sampled.swap.skip_current and sampled.swap.most == 1 and sampled.swap.spare == 0


# ----------------------------------------------------------------------------------------------
# A drafter from outside the engine


SCRIPT = Script(prompt=(2, 3, 4), continuation=tuple(range(40, 72)))


@dataclass(frozen=True)
class Oracle:
    """Knows the script: proposes the greedy continuation (or, `wrong`, garbage)."""

    script: Script
    wrong: bool = False
    source: ClassVar[str] = "table"
    most: ClassVar[int] = 1

    def propose(self, ctx, width):
        done = len(ctx.history) - len(self.script.prompt)
        found = list(self.script.continuation[done : done + width])
        return [[100 + t % 7 for t in found] if self.wrong else found] if found else []


@pytest.mark.parametrize("where", ["block", "tree"])
def test_a_new_drafter_plugs_in_without_touching_the_loop(where):
    oracle = Oracle(SCRIPT)
    if where == "block":
        drafters = Drafters(block=(CarriedDrafts(), oracle, PromptGuess()), ahead=(PromptGuess(),))
    else:
        drafters = Drafters(block=(CarriedDrafts(), PromptGuess()), ahead=(PromptGuess(),), tree=(oracle,))
    model = ScriptedLM(scripted_rule(SCRIPT))
    decoder = BatchDecoder(model, block_size=8, drafters=drafters, recycle_budget=None)
    (row,) = decoder.add(torch.tensor([SCRIPT.prompt]), max_new_tokens=32)
    events = list(decoder.steps())
    out = decoder.finish([row])
    assert out.new_tokens == [list(SCRIPT.continuation)]
    if where == "block":  # the prefill gives token 1; each forward accepts a block's 7 drafts and 1 more
        assert [len(e.new_tokens[row]) for e in events] == [8, 8, 8, 7]
    else:  # a branch may reach past the block: 16 tokens (recycle_width) and 1 more
        assert [len(e.new_tokens[row]) for e in events] == [17, 14]
    assert out.forward_passes == model.calls == 1 + len(events)
    # every token but the prefill's and each forward's own came from the drafter; the last
    # forward makes none of its own (the budget ends with the drafts): 4 x 7, or 16 + 14
    assert out.stats.sources == ({"ar": 4, "table": 28} if where == "block" else {"ar": 2, "table": 30})


@pytest.mark.parametrize("where", ["block", "tree"])
def test_a_wrong_drafter_costs_speed_never_the_output(where):
    model = tiny_model("llama")
    prompt = random_prompt(3, 12)
    wrong = Oracle(Script(prompt=tuple(prompt[0].tolist()), continuation=tuple(range(2, 200))), wrong=True)
    if where == "block":
        drafters = Drafters(block=(CarriedDrafts(), wrong, PromptGuess()), ahead=(PromptGuess(),))
    else:
        drafters = Drafters(block=(CarriedDrafts(), PromptGuess()), ahead=(PromptGuess(),), tree=(wrong,))
    decoder = BatchDecoder(model, block_size=6, drafters=drafters)
    (row,) = decoder.add(prompt, max_new_tokens=40, generator=torch.Generator().manual_seed(0))
    for _ in decoder.steps():
        pass
    greedy = greedy_decode(model, prompt, max_new_tokens=40)
    assert decoder.finish([row]).new_tokens == greedy.new_tokens
    assert jacobi_decode(model, prompt, block_size=6, max_new_tokens=40).new_tokens == greedy.new_tokens


def test_steps_can_stop_early_and_resume():
    model = ScriptedLM(scripted_rule(SCRIPT))
    decoder = BatchDecoder(model, block_size=4)
    (row,) = decoder.add(torch.tensor([SCRIPT.prompt]), max_new_tokens=32, generator=torch.Generator().manual_seed(0))
    for event in decoder.steps():
        assert set(event.new_tokens) == {row}
        if len(decoder.tokens(row)) >= 10:
            break
    assert not decoder.done(row) and decoder.tokens(row) == list(SCRIPT.continuation[: len(decoder.tokens(row))])
    for _ in decoder.steps():
        pass
    assert decoder.finish([row]).new_tokens == [list(SCRIPT.continuation)]


def test_sampling_refuses_tree_drafters():
    with pytest.raises(ValueError, match="tree drafters verify greedily"):
        BatchDecoder(ScriptedLM(scripted_rule(SCRIPT)), temperature=1.0,
                     drafters=Drafters(block=(PromptGuess(),), ahead=(PromptGuess(),), tree=(PoolDrafter(1),)))
