"""Multi-block decoding (drafts of the next blocks in flight behind the current one), alone and
with n-gram recycling: the output is greedy's, token for token."""

import pytest
import torch

from cllm import greedy_decode, jacobi_decode
from tests.decoding.conftest import left_padded, tiny_model
from tests.decoding.scripted import Script, ScriptedLM, scripted_rule


@pytest.mark.parametrize("recycle", [0, 2])
@pytest.mark.parametrize("blocks", [2, 3])
@pytest.mark.parametrize("block_size", [1, 4, 7, 16])
def test_multiblock_equals_greedy(arch, block_size, blocks, recycle):
    model = tiny_model(arch)
    for seed, length in [(31, 3), (32, 12)]:
        prompt = torch.randint(2, 64, (1, length), generator=torch.Generator().manual_seed(seed)).repeat(1, 2)
        expected = greedy_decode(model, prompt, max_new_tokens=37).new_tokens
        out = jacobi_decode(model, prompt, block_size=block_size, max_new_tokens=37, blocks_in_flight=blocks,
                            recycle=recycle, generator=torch.Generator().manual_seed(seed))
        assert out.new_tokens == expected, (arch, block_size, blocks, recycle, seed)
        assert out.forward_passes <= 37


def test_multiblock_in_a_padded_batch_with_eos_equals_greedy(arch):
    model = tiny_model(arch)
    prompts = [torch.randint(2, 64, (1, n), generator=torch.Generator().manual_seed(n)) for n in (3, 9, 5)]
    ids, mask = left_padded(prompts)
    full = greedy_decode(model, ids, mask, max_new_tokens=30).new_tokens
    eos = full[0][13]
    expected = greedy_decode(model, ids, mask, max_new_tokens=30, eos_token_id=eos).new_tokens
    for recycle in (0, 2):
        out = jacobi_decode(model, ids, mask, block_size=5, max_new_tokens=30, eos_token_id=eos,
                            blocks_in_flight=2, recycle=recycle, generator=torch.Generator().manual_seed(0))
        assert out.new_tokens == expected


ROBUST = Script(prompt=(2, 3), continuation=tuple(range(10, 34)), robust=frozenset(range(24)))


def test_tokens_become_final_across_the_block_boundary():
    """A model right after any context: one block at a time needs a forward per block (plus the
    prefill); with a second block in flight, one forward accepts both blocks' tails."""
    one = jacobi_decode(ScriptedLM(scripted_rule(ROBUST)), torch.tensor([ROBUST.prompt]), block_size=4,
                        max_new_tokens=24, guess="repeat")
    two = jacobi_decode(ScriptedLM(scripted_rule(ROBUST)), torch.tensor([ROBUST.prompt]), block_size=4,
                        max_new_tokens=24, guess="repeat", blocks_in_flight=3)
    assert one.new_tokens == two.new_tokens == [list(ROBUST.continuation)]
    assert two.forward_passes < one.forward_passes


def test_multiblock_refuses_sampling():
    with pytest.raises(ValueError, match="greedy"):
        jacobi_decode(tiny_model("llama"), torch.tensor([[5, 6]]), temperature=1.0, blocks_in_flight=2)
    with pytest.raises(ValueError, match="blocks_in_flight"):
        jacobi_decode(tiny_model("llama"), torch.tensor([[5, 6]]), blocks_in_flight=0)
