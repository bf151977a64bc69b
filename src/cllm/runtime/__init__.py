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

import weakref

import torch

from cllm.runtime import lean
from cllm.runtime.hf import TransformersRuntime
from cllm.runtime.protocol import Forward, Runtime, Session, position_limit

__all__ = ["RUNTIMES", "RUNTIME_HELP", "Forward", "Runtime", "Session", "as_runtime", "choose", "open_runtime",
           "position_limit"]

RUNTIMES = ("auto", "transformers", "lean", "llamacpp")
RUNTIME_HELP = ("the forward the decoders run on: auto (a .gguf file: llamacpp; else the lean runtime where it runs "
                "the model, the Llama family in float32, bfloat16 or float16; else transformers'), transformers (the "
                "model's own forward), lean, or llamacpp (llama.cpp on a GGUF file, a model folder exported once "
                "into ~/.cache/cllm/gguf; needs cllm[llamacpp])")

_AUTO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {training: its "auto" runtime}


def choose(model: torch.nn.Module, runtime: str = "auto") -> tuple[str, str]:
    """The runtime `open_runtime` makes for `model` when asked for `runtime`, and why."""
    if runtime not in RUNTIMES:
        raise ValueError(f"unknown runtime {runtime!r}; choose one of {', '.join(RUNTIMES)}")
    if runtime == "llamacpp":
        raise ValueError("the llamacpp runtime runs a GGUF file: load it with cllm.models.load_for_decoding "
                         "(a model folder is exported once into the user's cache)")
    if runtime != "auto":
        return runtime, "asked for"
    reason = lean.why_not(model)
    if reason is not None:
        return "transformers", f"auto: the lean runtime cannot run it ({reason})"
    if model.training:
        return "transformers", "auto: the model is in training mode (the lean runtime has no gradients)"
    return "lean", f"auto: a {model.config.model_type} model, which the lean runtime runs"


def open_runtime(model: torch.nn.Module, runtime: str = "auto", *, packed: bool = True, graphs: bool = True,
                 path: str | None = None, weak: bool = False) -> Runtime:
    """`model` (a transformers causal LM) on the runtime `runtime` names ("auto", "transformers",
    "lean"); `packed`, `graphs` and `path` are the lean runtime's options
    (`cllm.runtime.lean.LeanRuntime`). The runtime keeps the model alive (not with `weak`). A
    ValueError says why a runtime cannot run the model."""
    name, why = choose(model, runtime)
    if name == "lean":
        return lean.LeanRuntime(model, packed=packed, graphs=graphs, path=path, why=why, weak=weak)
    return TransformersRuntime(model, why=why, weak=weak)


def as_runtime(model: torch.nn.Module | Runtime) -> Runtime:
    """A runtime as it is; a model as its "auto" runtime, made once per model (and per training
    mode: a model switched to training decodes on transformers' forward)."""
    if not isinstance(model, torch.nn.Module):
        if not hasattr(model, "session"):
            raise TypeError(f"decoders run on a transformers model or a cllm runtime, not {type(model).__name__}")
        return model
    made = _AUTO.setdefault(model, {})
    if model.training not in made:
        made[model.training] = open_runtime(model, weak=True)
    return made[model.training]
