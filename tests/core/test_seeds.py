"""Seeds: derived ones are the same in every process; a generator takes all 64 bits of a seed."""

import torch

from cllm.core.seeds import derived_seed, seeded_generator


def draws(seed, n: int = 8) -> list[float]:
    return torch.rand(n, generator=seeded_generator(seed)).tolist()


def test_seeds_that_differ_in_any_of_their_64_bits_draw_different_streams():
    seeds = [0, 1, 2**32, 2**32 + 1, 2**63 - 1, -(2**63), -1, 2**33]
    streams = [draws(s) for s in seeds]
    assert len({tuple(s) for s in streams}) == len(seeds)
    assert all(draws(s) == stream for s, stream in zip(seeds, streams))  # and each is reproducible


def test_a_32_bit_seed_draws_torchs_own_stream_and_none_is_zero():
    for seed in (0, 7, 2**32 - 1):
        assert draws(seed) == torch.rand(8, generator=torch.Generator().manual_seed(seed)).tolist()
    assert draws(None) == draws(0)


def test_a_64_bit_generator_samples_and_resets_like_any_other():
    generator = seeded_generator(2**40)
    first = torch.multinomial(torch.ones(50), 5, generator=generator).tolist()
    normal = torch.randn(3, generator=generator).tolist()
    generator = seeded_generator(2**40)
    assert torch.multinomial(torch.ones(50), 5, generator=generator).tolist() == first
    assert torch.randn(3, generator=generator).tolist() == normal


def test_derived_seeds_are_stable_63_bit_ints():
    assert derived_seed(0, "guess", "p1") == derived_seed(0, "guess", "p1") != derived_seed(0, "guess", "p2")
    assert 0 <= derived_seed("x") < 2**63
