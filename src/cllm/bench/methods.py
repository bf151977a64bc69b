"""The methods `cllm bench` measures, each one adapter that decodes a prompt and counts.

A `Method` holds a name, the model whose greedy output is its own AR, and `run(prompt) ->
Decoded`: the new tokens, the forward passes (docs/method.md#counting: every model call, prefill
included) and the tokens each forward made final. Our decoders run on a role's runtime and count
their own forwards, which `ForwardCounter` checks against the runtime's count; for transformers'
`generate` (plain, prompt lookup, assisted) its forward pre-hook is the only count, and the cache
length each call starts from says how many tokens it made final. The adapters: `engine_decoder`
(our greedy, Jacobi and sampling decoders), `hf_generate`, `speculative`, `medusa` (Medusa-1 and
-2), `eagle`; `build_methods` makes those a run asks for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise

import torch
from transformers import GenerationConfig

from cllm.bench.config import DRAFT_METHODS, GGUF_METHODS, METHODS, BenchConfig
from cllm.bench.llamacpp import file_decoders, llamacpp_decoders
from cllm.bench.models import BenchModels
from cllm.core.errors import UserError
from cllm.core.seeds import derived_seed
from cllm.data.prompts import Prompt
from cllm.decoding import DecodeStats, eagle_decode, greedy_decode, jacobi_decode, medusa_decode, speculative_decode
from cllm.decoding.draft_table import DraftTable
from cllm.models import pad_token_id
from cllm.runtime import Runtime, as_runtime
from cllm.runtime.llamacpp import LlamaCppRuntime


class ForwardCounter:
    """One role's forwards, counted where they happen, since a reset.

    `runtime` is what our decoders run on (by default the model's "auto" runtime), and its own
    count (`Runtime.forwards`: every session open and feed) checks theirs (`check`). A forward
    pre-hook on `model` sees every call of the transformers model with the cache length it starts
    at: transformers' `generate` (plain, prompt lookup, assisted) is counted only so (`calls`).
    With a cache cropped to the accepted tokens before the next call, a call starting at cache
    length s means the sequence was s + 1 tokens long, so consecutive starts say how many tokens
    each call made final (`accepted`). A GGUF's runtime has no transformers model (`model` None):
    its own count is the only one.
    """

    def __init__(self, model: torch.nn.Module | None, runtime: Runtime | None = None) -> None:
        self.model = model
        self.runtime = runtime if runtime is not None else as_runtime(model)
        self.starts: list[int] = []
        self._since = self.runtime.forwards
        self._handle = model.register_forward_pre_hook(self._hook, with_kwargs=True) if model is not None else None

    def _hook(self, module, args, kwargs) -> None:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        self.starts.append(int(cache.get_seq_length()) if cache is not None else 0)

    def reset(self) -> None:
        self.starts = []
        self._since = self.runtime.forwards

    @property
    def calls(self) -> int:
        """Calls of the transformers model."""
        return len(self.starts)

    @property
    def runtime_forwards(self) -> int:
        """Forwards of the runtime."""
        return self.runtime.forwards - self._since

    def check(self, counted: int) -> None:
        """A decoder's own forward count must be its runtime's; on transformers' runtime, also the
        model's calls (else one of them misses forwards)."""
        seen = {"runtime": self.runtime_forwards, **({"hook": self.calls} if self.runtime.name == "transformers"
                                                      else {})}
        if any(n != counted for n in seen.values()):
            raise RuntimeError(f"forward count mismatch: decoder {counted}, "
                               + ", ".join(f"{k} {n}" for k, n in seen.items()))

    def accepted(self, prompt_len: int, new_tokens: int) -> list[int] | None:
        """Tokens made final per call; None if the calls do not read as one growing sequence."""
        if not self.starts:
            return None
        known = [prompt_len, *(s + 1 for s in self.starts[1:]), prompt_len + new_tokens]
        made = [b - a for a, b in pairwise(known)]
        return made if all(m >= 0 for m in made) and sum(made) == new_tokens else None

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()


@dataclass
class Decoded:
    tokens: list[int]  # new tokens, EOS included when produced
    forward_passes: int  # model calls (the verifying model's, for the draft methods)
    accepted: list[int] | None  # per forward: tokens it made final
    stats: DecodeStats | None = None  # our engine's counters (Jacobi: fast-forward, stationary)
    draft_forward_passes: int = 0


@dataclass
class Method:
    name: str
    model: torch.nn.Module | Runtime  # whose greedy output is this method's own AR (a GGUF: its runtime)
    run: Callable[[Prompt], Decoded]
    counters: list[ForwardCounter]  # reset before every decode
    # what the method keeps in memory beyond its model: a draft model, heads, a draft table
    added: dict[str, float] = field(default_factory=lambda: added_memory())


def added_memory(module: torch.nn.Module | None = None, table: DraftTable | None = None) -> dict[str, float]:
    """`added_parameters` (a draft model's or heads') and `added_mb`: their weights at their
    dtype, plus a draft table's entries as stored (int32 context and next token)."""
    weights = list(module.parameters()) if module is not None else []
    params, size = sum(p.numel() for p in weights), sum(p.numel() * p.element_size() for p in weights)
    if table is not None:
        size += 4 * sum(len(context) + 1 for context in table.next_token)
    return {"added_parameters": params, "added_mb": size / 2**20}


def _ids(prompt: Prompt, model: torch.nn.Module | Runtime) -> torch.Tensor:
    return torch.tensor([prompt.ids], device=model.device)  # (1, T): a transformers model or a runtime


def engine_decoder(counter: ForwardCounter, *, jacobi: bool, block_size: int, max_new_tokens: int, eos,
                   guess: str = "prompt", seed: int = 0, on_iteration=None, temperature: float = 0.0,
                   **engine) -> Callable[[Prompt], Decoded]:
    """Our greedy or Jacobi decoder (sampling when `temperature` > 0: AR sampling is Jacobi with
    n = 1); guesses and draws seeded per prompt id (the same in every round). `engine`: the
    recycling options of `jacobi_decode` (its defaults, i.e. plain Jacobi, when absent). Decodes on
    the counter's runtime."""
    model = counter.runtime

    def run(prompt: Prompt, hook=on_iteration) -> Decoded:
        if jacobi or temperature > 0:
            generator = torch.Generator().manual_seed(derived_seed(seed, "guess", prompt.id))
            out = jacobi_decode(model, _ids(prompt, model), block_size=block_size if jacobi else 1,
                                max_new_tokens=max_new_tokens, eos_token_id=eos, guess=guess,
                                generator=generator, on_iteration=hook, temperature=temperature,
                                **engine)
        else:
            out = greedy_decode(model, _ids(prompt, model), max_new_tokens=max_new_tokens, eos_token_id=eos)
        counter.check(out.forward_passes)
        return Decoded(out.new_tokens[0], out.forward_passes, list(out.stats.accepted), out.stats)

    return run


def hf_generate(counter: ForwardCounter, *, max_new_tokens: int, eos, pad_id: int,
                draft_counter: ForwardCounter | None = None,
                prompt_lookup_tokens: int | None = None) -> Callable[[Prompt], Decoded]:
    """transformers' `generate` of the counter's model: greedy, our cap and EOS, nothing else from
    the model's defaults."""
    model = counter.model
    extra = {"prompt_lookup_num_tokens": prompt_lookup_tokens} if prompt_lookup_tokens else {}
    gen_config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                                  eos_token_id=eos, pad_token_id=pad_id, **extra)

    def run(prompt: Prompt) -> Decoded:
        ids = _ids(prompt, model)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen_config,
                             assistant_model=draft_counter.model if draft_counter else None)
        tokens = out[0, ids.shape[1]:].tolist()
        return Decoded(tokens, counter.calls, counter.accepted(len(prompt.ids), len(tokens)),
                       draft_forward_passes=draft_counter.calls if draft_counter else 0)

    return run


