"""llama.cpp in `cllm bench`, through llama-cpp-python: the model exported to GGUF by our own
exporter (`cllm.runtime.gguf`), decoded greedily with the same prompts, token cap and EOS.

Methods (`cllm.bench.config.LLAMACPP_METHODS`): `llamacpp_jacobi` and `cllm_llamacpp_jacobi`,
our engine (the setting of `target_lookahead` / `cllm_jacobi`) on the llama.cpp runtime
(`cllm.runtime.llamacpp`), exact against llama.cpp's own greedy decoding of the same file;
`llamacpp_ar` (llama.cpp's greedy decoding) and
`llamacpp_lookup` (llama-cpp-python's prompt lookup, `LlamaPromptLookupDecoding`: up to --llamacpp-lookup-tokens
tokens copied from the last matching 2-gram, or 1-gram, of the prompt and output, verified in one
llama.cpp call), on the target; `cllm_llamacpp_ar` and `cllm_llamacpp_lookup` on the CLLM. Each
is exact-checked against the greedy output of the same model in transformers (`target_ar`,
`cllm_ar`). A GGUF target (or CLLM) is decoded as given, not exported (`file_decoders`), and
llama.cpp's greedy decoding of it is the reference (`cllm.bench.config.GGUF_REFERENCES`).

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

import tempfile
from dataclasses import dataclass
from importlib.metadata import version as installed_version
from itertools import pairwise
from pathlib import Path

import torch

from cllm.bench.config import LLAMACPP_METHODS, BenchConfig
from cllm.core.errors import UserError, first_line
from cllm.core.progress import Progress
from cllm.decoding.inputs import position_limit
from cllm.models import fingerprint, tokenizer_fingerprint
from cllm.models.gguf import cached_gguf
from cllm.profiling.steptime import parameter_count, random_model, shape_config, time_steps
from cllm.runtime import llamacpp as llamacpp_module
from cllm.runtime.gguf import OUT_TYPE_OF_DTYPE, import_gguf, write_gguf
from cllm.runtime.llamacpp import LlamaCppRuntime
from cllm.runtime.llamacpp_files import quantize

# method -> (role of the model it decodes, prompt-lookup drafting)
METHOD_MODELS = {"llamacpp_ar": ("target", False), "llamacpp_lookup": ("target", True),
                    "cllm_llamacpp_ar": ("cllm", False), "cllm_llamacpp_lookup": ("cllm", True)}
MAX_CONTEXT = 4096  # llama.cpp context of a bench decoder (the model's own when shorter)
# method -> (role, decoder): our engine on the llama.cpp runtime (methods.py builds them)
ENGINE_METHODS = {"llamacpp_jacobi": "target", "cllm_llamacpp_jacobi": "cllm"}


def unavailable() -> str | None:
    """Why the llamacpp methods cannot run here, in one line; None when they can."""
    reason = llamacpp_module.unavailable()
    if reason is None:
        try:
            import_gguf()
        except UserError as exc:
            reason = str(exc)
    return f"no llamacpp_* methods: {reason}" if reason else None


def skipped_note(methods: list[str]) -> list[str]:
    """The run's note when llamacpp methods would run (asked for, or all methods) but cannot."""
    reason = unavailable() if set(methods or LLAMACPP_METHODS) & set(LLAMACPP_METHODS) else None
    return [reason] if reason else []


def bench_gguf(model: torch.nn.Module, tokenizer, folder: str | None, out_type: str) -> Path:
    """The model's GGUF export in `folder` (None: the user's cache), made once per model."""
    path, _ = cached_gguf(model, tokenizer, out_type, folder, model_fingerprint=fingerprint(model),
                          tokenizer_fingerprint=tokenizer_fingerprint(tokenizer))
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


