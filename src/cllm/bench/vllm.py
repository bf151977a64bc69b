"""The bench's vLLM methods: the target decoded by vLLM's offline engine (`vllm.LLM`), one
request at a time, greedy, in the environment `cllm serve --engine vllm` gives vLLM
(`cllm.serving.vllm.engine_environment`). Each is checked, like every method, against the
target's greedy decoding (`target_ar`) token for token.

- `vllm_ar`: plain decoding;
- `vllm_ngram`: vLLM's n-gram speculation (prompt lookup), k = `--vllm-tokens`;
- `vllm_suffix`: suffix decoding (arctic-inference; refused when it is not installed), from the
  request's own prompt and output: its cache of past responses is off, since the bench decodes
  every prompt several times (round 2 would draft round 1's answer);
- `vllm_cllm`: our proposer (`cllm.serving.vllm`: the request's n-grams + the model's draft
  table, + the Jacobi tail with `--vllm-jacobi-tail`).

Forward passes are vLLM's engine steps that gave the request tokens (one forward of the target
each; the bench steps the engine itself), so tokens per forward read as our methods' do. They run
only when named (`--methods vllm_cllm ...`), in an environment with vLLM (`make vllm`).
"""

from __future__ import annotations

import importlib.util
import itertools
import os
from collections.abc import Callable
from typing import Any

from cllm.bench.config import BenchConfig
from cllm.bench.methods import Decoded, Method, added_memory
from cllm.bench.models import BenchModels, model_path
from cllm.core.errors import UserError
from cllm.data.prompts import Prompt
from cllm.serving.vllm import (
    engine_environment,
    model_positions,
    ngram_config,
    require_vllm,
    speculative_config,
    suffix_config,
)

VLLM_METHODS = ("vllm_ar", "vllm_ngram", "vllm_suffix", "vllm_cllm")
MAX_MODEL_LEN = 4096  # at most: the model's own positions bound it further


def vllm_speculation(name: str, config: BenchConfig, model: str) -> dict[str, Any] | None:
    """The speculative config of vLLM method `name` (None: plain decoding)."""
    k = config.vllm_tokens
    if name == "vllm_ar":
        return None
    if name == "vllm_ngram":
        return ngram_config(k)
    if name == "vllm_suffix":
        if importlib.util.find_spec("arctic_inference") is None:
            raise UserError("vllm_suffix needs arctic-inference (suffix decoding), which is not installed here: "
                            "`make vllm` builds it where it can")
        return suffix_config(k, cached_requests=0)  # the bench repeats each prompt: a cache would hold its answer
    if name == "vllm_cllm":
        return speculative_config(model, jacobi_tail=config.vllm_jacobi_tail, num_speculative_tokens=k)
    raise ValueError(f"not a vLLM method: {name}")


def vllm_methods(config: BenchConfig, models: BenchModels, wanted: list[str]) -> dict[str, Method]:
    """The vLLM methods among `wanted`, each its own engine on the target (loaded here, once)."""
    names = [m for m in VLLM_METHODS if m in wanted]
    if not names:
        return {}
    require_vllm(f"bench method(s) {', '.join(names)}")
    model = str(model_path(config.target)) if model_path(config.target).is_dir() else config.target
    _enter_environment(config.threads)
    table = models.tables.get("target") if "vllm_cllm" in names else None
    methods = {}
    for name in names:
        engine = _engine(model, config, vllm_speculation(name, config, model))
        added = added_memory(table=table) if name == "vllm_cllm" else added_memory()
        methods[name] = Method(name, models.target, vllm_decoder(engine, config.max_new_tokens), [], added)
    return methods


def _enter_environment(threads: int) -> None:
    """vLLM's environment, set in this process before its engines start (they run in spawned
    processes, so the preloads act there)."""
    env, _ = engine_environment(threads)
    os.environ.update({k: v for k, v in env.items() if k.startswith("VLLM_") or k == "LD_PRELOAD"})


def _engine(model: str, config: BenchConfig, speculative: dict[str, Any] | None) -> Any:
    from vllm import LLM  # heavy and optional: `make vllm`

    positions = model_positions(model)
    return LLM(model=model, dtype=config.dtype, seed=config.seed, max_num_seqs=1,
               max_model_len=min(MAX_MODEL_LEN, positions or MAX_MODEL_LEN), speculative_config=speculative)


def vllm_decoder(engine: Any, max_new_tokens: int) -> Callable[[Prompt], Decoded]:
    """One greedy request through `engine`, stepped here: its tokens (EOS included when
    produced, as ours), its forwards (the engine steps that gave it tokens) and the tokens each
    made final."""
    from vllm import SamplingParams  # heavy and optional: `make vllm`
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, output_kind=RequestOutputKind.CUMULATIVE)
    ids = itertools.count()

    def run(prompt: Prompt) -> Decoded:
        request = f"bench-{next(ids)}"
        engine.llm_engine.add_request(request, {"prompt_token_ids": list(prompt.ids)}, params)
        tokens, accepted = step_through(engine.llm_engine, request)
        return Decoded(tokens, len(accepted), accepted)

    return run


def step_through(core: Any, request: str) -> tuple[list[int], list[int]]:
    """Step vLLM's engine (`LLMEngine`: `step()`, `has_unfinished_requests()`) until it is done;
    `request`'s tokens, and per step that gave it tokens how many (its outputs are cumulative)."""
    tokens: list[int] = []
    accepted: list[int] = []
    while core.has_unfinished_requests():
        for out in core.step():
            if out.request_id == request:
                now = list(out.outputs[0].token_ids)
                if len(now) > len(tokens):
                    accepted.append(len(now) - len(tokens))
                tokens = now
    return tokens, accepted
