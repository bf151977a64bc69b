"""llama.cpp in `cllm bench`, through llama-cpp-python: the model exported to GGUF by our own
exporter (`cllm.serving.gguf`), decoded greedily with the same prompts, token cap and EOS.

Methods (`cllm.bench.config.LLAMACPP_METHODS`): `llamacpp_ar` (llama.cpp's greedy decoding) and
`llamacpp_lookup` (llama-cpp-python's prompt lookup, `LlamaPromptLookupDecoding`: up to --llamacpp-lookup-tokens
tokens copied from the last matching 2-gram, or 1-gram, of the prompt and output, verified in one
llama.cpp call), on the target; `cllm_llamacpp_ar` and `cllm_llamacpp_lookup` on the CLLM. Each
is exact-checked against the greedy output of the same model in transformers (`target_ar`,
`cllm_ar`).

Counting: a forward pass is one `Llama.eval` call (one `llama_decode` over the tokens it feeds:
the whole prompt, as n_batch holds it, then one token, or one token and its drafts, per call);
`CountingLlama` notes how many tokens the decode had produced when each call began, which gives
the tokens each call made final. llama-cpp-python decodes one sequence at a time: the bench
measures single requests, one after another, and these methods have no batched form.

The GGUF files go to --gguf-dir (default: the user's cache, `~/.cache/cllm/gguf`), named by the
model's and tokenizer's fingerprints and the weight type, and are reused while they match.
Weights f32 (the bench's default --dtype float32) decode with an f32 KV cache: llama.cpp's
default f16 cache would round what transformers keeps in f32.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as installed_version
from itertools import pairwise
from pathlib import Path

import torch
from packaging.version import Version

from cllm.bench.config import LLAMACPP_METHODS, BenchConfig
from cllm.core.errors import UserError
from cllm.decoding.inputs import position_limit
from cllm.models import fingerprint, tokenizer_fingerprint
from cllm.serving.gguf import OUT_TYPE_OF_DTYPE, import_gguf, read_source, write_gguf

# method -> (role of the model it decodes, prompt-lookup drafting)
METHOD_MODELS = {"llamacpp_ar": ("target", False), "llamacpp_lookup": ("target", True),
                    "cllm_llamacpp_ar": ("cllm", False), "cllm_llamacpp_lookup": ("cllm", True)}
LLAMA_CPP_RANGE = ("0.3.36", "0.4")  # the generate / eval / draft_model protocol relied on below
INSTALL = "pip install 'cllm[llamacpp]'"
MAX_CONTEXT = 4096  # llama.cpp context of a bench decoder (the model's own when shorter)


def unavailable() -> str | None:
    """Why the llamacpp methods cannot run here, in one line; None when they can."""
    try:
        version = installed_version("llama-cpp-python")
        import llama_cpp  # noqa: F401 - a build whose library fails to load is unavailable too
    except (ImportError, PackageNotFoundError, OSError) as exc:
        return f"no llamacpp_* methods: llama-cpp-python is not usable here ({type(exc).__name__}; {INSTALL})"
    low, high = LLAMA_CPP_RANGE
    if not Version(low) <= Version(version) < Version(high):
        return f"no llamacpp_* methods: llama-cpp-python {version} is outside the tested range >= {low}, < {high}"
    try:
        import_gguf()
    except UserError as exc:
        return f"no llamacpp_* methods: {exc}"
    return None


def skipped_note(methods: list[str]) -> list[str]:
    """The run's note when llamacpp methods would run (asked for, or all methods) but cannot."""
    reason = unavailable() if set(methods or LLAMACPP_METHODS) & set(LLAMACPP_METHODS) else None
    return [reason] if reason else []


def cache_dir(gguf_dir: str | None) -> Path:
    """--gguf-dir, or the user's cache folder for GGUF exports."""
    if gguf_dir:
        return Path(gguf_dir).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cllm" / "gguf"


def bench_gguf(model: torch.nn.Module, tokenizer, folder: Path, out_type: str) -> Path:
    """The model's GGUF export in `folder`: reused when its recorded source matches the model's
    and tokenizer's fingerprints, else (re)written."""
    source = {"fingerprint": fingerprint(model), "tokenizer": tokenizer_fingerprint(tokenizer)}
    path = folder / f"{source['fingerprint']}-{source['tokenizer']}-{out_type}.gguf"
    recorded = read_source(path) if path.is_file() else None
    if recorded is None or any(recorded.get(k) != v for k, v in source.items()):
        folder.mkdir(parents=True, exist_ok=True)
        write_gguf(model, tokenizer, path, out_type=out_type, name="bench", source=source)
    return path