def llamacpp_runtime(config: BenchConfig, model: torch.nn.Module, tokenizer) -> LlamaCppRuntime:
    """The model's GGUF export on the llama.cpp runtime, at the bench's threads (--runtime
    llamacpp); a ValueError says why it cannot be."""
    reason = unavailable()
    if reason is not None:
        raise ValueError(reason.removeprefix("no llamacpp_* methods: "))
    out_type = OUT_TYPE_OF_DTYPE.get(config.dtype)
    if out_type is None:
        raise ValueError(f"no GGUF type for --dtype {config.dtype}")
    return LlamaCppRuntime(bench_gguf(model, tokenizer, config.gguf_dir, out_type), threads=config.threads,
                           f32_cache=out_type == "f32")


def llamacpp_decoders(config: BenchConfig, models: dict[str, torch.nn.Module | None], tokenizer,
                      wanted: list[str]) -> dict[str, tuple[str, LlamaCppDecoder | LlamaCppRuntime]]:
    """method -> (role, what decodes it) for the llamacpp methods `wanted` (none named: all) whose
    model is given: llama-cpp-python's decoder (`LlamaCppDecoder`) for llama.cpp's own methods, the
    llama.cpp runtime for our engine's (`ENGINE_METHODS`); {} when llama-cpp-python is not usable
    (`unavailable` says why). Every method of a role reads the same GGUF export."""
    roles = {**{m: role for m, (role, _) in METHOD_MODELS.items()}, **ENGINE_METHODS}
    names = [m for m in roles if (not wanted or m in wanted) and models.get(roles[m]) is not None]
    if not names or unavailable() is not None:
        return {}
    out_type = OUT_TYPE_OF_DTYPE.get(config.dtype)
    if out_type is None:
        raise UserError(f"the llamacpp methods have no GGUF type for --dtype {config.dtype}")
    files, decoders = {}, {}
    for name in names:
        role = roles[name]
        model = models[role]
        if role not in files:
            files[role] = bench_gguf(model, tokenizer, config.gguf_dir, out_type)
        if name in ENGINE_METHODS:
            decoders[name] = role, LlamaCppRuntime(files[role], threads=config.threads, f32_cache=out_type == "f32")
            continue
        lookup = config.llamacpp_lookup_tokens if METHOD_MODELS[name][1] else 0
        decoders[name] = role, LlamaCppDecoder(
            files[role], threads=config.threads, context=decoder_context(model, lookup),
            max_new_tokens=config.max_new_tokens, eos=tokenizer.eos_token_id, lookup=lookup,
            f32_cache=out_type == "f32")
    return decoders


def decoder_context(model, lookup: int) -> int:
    """llama.cpp's context of a decoder of `model` (its positions, at most `MAX_CONTEXT`), plus
    room for the `lookup` tokens a call drafts past the last token kept: llama-cpp-python feeds
    them whole, and a prompt cut to leave the new tokens just room would overflow it."""
    return min(position_limit(model) or MAX_CONTEXT, MAX_CONTEXT) + (lookup + 1 if lookup else 0)


def file_decoders(config: BenchConfig, runtimes: dict[str, LlamaCppRuntime], tokenizer,
                  wanted: list[str]) -> dict[str, tuple[str, LlamaCppDecoder]]:
    """method -> (role, decoder) for llama.cpp's own methods (`METHOD_MODELS`) `wanted` (none
    named: all) on GGUF files as given, no export: role -> the llama.cpp runtime open on its
    file, whose KV cache type the decoder takes (llama.cpp's greedy decoding of the file is then
    our greedy decoding's on the runtime)."""
    decoders = {}
    for name, (role, lookup) in METHOD_MODELS.items():
        runtime = runtimes.get(role)
        if runtime is None or (wanted and name not in wanted):
            continue
        drafted = config.llamacpp_lookup_tokens if lookup else 0
        decoders[name] = role, LlamaCppDecoder(
            runtime.path, threads=config.threads, context=decoder_context(runtime, drafted),
            max_new_tokens=config.max_new_tokens, eos=tokenizer.eos_token_id, lookup=drafted,
            f32_cache=runtime.f32_cache)
    return decoders