def speculative(counter: ForwardCounter, draft_counter: ForwardCounter, *, draft_tokens: int,
                max_new_tokens: int, eos) -> Callable[[Prompt], Decoded]:
    """Our speculative decoding, greedy: the draft proposes `draft_tokens` tokens per step, the
    model verifies them in one forward (each on its counter's runtime); its forwards are the
    model's, the draft's are reported apart."""
    model, draft = counter.runtime, draft_counter.runtime

    def run(prompt: Prompt) -> Decoded:
        out = speculative_decode(model, draft, _ids(prompt, model), draft_tokens=draft_tokens,
                                 max_new_tokens=max_new_tokens, eos_token_id=eos)
        counter.check(out.forward_passes)
        draft_counter.check(out.stats.draft_forward_passes)
        return Decoded(out.new_tokens[0], out.forward_passes, list(out.stats.accepted), out.stats,
                       draft_forward_passes=out.stats.draft_forward_passes)

    return run


def medusa(counter: ForwardCounter, heads, *, tree: int | None, max_new_tokens: int,
           eos) -> Callable[[Prompt], Decoded]:
    """Greedy Medusa decoding: the heads' candidate tree (`tree` nodes, or their saved tree when
    None) verified by the counter's runtime in one forward per step."""
    model = counter.runtime

    def run(prompt: Prompt) -> Decoded:
        out = medusa_decode(model, heads, _ids(prompt, model), tree=tree, max_new_tokens=max_new_tokens,
                            eos_token_id=eos)
        counter.check(out.forward_passes)
        return Decoded(out.new_tokens[0], out.forward_passes, list(out.stats.accepted), out.stats)

    return run


