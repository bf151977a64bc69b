"""The forwards the engine decodes on, each behind one protocol (`protocol.Runtime` and its
`Session`): the decoders (`cllm.decoding`) speak only that protocol, and a runtime owns its
cache, its masks and its kernels.

- `transformers` (`hf`): any transformers causal LM through its own forward, the reference;
  rows share one `DynamicCache` whose holes a mask hides (`rows.Batch`);
- `lean` (`lean`): the Llama family (Llama, Mistral, Qwen2, Qwen3) on the engine's own forward
  (`lean.runner`, one decoder layer, kernels chosen per width), over a preallocated,
  slot-addressed cache (`lean.kv.LeanKV`) with the same bookkeeping;
- `llamacpp` (`llamacpp`): a GGUF file on llama.cpp's forward (llama-cpp-python), each row one
  of llama.cpp's sequences; opened from a file (`llamacpp.LlamaCppRuntime`, or
  `cllm.models.load_for_decoding`), not from a torch model. `gguf` writes the files.

`open_runtime(model, "auto" | "transformers" | "lean", ...)` makes one, its options its own
arguments; "auto" takes the lean runtime where it can run the model and says why not where it
cannot (`describe()`). `as_runtime(model)` is what a decoder given a plain model decodes on:
the model's "auto" runtime, made once per model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cllm.core.lazy import lazy_exports
from cllm.runtime.choices import RUNTIME_HELP, RUNTIMES

__all__ = ["RUNTIMES", "RUNTIME_HELP", "Forward", "Runtime", "Session", "as_runtime", "choose", "open_runtime",
           "position_limit"]

# module -> the public names it defines, imported on first use (`cllm.core.lazy`): the constants
# above need no torch, so the command configs that offer them load none
_MODULES = {
    "cllm.runtime.factory": ["as_runtime", "choose", "open_runtime"],
    "cllm.runtime.protocol": ["Forward", "Runtime", "Session", "position_limit"],
}

if TYPE_CHECKING:
    from cllm.runtime.factory import as_runtime, choose, open_runtime
    from cllm.runtime.protocol import Forward, Runtime, Session, position_limit

lazy_exports(__name__, {name: module for module, names in _MODULES.items() for name in names})
