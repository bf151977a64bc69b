"""The settings of `cllm profile` (`ProfileConfig`) and `cllm tune` (`TuneConfig`), checked on
construction. No torch here: `cllm profile --help` reads them before anything heavy loads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from cllm.core.config import is_off
from cllm.models.names import check_dtype
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
class ProfileConfig:
    shape: str = field(default="small", metadata={"help": "model shape: small (the embedded target's, 5.3M), 1b "
        "(~Llama-3.2-1B), 3b, 7b (Llama-2-7B), 13b, or a config.json / model folder (random weights either way)"})
    dtype: str | None = field(default=None, metadata={"help": "bfloat16, float16 or float32 (default: bfloat16 on "
        "CUDA, float32 on the CPU)"})
    device: Literal["auto", "cpu", "cuda"] = field(default="auto", metadata={"help": "auto: cuda when there is one, "
        "else cpu"})
    prefix: int = field(default=512, metadata={"help": "tokens already in the KV cache before every timed step"})
    k: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64], metadata={"help": "fed tokens per step to "
        "time (1 is always added: every ratio is against it)"})
    repeats: int = field(default=20, metadata={"help": "interleaved timing rounds over every k (min and median "
        "reported)"})
    threads: int | None = field(default=None, metadata={"help": "torch CPU threads (default: torch's own choice; "
        "reported)"})
    tpf: str = field(default="ar=1,jacobi=1.09,engine=4.71", metadata={"help": "tokens per forward to predict tokens/s "
        "at, NAME=TPF pairs (default: the shipped CLLM's plain Jacobi and full engine on HumanEval, README)"})
    tree: bool = field(default=True, metadata={"help": "also time the tree-mask step (a recycling trie of k tokens)"})
    host_tokens: int = field(default=32, metadata={"help": "new tokens of each jacobi_decode run that measures the "
        "engine's host time per step (0: skip)"})
    forward_batches: list[int] = field(default_factory=lambda: [1, 16], metadata={"help": "batch sizes at which one "
        "causal forward of every k is timed on each forward the model can take (the lean runtime, transformers'), "
        "interleaved over --repeats rounds (empty: not timed)"})
    decode_tokens: int = field(default=128, metadata={"help": "new tokens of the single-request greedy decode timed "
        "on each of those forwards, tokens/s (0: skip)"})
    seed: int = field(default=0, metadata={"help": "seed of the random weights and token ids"})
    runtime: Literal["auto", "transformers", "lean"] = field(default="auto", metadata={"help": "the runtime whose "
        "steps are timed: auto (the lean runtime where it runs the model, the Llama family; else transformers'), "
        "transformers or lean"})
    out: str | None = field(default="reports/profile", metadata={"help": "folder for profile.json and profile.md "
        "('none': print only)"})

    def __post_init__(self):
        if any(not isinstance(k, int) or k < 1 for k in self.k) or not self.k:
            raise ValueError(f"--k must be ints >= 1, got {self.k}")
        self.k = sorted({1, *self.k})
        for name in ("prefix", "repeats"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"--{name} must be an int >= 1, got {getattr(self, name)!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")
        for name in ("host_tokens", "decode_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be an int >= 0, got {getattr(self, name)!r}")
        if any(not isinstance(b, int) or b < 1 for b in self.forward_batches):
            raise ValueError(f"--forward-batches must be ints >= 1, got {self.forward_batches}")
        if self.runtime not in RUNTIMES:
            raise ValueError(f"--runtime must be one of {', '.join(RUNTIMES)}, got {self.runtime!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        parse_tpf(self.tpf)
        if self.dtype is not None:
            check_dtype(self.dtype)
        if is_off(self.out, ("", "none")):
            self.out = None


@dataclass
class TuneConfig:
    model: str = field(default="stdlib-coder-cllm", metadata={"help": "model to tune: shipped name or local checkpoint "
        "dir"})
    out: str | None = field(default=None, metadata={"help": "file to write (default: MODEL/decode_defaults.json, or "
        "decode_defaults_llamacpp.json, where load_for_decoding finds it)"})
    force: bool = field(default=False, metadata={"help": "overwrite an existing defaults file"})
    device: Literal["auto", "cpu", "cuda"] = field(default="auto", metadata={"help": "the device the defaults are for "
        "(auto: cuda when there is one)"})
    dtype: str = field(default="float32", metadata={"help": "the dtype you decode in (cllm generate's default is "
        "float32)"})
    threads: int | None = field(default=None, metadata={"help": "CPU threads (torch's, llama.cpp's with --runtime "
        "llamacpp), as you will decode with (default: their own choice; recorded)"})
    runtime: Literal["auto", "llamacpp"] = field(default="auto", metadata={"help": "the runtime to tune for: auto (the "
        "one load_for_decoding picks for the checkpoint) or llamacpp (its GGUF export; written to "
        "decode_defaults_llamacpp.json, which cllm export copies beside the GGUF)"})
    prefix: int = field(default=256, metadata={"help": "tokens cached before every timed step (lowered to fit the "
        "model's position limit)"})
    k: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64], metadata={"help": "fed tokens per step to "
        "time (1 is always added)"})
    repeats: int = field(default=10, metadata={"help": "interleaved timing rounds (the min per k is used)"})
    block_max_cost: float = field(default=BLOCK_MAX_COST, metadata={"help": "block size: the largest measured k whose "
        "t(k)/t(1) is at most this"})
    budget_max_cost: float = field(default=BUDGET_MAX_COST, metadata={"help": "fed-token budget: the largest k whose "
        "interpolated t(k)/t(1) is at most this"})
    max_block: int = field(default=MAX_BLOCK, metadata={"help": "block size at most"})

    def __post_init__(self):
        if any(not isinstance(k, int) or k < 1 for k in self.k) or not self.k:
            raise ValueError(f"--k must be ints >= 1, got {self.k}")
        self.k = sorted({1, *self.k})
        for name in ("prefix", "repeats", "max_block"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an int >= 1, got {getattr(self, name)!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")
        if not 1 <= self.block_max_cost <= self.budget_max_cost:
            raise ValueError("need 1 <= --block-max-cost <= --budget-max-cost, got "
                             f"{self.block_max_cost} and {self.budget_max_cost}")