def eagle(counter: ForwardCounter, head, *, nodes: int | None, max_new_tokens: int,
          eos) -> Callable[[Prompt], Decoded]:
    """Greedy EAGLE decoding: the head drafts a token tree (`nodes` nodes, or its saved default when
    None), the counter's runtime verifies it in one forward per step; the head's own forwards are
    reported apart."""
    model = counter.runtime

    def run(prompt: Prompt) -> Decoded:
        out = eagle_decode(model, head, _ids(prompt, model), nodes=nodes, max_new_tokens=max_new_tokens,
                           eos_token_id=eos)
        counter.check(out.forward_passes)
        return Decoded(out.new_tokens[0], out.forward_passes, list(out.stats.accepted), out.stats,
                       draft_forward_passes=out.stats.draft_forward_passes)

    return run


def build_methods(config: BenchConfig, models: BenchModels, counters: dict[str, ForwardCounter],
                  wanted: Sequence[str] = ()) -> list[Method]:
    """The methods `wanted` (none named: every one the given models allow), in `METHODS` order;
    one that needs a model not given is a UserError. `counters`: role -> its ForwardCounter."""
    settings = _Settings(config, models)
    if models.target is None:  # GGUF files: only what runs on them as given
        return _chosen(_gguf_methods(settings, models, counters, wanted), wanted, "need a model that was not given "
                       f"(cllm_* need --cllm FILE.gguf) or torch weights (on a GGUF: {', '.join(GGUF_METHODS)})")
    candidates = _target_methods(settings, models, counters["target"])
    if models.cllm is not None:
        candidates |= _cllm_methods(settings, models, counters["cllm"])
    if models.draft is not None:
        candidates |= _draft_methods(settings, models, counters)
    ct = counters["target"]
    if models.heads is not None:
        candidates["medusa"] = Method("medusa", models.target, medusa(
            ct, models.heads, tree=config.medusa_tree or None, **settings.common), [ct],
            added_memory(models.heads))
    if models.medusa2 is not None:
        cm = counters["medusa2"]
        candidates["medusa2_ar"] = Method("medusa2_ar", models.medusa2, engine_decoder(cm, **settings.ar), [cm])
        candidates["medusa2"] = Method("medusa2", models.medusa2, medusa(
            cm, models.medusa2_heads, tree=config.medusa_tree or None, **settings.common), [cm],
            added_memory(models.medusa2_heads))
    if models.eagle is not None:
        candidates["eagle"] = Method("eagle", models.target, eagle(
            ct, models.eagle, nodes=config.eagle_nodes or None, **settings.common), [ct],
            added_memory(models.eagle))
    candidates |= _llamacpp_methods(settings, models, wanted)
    return _chosen(candidates, wanted, f"need a model that was not given (cllm_* need --cllm, "
                   f"{', '.join(DRAFT_METHODS)} need --draft-model, medusa needs heads: --medusa, medusa2 and "
                   "medusa2_ar --medusa2, eagle --eagle, *llamacpp_* need llama-cpp-python: pip install "
                   "'cllm[llamacpp]')")