@dataclass
class LlamaCppOutput:
    tokens: list[int]  # new tokens, EOS included when produced
    forward_passes: int  # Llama.eval calls, the prompt's included
    accepted: list[int]  # per call: tokens it made final


def _counting_llama(**kwargs):
    """A `llama_cpp.Llama` whose `eval` notes, at every call, how many tokens the decode had
    produced (its `produced`, set by the caller after every token)."""
    import llama_cpp

    class CountingLlama(llama_cpp.Llama):
        produced: int = 0
        marks: list[int] = []

        def eval(self, tokens):
            self.marks.append(self.produced)
            super().eval(tokens)

    return CountingLlama(**kwargs)


class LlamaCppDecoder:
    """One GGUF model in llama.cpp, decoding greedily; `lookup` > 0: with prompt lookup drafting
    up to that many tokens per call. `reset()` (the bench's counter protocol) is a no-op: every
    decode starts from an empty context and its own counts."""

    def __init__(self, path: Path, *, threads: int, context: int, max_new_tokens: int, eos: int | None,
                 lookup: int = 0, f32_cache: bool = True) -> None:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.context, self.max_new_tokens, self.eos = context, max_new_tokens, eos
        # what the report says ran: the binding's version, the file, the drafting
        self.engine = (f"llama-cpp-python {installed_version('llama-cpp-python')} on {path.name}"
                       + (f", prompt lookup of up to {lookup} tokens" if lookup else ", greedy"))
        cache_type = llama_cpp.GGML_TYPE_F32 if f32_cache else llama_cpp.GGML_TYPE_F16
        draft = LlamaPromptLookupDecoding(max_ngram_size=2, num_pred_tokens=lookup) if lookup else None
        self.llm = _counting_llama(model_path=str(path), n_ctx=context, n_batch=context, n_ubatch=context,
                                   n_threads=threads, n_threads_batch=threads, n_gpu_layers=0, seed=0,
                                   type_k=cache_type, type_v=cache_type, draft_model=draft, verbose=False)

    def reset(self) -> None:
        pass

    def tokenize(self, text: str) -> list[int]:
        """llama.cpp's token ids of `text`, as the model's tokenizer would give them (special
        tokens parsed, BOS as the GGUF says)."""
        return self.llm.tokenize(text.encode("utf-8"), add_bos=self.llm.metadata.get(
            "tokenizer.ggml.add_bos_token") == "true", special=True)

    def __call__(self, prompt: list[int]) -> LlamaCppOutput:
        """Greedy tokens after `prompt` until EOS (kept) or max_new_tokens."""
        if len(prompt) + self.max_new_tokens > self.context:
            raise UserError(f"a prompt of {len(prompt)} tokens and {self.max_new_tokens} new ones exceed the "
                            f"llama.cpp context of {self.context}")
        llm, tokens = self.llm, []
        llm.reset()  # no reuse of the previous decode's cache: the prompt is fed whole, as ours is
        llm.marks, llm.produced = [], 0
        steps = llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True)
        try:
            for token in steps:
                tokens.append(int(token))
                llm.produced = len(tokens)
                if token == self.eos or len(tokens) >= self.max_new_tokens:
                    break
        finally:
            steps.close()
        accepted = [b - a for a, b in pairwise([*llm.marks, len(tokens)])]
        return LlamaCppOutput(tokens, len(llm.marks), accepted)


def llamacpp_decoders(config: BenchConfig, models: dict[str, torch.nn.Module | None], tokenizer,
                      wanted: list[str]) -> dict[str, tuple[str, LlamaCppDecoder]]:
    """method -> (role, decoder) for the llamacpp methods `wanted` (none named: all) whose model is
    given; {} when llama-cpp-python is not usable (`unavailable` says why)."""
    names = [m for m in METHOD_MODELS if (not wanted or m in wanted) and models.get(METHOD_MODELS[m][0]) is not None]
    if not names or unavailable() is not None:
        return {}
    out_type = OUT_TYPE_OF_DTYPE.get(config.dtype)
    if out_type is None:
        raise UserError(f"the llamacpp methods have no GGUF type for --dtype {config.dtype}")
    folder, files, decoders = cache_dir(config.gguf_dir), {}, {}
    for name in names:
        role, lookup = METHOD_MODELS[name]
        model = models[role]
        if role not in files:
            files[role] = bench_gguf(model, tokenizer, folder, out_type)
        context = min(position_limit(model) or MAX_CONTEXT, MAX_CONTEXT)
        decoders[name] = role, LlamaCppDecoder(
            files[role], threads=config.threads, context=context, max_new_tokens=config.max_new_tokens,
            eos=tokenizer.eos_token_id, lookup=config.llamacpp_lookup_tokens if lookup else 0,
            f32_cache=out_type == "f32")
    return decoders
