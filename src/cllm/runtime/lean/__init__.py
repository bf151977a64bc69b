"""The lean runtime: the engine's own forward for the Llama family (`runner.LeanRunner`) over a
preallocated, slot-addressed cache (`kv.LeanKV`), as a `cllm.runtime.protocol.Runtime`.

Its options are its own arguments: `packed` (float32 CPU forwards on oneDNN-packed weights),
`graphs` (CUDA graphs on a GPU), `path` (one float32 CPU layout for every forward, rather than
the one measured fastest at each width), and `compile()` builds the compiled forward
(`compiled.compile_runner`). `prepare()` readies a float32 CPU forward before the first request.
"""

from __future__ import annotations

import torch

from cllm.runtime.lean import compiled
from cllm.runtime.lean.kv import LeanKV
from cllm.runtime.lean.runner import LeanRunner, why_not
from cllm.runtime.protocol import Forward
from cllm.runtime.rows import BatchedSession

__all__ = ["LeanRuntime", "LeanSession", "why_not"]


class LeanRuntime:
    """A Llama-family transformers model on the lean forward (`Runtime`); each session's rows
    share one `LeanKV`. A ValueError names why when the model is not one it runs (`why_not`)."""

    name = "lean"
    offers_hidden = True
    step_costs: tuple[float, ...] | None = None  # measured by `cllm.runtime.stepcost`, when asked
    batch_invariant = True  # float32: a wide forward differs in the last bits at most (near-ties aside)

    def __init__(self, model: torch.nn.Module, *, packed: bool = True, graphs: bool = True, path: str | None = None,
                 why: str = "asked for", weak: bool = False) -> None:
        reason = why_not(model)
        if reason is not None:
            raise ValueError(f"the lean runtime cannot run this model: {reason}")
        # `weak`: the model's own "auto" runtime (`as_runtime`), which must not keep it alive
        self.runner = LeanRunner(model, packed=packed, graphs=graphs, path=path, weak=weak)
        self.vocab_size = int(model.lm_head.weight.shape[0])
        self.position_limit = getattr(model.config, "max_position_embeddings", None)
        self.device = model.lm_head.weight.device
        self.forwards = 0
        self.why = why

    @property
    def model(self) -> torch.nn.Module:
        """The transformers model it runs."""
        return self.runner.model()

    def session(self) -> LeanSession:
        return LeanSession(self)

    def prepare(self) -> None:
        """Ready a float32 CPU forward before the first request (`LeanRunner.prepare`)."""
        self.runner.prepare()

    def compile(self, *, batches: bool = True) -> str | None:
        """Build the compiled forward (`compiled.compile_runner`); None when done, else why not."""
        return compiled.compile_runner(self.runner, batches=batches)

    def describe(self) -> str:
        return f"{self.runner.describe()}: {self.why}"


class LeanSession(BatchedSession):
    """Rows decoding together on a `LeanRuntime`."""

    def __init__(self, runtime: LeanRuntime) -> None:
        super().__init__(runtime)
        self.runner = runtime.runner

    def _prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, hidden: bool,
                 every: bool) -> tuple[LeanKV, Forward]:
        valid = attention_mask.bool()
        position_ids = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)  # (B, T)
        kv = self.runner.new_cache(*input_ids.shape)
        out = self.runner.forward(kv, input_ids, position_ids, None if bool(valid.all()) else valid,
                                  last_only=not every, hidden=hidden)
        return kv, Forward(out.logits, out.hidden)

    def _forward(self, storage: LeanKV, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 mask: torch.Tensor | None, *, hidden: bool) -> Forward:
        out = self.runner.forward(storage, input_ids, position_ids, mask, hidden=hidden)
        return Forward(out.logits, out.hidden)