SHAPE_CONTEXT = 2048  # KV cells of the runtime a shape's forward is timed on


def shape_costs(config: BenchConfig, tokenizer, prefix: int, progress: Progress) -> dict[str, dict]:
    """--forward-shapes: per shape, a random Llama of it exported to GGUF with `tokenizer`
    (its ids; the rest of the vocabulary padded), quantized to --forward-quantize by llama.cpp,
    and llama.cpp's milliseconds of one causal forward of each --forward-tokens after `prefix`
    cached tokens (one row, the min over --repeats rounds). The files live in a temporary
    folder (under --gguf-dir when given) while timed."""
    if not config.forward_shapes:
        return {}
    reason = unavailable()
    if reason is not None:
        raise UserError(f"--forward-shapes: {reason.removeprefix('no llamacpp_* methods: ')}")
    out = {}
    with progress.stage("llama.cpp on model shapes", len(config.forward_shapes),
                        detail=f"{', '.join(config.forward_shapes)}, {config.forward_quantize}, "
                               f"k = {config.forward_tokens}") as stage:
        for shape in config.forward_shapes:
            shape_cfg = shape_config(shape)
            with tempfile.TemporaryDirectory(prefix="cllm-shape-", dir=config.gguf_dir) as folder:
                try:
                    path = write_gguf(random_model(shape_cfg, torch.float32, torch.device("cpu")), tokenizer,
                                      Path(folder) / "f32.gguf").path
                    if config.forward_quantize != "f32":
                        quantize(path, Path(folder) / "q.gguf", config.forward_quantize, threads=config.threads)
                        path.unlink()
                        path = Path(folder) / "q.gguf"
                    runtime = LlamaCppRuntime(path, threads=config.threads, context=SHAPE_CONTEXT)
                except ValueError as exc:
                    raise UserError(f"--forward-shapes {shape}: {first_line(exc)}") from None
                times = time_steps(runtime, config.forward_tokens, prefix=prefix, rounds=config.repeats, tree=False,
                                   seed=config.seed)
                del runtime
            out[shape] = {"parameters": parameter_count(shape_cfg), "weights": config.forward_quantize,
                          "ms": {str(k): round(1e3 * min(v), 3) for k, v in times.causal.items()}}
            stage.advance()
            stage.note(f"{shape}: " + ", ".join(f"k = {k}: {ms:.1f} ms" for k, ms in out[shape]["ms"].items()))
    return out


def project(costs: dict[str, dict], metrics: dict[str, dict]) -> None:
    """Adds to each shape's costs the speed the llamacpp Jacobi methods measured in this run
    would give at that size, a projection: their tokens per forward, at the step cost of their
    mean fed tokens (interpolated between the timed ones), over greedy's one-token forward.
    Nothing is projected beyond the timed fed tokens, or without a one-token forward."""
    for cost in costs.values():
        ms = {int(k): v for k, v in cost["ms"].items()}
        cost["projection"] = {}
        for name in ENGINE_METHODS:
            m = metrics.get(name)
            if m is None or 1 not in ms or not m.get("tokens_per_forward") or not m.get("mean_fed_tokens"):
                continue
            fed = m["mean_fed_tokens"]
            step = _interpolate(ms, fed)
            if step is not None:
                tpf = m["tokens_per_forward"]
                cost["projection"][name] = dict(tokens_per_forward=tpf, mean_fed_tokens=fed, ms_per_step=round(step, 3),
                                                speedup_vs_greedy=round(tpf * ms[1] / step, 3))


def _interpolate(ms: dict[int, float], k: float) -> float | None:
    """ms at `k` fed tokens, linear between the timed points; None outside them."""
    points = sorted(ms.items())
    for (k0, t0), (k1, t1) in pairwise(points):
        if k0 <= k <= k1:
            return t0 + (t1 - t0) * (k - k0) / (k1 - k0)
    return points[0][1] if points and k == points[0][0] else None
