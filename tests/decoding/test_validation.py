"""Bad input raises ValueError with a one-line message, before any forward pass."""

import pytest
import torch

from cllm import greedy_decode, jacobi_decode
from tests.decoding.conftest import MAX_POSITIONS, tiny_model

PROMPT = torch.tensor([[5, 6, 7]])


def _raises_one_line(fn, match: str):
    with pytest.raises(ValueError, match=match) as info:
        fn()
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("decode", [greedy_decode, jacobi_decode])
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(input_ids=torch.zeros(1, 0, dtype=torch.long)), "empty prompt"),
        (
            dict(
                attention_mask=torch.tensor([[1, 1, 1], [0, 0, 0]]),
                input_ids=torch.ones(2, 3, dtype=torch.long),
            ),
            "empty prompt",
        ),
        (dict(attention_mask=torch.ones(1, 4, dtype=torch.long)), "shape"),
        (dict(attention_mask=torch.tensor([[1, 1, 0]])), "left-padded"),
        (dict(max_new_tokens=-1), "max_new_tokens"),
        (dict(max_new_tokens=MAX_POSITIONS), "position limit"),
        (dict(input_ids=torch.tensor([5, 6, 7])), "input_ids"),
    ],
)
def test_bad_input_raises_value_error(decode, kwargs, match):
    args = dict(input_ids=PROMPT, max_new_tokens=4) | kwargs
    _raises_one_line(lambda: decode(tiny_model("llama"), **args), match)


def test_position_limit_of_gpt2_is_n_positions():
    _raises_one_line(
        lambda: jacobi_decode(tiny_model("gpt2"), PROMPT, max_new_tokens=MAX_POSITIONS - 2),
        "position limit",
    )


@pytest.mark.parametrize("block_size", [0, -3])
def test_block_size_below_one_raises(block_size):
    _raises_one_line(
        lambda: jacobi_decode(tiny_model("llama"), PROMPT, block_size=block_size), "block_size"
    )


def test_unknown_guess_raises():
    _raises_one_line(
        lambda: jacobi_decode(tiny_model("llama"), PROMPT, guess="oracle"), "unknown guess"
    )


def test_generator_list_of_wrong_length_raises():
    gens = [torch.Generator(), torch.Generator()]
    _raises_one_line(
        lambda: jacobi_decode(tiny_model("llama"), PROMPT, generator=gens), "generator"
    )
