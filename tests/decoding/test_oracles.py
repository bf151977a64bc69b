"""Greedy and Jacobi decoding against references that share no code with them, on all five
architectures (float32): a plain argmax loop over full forwards without a cache, and
transformers' own `generate` on a left-padded batch with an EOS that falls inside a block.

`greedy_decode` shares the cache adapter and the prompt preparation with `jacobi_decode`, so
`test_jacobi_exact.py` (Jacobi == greedy) alone could not see a bug in what they share.
"""

import pytest
import torch
from transformers import GenerationConfig

from cllm import greedy_decode, jacobi_decode
from tests.decoding.conftest import assert_same_tokens, left_padded, module_of, random_prompt, tiny_model


@pytest.fixture
def arch(torch_arch):
    """On the torch runtimes only: the oracles run the transformers model itself (its own generate, a no-cache loop)."""
    return torch_arch


MAX_NEW = 37
PROMPTS = [(51, 1), (52, 6), (53, 17)]  # (seed, length)
FAST = {  # the fast paths, each against the same references
    "n7": dict(block_size=7),
    "n16-lookup": dict(block_size=16, guess="lookup"),
    "n5-recycle": dict(block_size=5, recycle=3, guess="repeat"),
    "n4-in-flight": dict(block_size=4, recycle=2, blocks_in_flight=3),
}


@torch.inference_mode()
def argmax_loop(model, prompt: list[int], max_new: int, eos: int | None = None) -> list[int]:
    """Greedy decoding at its plainest: one full forward over the whole sequence per token."""
    ids, new = list(prompt), []
    while len(new) < max_new and (not new or new[-1] != eos):
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
        new.append(int(logits.argmax()))
        ids.append(new[-1])
    return new


def test_greedy_and_jacobi_equal_a_no_cache_argmax_loop(arch):
    model = tiny_model(arch)
    for seed, length in PROMPTS:
        prompt = random_prompt(seed, length)
        expected = argmax_loop(module_of(model), prompt[0].tolist(), MAX_NEW)
        got = {"greedy": greedy_decode(model, prompt, max_new_tokens=MAX_NEW).new_tokens[0]}
        for name, fast in FAST.items():
            out = jacobi_decode(model, prompt, max_new_tokens=MAX_NEW, **fast,
                                generator=torch.Generator().manual_seed(seed))
            got[name] = out.new_tokens[0]
        for name, tokens in got.items():
            what = f"{arch} {name} prompt {seed}"
            assert_same_tokens(model, prompt[0].tolist(), expected, tokens, what)


def _eos_inside_a_block(tokens: list[int], block_size: int) -> int:
    """A token to declare EOS: its first occurrence is strictly inside a block of `block_size`
    and not in the first two tokens (so the row decodes a few tokens before it stops)."""
    return next(t for i, t in enumerate(tokens)
                if i >= 2 and i % block_size not in (0, block_size - 1) and t not in tokens[:i])


@pytest.mark.parametrize("name", ["greedy", *FAST])
def test_a_padded_batch_with_eos_inside_a_block_equals_hf_generate(arch, name):
    model = tiny_model(arch)
    prompts = [random_prompt(s, n) for s, n in PROMPTS]
    ids, mask = left_padded(prompts)
    # EOS: a token row 0 writes inside one of its blocks; the other rows decode past it or stop
    block_size = FAST.get(name, {}).get("block_size", 7)
    eos = _eos_inside_a_block(argmax_loop(module_of(model), prompts[0][0].tolist(), MAX_NEW), block_size)
    config = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, num_beams=1,
                              eos_token_id=eos, pad_token_id=0)
    with torch.inference_mode():
        hf = module_of(model).generate(ids, attention_mask=mask, generation_config=config)
    if name == "greedy":
        out = greedy_decode(model, ids, mask, max_new_tokens=MAX_NEW, eos_token_id=eos)
    else:
        generators = [torch.Generator().manual_seed(s) for s, _ in PROMPTS]
        out = jacobi_decode(model, ids, mask, max_new_tokens=MAX_NEW, eos_token_id=eos,
                            generator=generators, **FAST[name])
    for r, row in enumerate(hf[:, ids.shape[1] :].tolist()):
        expected = row[: row.index(eos) + 1] if eos in row else row  # generate pads after EOS
        assert_same_tokens(model, prompts[r][0].tolist(), expected, out.new_tokens[r],
                           f"{arch} {name} row {r}")
    stop = len(out.new_tokens[0]) - 1  # row 0 stopped at EOS, strictly inside a block
    assert out.new_tokens[0][-1] == eos and stop % block_size not in (0, block_size - 1)
