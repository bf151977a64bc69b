"""The on_iteration hook: well-formed events whose fixed points join into greedy's output."""

from itertools import pairwise

import pytest
import torch

from cllm import IterationEvent, greedy_decode, jacobi_decode
from tests.decoding.conftest import left_padded, random_prompt, tiny_model


@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_events_are_well_formed_and_fixed_points_join_into_greedy(block_size):
    model = tiny_model("phi3")
    ids, mask = left_padded([random_prompt(51, 4), random_prompt(52, 8)])
    max_new = 23
    events: list[IterationEvent] = []
    out = jacobi_decode(
        model,
        ids,
        mask,
        block_size=block_size,
        max_new_tokens=max_new,
        on_iteration=events.append,
        generator=[torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)],
    )
    greedy = greedy_decode(model, ids, mask, max_new_tokens=max_new)
    assert out.new_tokens == greedy.new_tokens
    for r in range(2):
        mine = [e for e in events if e.row == r]
        blocks = sorted({e.block_index for e in mine})
        assert blocks == list(range(len(blocks)))
        joined = []
        for b in blocks:
            trajectory = [e for e in mine if e.block_index == b]
            size = len(trajectory[0].state)
            assert size == min(block_size, max_new - b * block_size)
            assert [e.iteration for e in trajectory] == list(range(len(trajectory)))
            assert [e.converged for e in trajectory] == [False] * (len(trajectory) - 1) + [True]
            assert all(len(e.state) == size and 1 <= e.committed <= size for e in trajectory)
            # committed never shrinks, and committed tokens never change
            for before, after in pairwise(trajectory):
                assert after.committed >= before.committed
                assert after.state[: before.committed] == before.state[: before.committed]
            last = trajectory[-1]
            assert last.committed == size
            joined.extend(last.state[: last.committed])
        assert joined == greedy.new_tokens[r]
    # at most n updates per block (iteration 0 is the guess)
    assert max(e.iteration for e in events) <= block_size
