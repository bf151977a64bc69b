"""Decoding engines: greedy autoregressive (the oracle), Jacobi with fast-forward commit (greedy,
or lossless sampling), speculative decoding with a draft model (greedy, or lossless sampling),
Medusa and EAGLE tree verification (greedy), and plain autoregressive sampling.

Token ids in, token ids out: nothing here knows about tokenizers, and nothing here runs a model
or touches a cache: every decoder runs on a runtime's session (`cllm.runtime`), given one or a
model (decoded on its "auto" runtime).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cllm.core.lazy import lazy_exports

__all__ = [
    "RECOMMENDED",
    "RECOMMENDED_CONFIG",
    "BatchDecoder",
    "DecodeOutput",
    "DecodeStats",
    "IterationEvent",
    "JacobiConfig",
    "eagle_decode",
    "greedy_decode",
    "jacobi_decode",
    "medusa_decode",
    "sample_decode",
    "speculative_decode",
]

# module -> the public names it defines, imported on first use (`cllm.core.lazy`)
_MODULES = {
    "cllm.decoding.autoregressive": ["greedy_decode"],
    "cllm.decoding.jacobi": ["BatchDecoder", "IterationEvent", "jacobi_decode"],
    "cllm.decoding.rivals.eagle": ["eagle_decode"],
    "cllm.decoding.rivals.medusa": ["medusa_decode"],
    "cllm.decoding.rivals.speculative": ["speculative_decode"],
    "cllm.decoding.sampling": ["sample_decode"],
    "cllm.decoding.settings": ["RECOMMENDED", "RECOMMENDED_CONFIG", "JacobiConfig"],
    "cllm.decoding.stats": ["DecodeOutput", "DecodeStats"],
}

if TYPE_CHECKING:
    from cllm.decoding.autoregressive import greedy_decode
    from cllm.decoding.jacobi import BatchDecoder, IterationEvent, jacobi_decode
    from cllm.decoding.rivals.eagle import eagle_decode
    from cllm.decoding.rivals.medusa import medusa_decode
    from cllm.decoding.rivals.speculative import speculative_decode
    from cllm.decoding.sampling import sample_decode
    from cllm.decoding.settings import RECOMMENDED, RECOMMENDED_CONFIG, JacobiConfig
    from cllm.decoding.stats import DecodeOutput, DecodeStats

lazy_exports(__name__, {name: module for module, names in _MODULES.items() for name in names})
