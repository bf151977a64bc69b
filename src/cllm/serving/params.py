"""How to decode one request (`DecodeParams`) and the decoders a request may name (`METHODS`):
plain data, no torch, shared by the command configs, the server's request checking and
`cllm.serving.completion`, which decodes with them."""

from __future__ import annotations

from dataclasses import dataclass

from cllm.decoding.settings import JacobiConfig, is_greedy

METHODS = ("jacobi", "ar")


@dataclass(frozen=True)
class DecodeParams:
    """How to decode one request (validated by the CLI configs and the server)."""

    method: str = "jacobi"  # "jacobi" or "ar" (the Jacobi engine with n = 1)
    engine: JacobiConfig = JacobiConfig()  # Jacobi's settings (block size, recycling, ...)
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()
    temperature: float = 0.0  # > 0: lossless sampling (below sampling.GREEDY_BELOW: greedy, and 0 here)
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None  # seed of the guesses and, when sampling, of the draws (None: 0)
    logprobs: int | None = None  # None: none; k: each token's log-probability and its top k alternatives

    def __post_init__(self) -> None:
        if self.temperature > 0 and is_greedy(self.temperature):  # one greedy setting, one batch group
            object.__setattr__(self, "temperature", 0.0)

    @property
    def label(self) -> str:
        """The decoder used: "jacobi", "ar", "jacobi_sample" or "ar_sample" (logs, metrics)."""
        return f"{self.method}_sample" if self.temperature > 0 else self.method
