"""The settings of `cllm profile` (`ProfileConfig`) and `cllm tune` (`TuneConfig`), checked on
construction, and the timing groups they share with `cllm bench` (`Repeats`, `ForwardBatches`).
No torch here: `cllm profile --help` reads them before anything heavy loads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from cllm.core.config import Section, is_off, retune
from cllm.core.options import MACHINE, AnyDevice, Dtype, Force, Model, Options, Seed, check_dtype, check_ints
from cllm.profiling.costs import BLOCK_MAX_COST, BUDGET_MAX_COST, MAX_BLOCK
from cllm.runtime.choices import RUNTIMES


def parse_tpf(text: str) -> dict[str, float]:
    """"ar=1,jacobi=1.09,engine=4.71" -> {"ar": 1.0, ...}; a one-line ValueError otherwise."""
    out: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",")):
        name, eq, value = part.partition("=")
        try:
            tpf = float(value)
        except ValueError:
            tpf = float("nan")
        if not eq or not name.strip() or not tpf > 0:
            raise ValueError(f"--tpf takes NAME=TOKENS_PER_FORWARD pairs > 0, like ar=1,engine=4.1; got {part!r}")
        out[name.strip()] = tpf
    return out


@dataclass
class Repeats(Options):
    """Interleaved timing rounds (profile, tune, bench, demo)."""

    repeats: int = field(default=3, metadata={"help": "interleaved timed rounds (profile: min and median per k "
        "reported; tune: the min per k used; bench, demo: over all prompts and methods, the median per prompt)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_ints(self, ["repeats"], 1)


@dataclass
class ForwardBatches(Options):
    """The batch sizes one forward is timed at (profile, bench)."""

    forward_batches: list[int] = field(default_factory=lambda: [1, 16], metadata={"help": "batch sizes at which one "
        "causal forward is timed at each fed-token count (profile: every --k; bench: --forward-tokens) on each "
        "forward the model can take (the lean runtime, transformers'), interleaved (empty: not timed)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if any(not isinstance(b, int) or b < 1 for b in self.forward_batches):
            raise ValueError(f"--forward-batches must be ints >= 1, got {self.forward_batches}")


@dataclass
class Steps(Options):
    """The steps whose cost is timed: k fed tokens after a cached prefix (profile, tune)."""

    prefix: int = field(default=512, metadata={"help": "tokens already in the KV cache before every timed step (tune: "
        "lowered to fit the model's position limit)"})
    k: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64], metadata={"help": "fed tokens per step to "
        "time (1 is always added: every ratio is against it)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if any(not isinstance(k, int) or k < 1 for k in self.k) or not self.k:
            raise ValueError(f"--k must be ints >= 1, got {self.k}")
        self.k = sorted({1, *self.k})
        check_ints(self, ["prefix"], 1)


@dataclass
class TimedThreads(Options):
    """CPU threads of a timing run, where unset is the library's own choice (profile, tune)."""

    SECTION: ClassVar[Section] = MACHINE
    threads: int | None = field(default=None, metadata={"help": "CPU threads: torch's (tune --runtime llamacpp: "
        "llama.cpp's), as you will decode with (default: their own choice; recorded)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.threads is not None:
            check_ints(self, ["threads"], 1)


@dataclass
@retune(repeats=20)
class ProfileConfig(Steps, Repeats, ForwardBatches, Seed, AnyDevice, TimedThreads):
    """`cllm profile`'s settings: the steps of a model of a given shape, timed."""

    shape: str = field(default="small", metadata={"help": "model shape: small (the embedded target's, 5.3M), 1b "
        "(~Llama-3.2-1B), 3b, 7b (Llama-2-7B), 13b, or a config.json / model folder (random weights either way)"})
    dtype: str | None = field(default=None, metadata={"help": "bfloat16, float16 or float32 (default: bfloat16 on "
        "CUDA, float32 on the CPU)"})
    tpf: str = field(default="ar=1,jacobi=1.09,engine=4.71", metadata={"help": "tokens per forward to predict tokens/s "
        "at, NAME=TPF pairs (default: the shipped CLLM's plain Jacobi and full engine on HumanEval, README)"})
    tree: bool = field(default=True, metadata={"help": "also time the tree-mask step (a recycling trie of k tokens)"})
    host_tokens: int = field(default=32, metadata={"help": "new tokens of each jacobi_decode run that measures the "
        "engine's host time per step (0: skip)"})
    decode_tokens: int = field(default=128, metadata={"help": "new tokens of the single-request greedy decode timed "
        "on each of those forwards, tokens/s (0: skip)"})
    runtime: Literal["auto", "transformers", "lean"] = field(default="auto", metadata={"help": "the runtime whose "
        "steps are timed: auto (the lean runtime where it runs the model, the Llama family; else transformers'), "
        "transformers or lean"})
    out: str | None = field(default="reports/profile", metadata={"help": "folder for profile.json and profile.md "
        "('none': print only)"})

    def __post_init__(self):
        super().__post_init__()
        for name in ("host_tokens", "decode_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be an int >= 0, got {getattr(self, name)!r}")
        if self.runtime not in RUNTIMES:
            raise ValueError(f"--runtime must be one of {', '.join(RUNTIMES)}, got {self.runtime!r}")
        parse_tpf(self.tpf)
        if self.dtype is not None:
            check_dtype(self.dtype)
        if is_off(self.out, ("", "none")):
            self.out = None


@dataclass
@retune(model="stdlib-coder-cllm", prefix=256, repeats=10)
class TuneConfig(Model, Force, Steps, Repeats, Dtype, AnyDevice, TimedThreads):
    """`cllm tune`'s settings: the decode defaults a checkpoint gets, from its measured step costs."""

    out: str | None = field(default=None, metadata={"help": "file to write (default: MODEL/decode_defaults.json, or "
        "decode_defaults_llamacpp.json, where load_for_decoding finds it)"})
    runtime: Literal["auto", "llamacpp"] = field(default="auto", metadata={"help": "the runtime to tune for: auto (the "
        "one load_for_decoding picks for the checkpoint) or llamacpp (its GGUF export; written to "
        "decode_defaults_llamacpp.json, which cllm export copies beside the GGUF)"})
    block_max_cost: float = field(default=BLOCK_MAX_COST, metadata={"help": "block size: the largest measured k whose "
        "t(k)/t(1) is at most this"})
    budget_max_cost: float = field(default=BUDGET_MAX_COST, metadata={"help": "fed-token budget: the largest k whose "
        "interpolated t(k)/t(1) is at most this"})
    max_block: int = field(default=MAX_BLOCK, metadata={"help": "block size at most"})

    def __post_init__(self):
        super().__post_init__()
        check_ints(self, ["max_block"], 1)
        if not 1 <= self.block_max_cost <= self.budget_max_cost:
            raise ValueError("need 1 <= --block-max-cost <= --budget-max-cost, got "
                             f"{self.block_max_cost} and {self.budget_max_cost}")