def _chosen(candidates: dict[str, Method], wanted: Sequence[str], why_missing: str) -> list[Method]:
    """The methods `wanted` of `candidates` (none named: all), in `METHODS` order; one named that
    is not there is a UserError, `why_missing` saying why."""
    wanted = list(wanted) or [m for m in METHODS if m in candidates]
    missing = [m for m in wanted if m not in candidates]
    if missing:
        raise UserError(f"method(s) {', '.join(missing)} {why_missing}")
    return [candidates[m] for m in METHODS if m in wanted]


class _Settings:
    """The keywords the adapters share: greedy (`ar`), plain Jacobi (`plain`), the engine's
    setting of cllm_jacobi and target_lookahead (`fast`, bar the draft table) and `common`."""

    def __init__(self, config: BenchConfig, models: BenchModels) -> None:
        self.config, self.pad_id = config, pad_token_id(models.tokenizer)
        self.common = dict(max_new_tokens=config.max_new_tokens, eos=models.tokenizer.eos_token_id)
        self.ar = dict(jacobi=False, block_size=1, **self.common)
        self.plain = dict(jacobi=True, block_size=config.engine.block_size, guess=config.engine.guess,
                          seed=config.seed, **self.common)
        self.fast = dict(self.plain, **{k: v for k, v in config.jacobi_kwargs().items() if k != "block_size"})


def _target_methods(s: _Settings, models: BenchModels, ct: ForwardCounter) -> dict[str, Method]:
    target, table = models.target, models.tables.get("target")
    return {
        "target_ar": Method("target_ar", target, engine_decoder(ct, **s.ar), [ct]),
        "target_jacobi": Method("target_jacobi", target, engine_decoder(ct, **s.plain), [ct]),
        "hf_generate": Method("hf_generate", target, hf_generate(ct, pad_id=s.pad_id, **s.common), [ct]),
        "prompt_lookup": Method("prompt_lookup", target, hf_generate(
            ct, pad_id=s.pad_id, prompt_lookup_tokens=s.config.prompt_lookup_tokens, **s.common), [ct]),
        "target_lookahead": Method("target_lookahead", target, engine_decoder(
            ct, **s.fast, draft_table=table), [ct], added_memory(table=table)),
    }


def _cllm_methods(s: _Settings, models: BenchModels, cc: ForwardCounter) -> dict[str, Method]:
    cllm, table = models.cllm, models.tables.get("cllm")
    hot = dict(temperature=s.config.temperature, **s.common)
    return {
        "cllm_ar": Method("cllm_ar", cllm, engine_decoder(cc, **s.ar), [cc]),
        "cllm_jacobi": Method("cllm_jacobi", cllm, engine_decoder(cc, **s.fast, draft_table=table), [cc],
                              added_memory(table=table)),
        "cllm_jacobi_plain": Method("cllm_jacobi_plain", cllm, engine_decoder(cc, **s.plain), [cc]),
        "cllm_ar_sampling": Method("cllm_ar_sampling", cllm, engine_decoder(
            cc, jacobi=False, block_size=1, seed=s.config.seed, **hot), [cc]),
        "cllm_jacobi_sampling": Method("cllm_jacobi_sampling", cllm, engine_decoder(
            cc, **{**s.plain, **hot}), [cc]),
    }


