"""Jacobi decoding equals greedy decoding token for token, on tiny random models of five
architectures (float32): every block size, guess, prompt length, EOS inside a block, a budget
that is not a multiple of the block size, and left-padded batches against rows decoded alone.
"""

import functools

import pytest
import torch

from cllm import greedy_decode, jacobi_decode
from tests.decoding.conftest import assert_same_tokens, left_padded, random_prompt, tiny_model

BLOCK_SIZES = [1, 2, 7, 16, 32]
MAX_NEW = 37  # a multiple of none of the block sizes above 1
PROMPTS = [(11, 3), (12, 9), (13, 1), (14, 20)]  # (seed, length)


@functools.cache
def greedy(
    arch: str, seed: int, length: int, max_new: int = MAX_NEW, eos: int | None = None
) -> list[int]:
    return greedy_decode(
        tiny_model(arch), random_prompt(seed, length), max_new_tokens=max_new, eos_token_id=eos
    ).new_tokens[0]


@pytest.mark.parametrize("guess", ["prompt", "repeat", "random", "lookup"])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_jacobi_equals_greedy(arch, block_size, guess):
    model = tiny_model(arch)
    for seed, length in PROMPTS:
        prompt = random_prompt(seed, length)
        out = jacobi_decode(
            model,
            prompt,
            block_size=block_size,
            max_new_tokens=MAX_NEW,
            guess=guess,
            generator=torch.Generator().manual_seed(seed),
        )
        expected = greedy(arch, seed, length)
        assert_same_tokens(
            model, prompt[0].tolist(), expected, out.new_tokens[0], f"{arch} n={block_size} {guess}"
        )
        # never more forward passes than greedy (which uses one per token)
        assert out.forward_passes <= len(expected)
        if block_size == 1:
            assert out.forward_passes == len(expected)
        assert out.stats.new_tokens == len(expected) == MAX_NEW


def _eos_inside_a_block(tokens: list[int], block_size: int) -> int:
    """Index of a token to declare EOS: its first occurrence, strictly inside a block."""
    for i in range(1, len(tokens)):
        if i % block_size not in (0, block_size - 1) and tokens[i] not in tokens[:i]:
            return i
    raise AssertionError("no usable EOS position")  # pragma: no cover


@pytest.mark.parametrize("block_size", [7, 16])
def test_jacobi_stops_at_eos_inside_a_block(arch, block_size):
    model = tiny_model(arch)
    seed, length = PROMPTS[1]
    full = greedy(arch, seed, length)
    i = _eos_inside_a_block(full, block_size)
    eos = full[i]
    expected = greedy(arch, seed, length, eos=eos)
    assert expected == full[: i + 1]
    events = []
    out = jacobi_decode(
        model,
        random_prompt(seed, length),
        block_size=block_size,
        max_new_tokens=MAX_NEW,
        eos_token_id=eos,
        generator=torch.Generator().manual_seed(0),
        on_iteration=events.append,
    )
    assert_same_tokens(
        model, random_prompt(seed, length)[0].tolist(), expected, out.new_tokens[0], f"{arch} eos"
    )
    last = events[-1]
    assert last.converged and last.committed == i % block_size + 1 < len(last.state)
    assert last.state[last.committed - 1] == eos


@pytest.mark.parametrize("block_size", [2, 7, 16])
def test_left_padded_batch_rows_equal_rows_decoded_alone(arch, block_size):
    model = tiny_model(arch)
    shapes = [(21, 3), (22, 10), (23, 6)]
    ids, mask = left_padded([random_prompt(s, n) for s, n in shapes])
    generators = [torch.Generator().manual_seed(s) for s, _ in shapes]
    batch_greedy = greedy_decode(model, ids, mask, max_new_tokens=MAX_NEW)
    batch_jacobi = jacobi_decode(
        model, ids, mask, block_size=block_size, max_new_tokens=MAX_NEW, generator=generators
    )
    for r, (seed, length) in enumerate(shapes):
        alone = greedy(arch, seed, length)
        prompt = random_prompt(seed, length)[0].tolist()
        assert_same_tokens(
            model, prompt, alone, batch_greedy.new_tokens[r], f"{arch} greedy row {r}"
        )
        assert_same_tokens(
            model, prompt, alone, batch_jacobi.new_tokens[r], f"{arch} n={block_size} row {r}"
        )


def test_batch_stays_exact_when_the_cache_is_compacted_at_every_step(arch, monkeypatch):
    from cllm.decoding import cache

    monkeypatch.setattr(cache, "COMPACT_MIN_WASTE", 1)
    monkeypatch.setattr(cache, "COMPACT_WASTE_FRACTION", 0.0)
    model = tiny_model(arch)
    shapes = [(21, 3), (22, 10), (23, 6)]
    ids, mask = left_padded([random_prompt(s, n) for s, n in shapes])
    out = jacobi_decode(model, ids, mask, block_size=7, max_new_tokens=MAX_NEW, guess="repeat")
    for r, (seed, length) in enumerate(shapes):
        prompt = random_prompt(seed, length)[0].tolist()
        assert_same_tokens(
            model, prompt, greedy(arch, seed, length), out.new_tokens[r], f"{arch} row {r}"
        )


def test_per_row_generators_make_guesses_independent_of_batch_mates():
    model = tiny_model("llama")
    shapes = [(31, 5), (32, 7)]
    ids, mask = left_padded([random_prompt(s, n) for s, n in shapes])

    def states(ids, mask, seeds):
        events = []
        jacobi_decode(
            model,
            ids,
            mask,
            block_size=8,
            max_new_tokens=20,
            on_iteration=events.append,
            generator=[torch.Generator().manual_seed(s) for s in seeds],
        )
        return [(e.block_index, e.iteration, e.state) for e in events if e.row == 0]

    alone = states(random_prompt(*shapes[0]), None, [31])
    in_batch = states(ids, mask, [31, 32])
    assert in_batch == alone
