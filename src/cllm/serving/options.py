"""The decode options `cllm generate` and `cllm chat` share (`DecodeOptions`) and their configs,
which extend it (`GenerateConfig`, `ChatConfig`): the model and how to load it, the decoder, the
budget, stop strings and sampling, checked on construction and turned into a request's
`DecodeParams`. No torch here: `cllm generate --help` reads these before anything heavy loads;
`cllm.serving.loading.load_options` loads what they name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from cllm.core.config import is_off
from cllm.decoding.settings import RECOMMENDED_CONFIG, JacobiConfig, is_greedy
from cllm.runtime.choices import RUNTIME_HELP, RUNTIMES
from cllm.serving.params import METHODS, DecodeParams


def unescape(text: str) -> str:
    r"""`\n`, `\t` and `\\` typed on a command line -> the characters."""
    out, i = [], 0
    while i < len(text):
        pair = text[i : i + 2]
        if pair in ("\\n", "\\t", "\\\\"):
            out.append({"\\n": "\n", "\\t": "\t", "\\\\": "\\"}[pair])
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


@dataclass
class DecodeOptions:
    model: str = field(default="stdlib-coder", metadata={"help": "model dir, shipped name or hub id"})
    method: Literal["jacobi", "ar"] = field(default="jacobi", metadata={"help": "decoder: Jacobi (blocks) or AR (token "
        "by token)"})
    max_new_tokens: int = field(default=128, metadata={"help": "token budget"})
    stop: list[str] = field(default_factory=list, metadata={"help": r"stop strings, comma-separated (\n, \t "
        r"understood); output is cut at the first"})
    temperature: float = field(default=0.0, metadata={"help": "0 = greedy (exact); > 0 samples, with Jacobi losslessly "
        "(the law of AR sampling)"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling (with --temperature > 0)"})
    top_k: int | None = field(default=None, metadata={"help": "sample among the k most likely tokens (with "
        "--temperature > 0)"})
    seed: int | None = field(default=None, metadata={"help": "seed of the guesses and the sampling draws (default: 0)"})
    engine: JacobiConfig = field(default_factory=lambda: RECOMMENDED_CONFIG, metadata={"help": "the Jacobi engine's "
        "settings (flags --block-size, --recycle, ...)"})
    draft_table: str = field(default="auto", metadata={"help": "Jacobi: the model's draft table (cllm drafts): auto "
        "(the one saved beside the checkpoint, if any), none, or a file; speed only, the output is unchanged"})
    medusa: str = field(default="none", metadata={"help": "decode with Medusa heads (cllm medusa) instead of --method: "
        "auto (those in MODEL/medusa, if any), none, or a heads folder; greedy only, the text is greedy's"})
    eagle: str = field(default="none", metadata={"help": "decode with an EAGLE head (cllm eagle) instead of --method: "
        "auto (the one in MODEL/eagle, if any), none, or a head folder; greedy only, the text is greedy's"})
    dtype: str = field(default="float32", metadata={"help": "float32, bfloat16 or float16"})
    device: str = field(default="cpu", metadata={"help": "torch device"})
    threads: int = field(default=0, metadata={"help": "torch CPU threads, llama.cpp's with --runtime llamacpp (0: "
        "the default)"})
    runtime: Literal["auto", "transformers", "lean", "llamacpp"] = field(default="auto",
                                                                         metadata={"help": RUNTIME_HELP})
    compile: bool = field(default=False, metadata={"help": "compile the lean runtime's forward first (float32 on "
        "a CPU with a C++ compiler): faster forwards of few fed tokens, after a compile the first time for a model "
        "that a short run does not win back; later runs load it from the compile cache, $CLLM_COMPILE_CACHE or "
        "~/.cache/cllm/compiled (benchmarks/README.md, engines-cpu/llamacpp-compiled)"})

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"--method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        self.stop = [unescape(s) for s in self.stop]
        if any(s == "" for s in self.stop):
            raise ValueError("--stop strings must not be empty")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"--top-k must be >= 1, got {self.top_k}")
        if self.threads < 0:
            raise ValueError(f"--threads must be >= 0, got {self.threads}")
        if self.runtime not in RUNTIMES:
            raise ValueError(f"--runtime must be one of {', '.join(RUNTIMES)}, got {self.runtime!r}")
        if not is_off(self.medusa) and not is_greedy(self.temperature):
            raise ValueError("--medusa decodes greedily: use --temperature 0 (or --medusa none)")
        if not is_off(self.eagle) and not is_greedy(self.temperature):
            raise ValueError("--eagle decodes greedily: use --temperature 0 (or --eagle none)")
        if not is_off(self.medusa) and not is_off(self.eagle):
            raise ValueError("give --medusa or --eagle, not both")

    def params(self) -> DecodeParams:
        return DecodeParams(method=self.method, engine=self.engine,
                            max_new_tokens=self.max_new_tokens, stop=tuple(self.stop),
                            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                            seed=self.seed)


@dataclass
class GenerateConfig(DecodeOptions):
    """`cllm generate`'s settings."""

    prompt: str | None = field(default=None, metadata={"help": "text to continue; '-' reads stdin (as does a pipe when "
        "no prompt is given)"})
    prompt_file: str | None = field(default=None, metadata={"help": "read the prompt from this file"})
    show_trajectory: bool = field(default=False, metadata={"help": "print every Jacobi iteration, tokens coloured "
        "(final / correct / wrong)"})
    verbose: bool = field(default=False, metadata={"short": "-v", "help": "also say on stderr which runtime decodes "
        "the model and why (the lean runtime, or transformers' forward) and the engine's settings"})

    def __post_init__(self):
        super().__post_init__()
        if self.prompt is not None and self.prompt_file is not None:
            raise ValueError("give either --prompt or --prompt-file, not both")
        if self.show_trajectory and (self.method != "jacobi" or not is_greedy(self.temperature)
                                     or not is_off(self.medusa) or not is_off(self.eagle)):
            raise ValueError("--show-trajectory needs greedy Jacobi decoding (--method jacobi, --temperature 0)")


@dataclass
class ChatConfig(DecodeOptions):
    """`cllm chat`'s settings."""

    system: str | None = field(default=None, metadata={"help": "system message (used with a chat template)"})