def _draft_methods(s: _Settings, models: BenchModels, counters: dict[str, ForwardCounter]) -> dict[str, Method]:
    target, draft, ct, cd = models.target, models.draft, counters["target"], counters["draft"]
    drafted = added_memory(draft)
    spec = dict(draft_tokens=s.config.draft_tokens, **s.common)
    methods = {
        "assisted": Method("assisted", target, hf_generate(
            ct, pad_id=s.pad_id, draft_counter=cd, **s.common), [ct, cd], drafted),
        "speculative": Method("speculative", target, speculative(ct, cd, **spec), [ct, cd], drafted),
    }
    if models.cllm is not None:
        cc = counters["cllm"]
        methods["cllm_speculative"] = Method("cllm_speculative", models.cllm, speculative(cc, cd, **spec), [cc, cd],
                                             drafted)
    return methods


def _llamacpp_methods(s: _Settings, models: BenchModels, wanted: Sequence[str]) -> dict[str, Method]:
    """llama.cpp's greedy and prompt lookup on each model's GGUF export, and our engine on the
    llama.cpp runtime over the same file (`cllm.bench.llamacpp`); none when llama-cpp-python is
    not installed. llama-cpp-python's decoder counts its own calls: it is its counter."""
    decoders = llamacpp_decoders(s.config, {"target": models.target, "cllm": models.cllm}, models.tokenizer,
                                 list(wanted))
    methods = {}
    for name, (role, decoder) in decoders.items():
        model = getattr(models, role)
        if isinstance(decoder, LlamaCppRuntime):
            counter = ForwardCounter(model, decoder)
            table = models.tables.get(role)
            methods[name] = Method(name, model, engine_decoder(counter, **s.fast, draft_table=table), [counter],
                                   {**added_memory(table=table), "engine": decoder.describe()})
        else:
            methods[name] = Method(name, model, _llamacpp_run(decoder), [decoder],
                                   {**added_memory(), "engine": decoder.engine})
    return methods


def _gguf_methods(s: _Settings, models: BenchModels, counters: dict[str, ForwardCounter],
                  wanted: Sequence[str]) -> dict[str, Method]:
    """On each GGUF file as given (role -> `models.gguf`): our greedy decoder (target_ar,
    cllm_ar) and our engine at the setting it takes by default for the file (`settings` of
    `load_for_decoding`: llamacpp_jacobi, cllm_llamacpp_jacobi) on its llama.cpp runtime, and
    llama.cpp's own greedy and prompt lookup (`cllm.bench.llamacpp.file_decoders`)."""
    methods = {}
    for role, fast in models.gguf.items():
        counter, runtime = counters[role], fast.model
        setting = {k: v for k, v in fast.settings.items() if k != "draft_table"}
        engine = f"{'cllm_' if role == 'cllm' else ''}llamacpp_jacobi"
        methods[f"{role}_ar"] = Method(f"{role}_ar", runtime, engine_decoder(counter, **s.ar), [counter])
        methods[engine] = Method(engine, runtime, engine_decoder(
            counter, jacobi=True, guess=s.config.engine.guess, seed=s.config.seed, **s.common, **setting,
            draft_table=fast.draft_table), [counter],
            {**added_memory(table=fast.draft_table), "engine": runtime.describe(), "engine_settings": setting})
    runtimes = {role: fast.model for role, fast in models.gguf.items()}
    for name, (role, decoder) in file_decoders(s.config, runtimes, models.tokenizer, list(wanted)).items():
        methods[name] = Method(name, runtimes[role], _llamacpp_run(decoder), [decoder],
                               {**added_memory(), "engine": decoder.engine})
    return methods


def _llamacpp_run(decoder) -> Callable[[Prompt], Decoded]:
    def run(prompt: Prompt) -> Decoded:
        out = decoder(prompt.ids)
        return Decoded(out.tokens, out.forward_passes, out.accepted)

    return run
