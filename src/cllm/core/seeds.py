"""Seeds derived from names: one hash, so a prompt's guesses, an epoch's order or a rollout's
draws are the same in every process and every run, whatever else ran before."""

from __future__ import annotations

import hashlib


def derived_seed(*parts: object) -> int:
    """A 63-bit seed from any parts (the same in every process and every run).

    `derived_seed(seed, prompt_id)` is the seed of one prompt's guess generator in `cllm collect`.
    """
    digest = hashlib.sha256("\0".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
