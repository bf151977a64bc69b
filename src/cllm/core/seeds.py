"""Seeds derived from names: one hash, so a prompt's guesses, an epoch's order or a rollout's
draws are the same in every process and every run, whatever else ran before; and generators
seeded with all 64 bits of a seed."""

from __future__ import annotations

import functools
import hashlib

import numpy as np
import torch


def derived_seed(*parts: object) -> int:
    """A 63-bit seed from any parts (the same in every process and every run).

    `derived_seed(seed, prompt_id)` is the seed of one prompt's guess generator in `cllm collect`.
    """
    digest = hashlib.sha256("\0".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def seeded_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator:
    """A torch generator on `device` whose stream depends on all 64 bits of `seed` (None: 0;
    taken modulo 2^64, so -1 and 2^64 - 1 are one seed).

    A CUDA generator (Philox) takes a 64-bit seed as it is. torch's CPU generator, a Mersenne
    twister, keeps only the low 32 bits of `manual_seed`'s seed, so seeds 0 and 2^32 would draw
    one stream: a seed below 2^32 seeds it as `manual_seed` does (the same stream as
    `torch.Generator().manual_seed(seed)`), and for any other its 624 state words are filled
    from the whole seed by numpy's `SeedSequence`, which gives distinct seeds independent
    streams."""
    key = (seed or 0) % 2**64
    generator = torch.Generator(device=device)
    if generator.device.type != "cpu" or key < 2**32:
        return generator.manual_seed(key)
    generator.manual_seed(key & 0xFFFFFFFF)  # resets the draw position and the cached normal
    state = generator.get_state()
    words = np.random.SeedSequence(key).generate_state(_MT_WORDS, np.uint32).astype("<u8")
    at = _mt_state_offset()
    state[at : at + words.nbytes] = torch.from_numpy(words.view(np.uint8).copy())
    return generator.set_state(state)


_MT_WORDS = 624  # the Mersenne twister's state: 624 32-bit words


@functools.cache
def _mt_state_offset() -> int:
    """Where torch's CPU generator state (a byte tensor) holds the twister's words: found by
    seeding one with 5489, whose words are the twister's standard initialisation, each stored
    in 8 bytes."""
    words = [5489]
    for i in range(1, _MT_WORDS):
        words.append((1812433253 * (words[-1] ^ (words[-1] >> 30)) + i) & 0xFFFFFFFF)
    needle = np.array(words, dtype="<u8").tobytes()
    state = torch.Generator().manual_seed(5489).get_state().numpy().tobytes()
    at = state.find(needle)
    if at < 0 or state.count(needle) != 1:
        raise RuntimeError(f"torch {torch.__version__}'s CPU generator state has a layout cllm does not know")
    return at
