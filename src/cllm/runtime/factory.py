"""Making a runtime for a model: `open_runtime` (the one asked for, or "auto"), `choose` (which
one "auto" takes and why) and `as_runtime` (what a decoder given a plain model decodes on)."""

from __future__ import annotations

import weakref

import torch

from cllm.runtime import lean
from cllm.runtime.choices import RUNTIMES
from cllm.runtime.hf import TransformersRuntime
from cllm.runtime.protocol import Runtime

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
