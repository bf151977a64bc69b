"""cllm: Consistency Large Language Models.

Public API (loaded lazily, so that `import cllm` and `cllm --help` stay fast without torch):

    from cllm import greedy_decode, jacobi_decode, sample_decode, DecodeOutput, RECOMMENDED
    from cllm import JacobiConfig, RECOMMENDED_CONFIG   # the engine's settings, validated once
    from cllm import BatchDecoder   # rows join and leave a running Jacobi batch between steps
    from cllm import speculative_decode   # a draft model proposes, the model verifies (exact)
    from cllm import medusa_decode  # with Medusa heads: cllm.models.load_heads (cllm medusa)
    from cllm import eagle_decode  # with an EAGLE head: cllm.models.load_eagle (cllm eagle)
    from cllm.models import load_for_decoding   # model, tokenizer, draft table, RECOMMENDED
    from cllm.runtime import open_runtime   # a model on the runtime asked for (decoders take either)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from cllm.core import __version__

__all__ = [
    "RECOMMENDED",
    "RECOMMENDED_CONFIG",
    "JacobiConfig",
    "BatchDecoder",
    "DecodeOutput",
    "DecodeStats",
    "IterationEvent",
    "__version__",
    "eagle_decode",
    "greedy_decode",
    "jacobi_decode",
    "medusa_decode",
    "sample_decode",
    "speculative_decode",
]

# public name -> module that defines it
_EXPORTS = {name: "cllm.decoding" for name in __all__ if name != "__version__"}

if TYPE_CHECKING:
    from cllm.decoding import (
        RECOMMENDED,
        RECOMMENDED_CONFIG,
        BatchDecoder,
        DecodeOutput,
        DecodeStats,
        IterationEvent,
        JacobiConfig,
        eagle_decode,
        greedy_decode,
        jacobi_decode,
        medusa_decode,
        sample_decode,
        speculative_decode,
    )


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later look-ups skip this function
        return value
    raise AttributeError(f"module 'cllm' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
