"""The decode options: the groups generate, chat, serve and bench share (`Decoder`, `Heads`,
`Engine`, `Runtime`, beside `cllm.core.options`'), what `cllm generate` and `cllm chat` share
(`DecodeOptions`: the model and how to load it, the decoder, the budget, stop strings and
sampling) and their configs, which extend it (`GenerateConfig`, `ChatConfig`); checked on
construction and turned into a request's `DecodeParams`. No torch here: `cllm generate --help`
reads these before anything heavy loads; `cllm.serving.loading.load_options` loads what they name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from cllm.core.config import Section, is_off
from cllm.core.options import MACHINE, Budget, Dtype, Machine, Model, Options, Seed
from cllm.decoding.settings import RECOMMENDED_CONFIG, JacobiConfig, is_greedy
from cllm.runtime.choices import RUNTIME_HELP, RUNTIMES
from cllm.serving.params import METHODS, DecodeParams

DECODING = Section("decoding", 15)
SAMPLING = Section("stopping and sampling", 16)


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
class Decoder(Options):
    """Which decoder runs a prompt and on which drafts (generate, chat, serve)."""

    SECTION: ClassVar[Section] = DECODING
    method: Literal["jacobi", "ar"] = field(default="jacobi", metadata={"help": "decoder: Jacobi (blocks) or AR (token "
        "by token); serve: for a request that names none"})
    draft_table: str = field(default="auto", metadata={"help": "Jacobi: the model's draft table (cllm drafts): auto "
        "(the one saved beside the checkpoint, if any), none, or a file; speed only, the output is unchanged"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.method not in METHODS:
            raise ValueError(f"--method must be one of {', '.join(METHODS)}, got {self.method!r}")


@dataclass
class Heads(Options):
    """A model's trained draft heads (generate, chat, bench; serve refuses them)."""

    SECTION: ClassVar[Section] = DECODING
    medusa: str = field(default="none", metadata={"help": "Medusa heads (cllm medusa): auto (those in MODEL/medusa, if "
        "any), none, or a heads folder. generate, chat: decode with them instead of --method, greedily (the text is "
        "greedy's); bench: method medusa's heads; serve: refused (it batches rows on the Jacobi engine)"})
    eagle: str = field(default="none", metadata={"help": "an EAGLE head (cllm eagle): auto (the one in MODEL/eagle, "
        "if any), none, or a head folder. generate, chat: decode with it instead of --method, greedily (the text is "
        "greedy's); bench: method eagle's head; serve: refused (it batches rows on the Jacobi engine)"})


@dataclass
class Engine(Options):
    """The Jacobi engine's settings (generate, chat, bench; serve's are its `jacobi`)."""

    SECTION: ClassVar[Section] = DECODING
    engine: JacobiConfig = field(default_factory=lambda: RECOMMENDED_CONFIG, metadata={"help": "the Jacobi engine's "
        "settings (flags --block-size, --recycle, ...); bench: cllm_jacobi and target_lookahead use them all, the "
        "plain Jacobi methods the block size and guess"})


@dataclass
class Runtime(Options):
    """The forward the decoders run on (generate, chat, serve, bench)."""

    SECTION: ClassVar[Section] = MACHINE
    runtime: Literal["auto", "transformers", "lean", "llamacpp"] = field(default="auto", metadata={
        "help": RUNTIME_HELP + "; bench: our decoders' (transformers' generate runs on its own forward whatever this "
        "says)"})
    compile: bool = field(default=False, metadata={"help": "compile the lean runtime's forward first (float32 on "
        "a CPU with a C++ compiler; elsewhere a note and the eager forward): faster forwards of few fed tokens, after "
        "a compile the first time for a model that a short run does not win back; later runs load it from the "
        "compile cache, $CLLM_COMPILE_CACHE or ~/.cache/cllm/compiled. Faster for one client, slower for many on a "
        "small CPU (docs/serving.md; benchmarks/README.md, engines-cpu/llamacpp-compiled); bench: the target's and the "
        "CLLM's, and its forward timings time it too"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.runtime not in RUNTIMES:
            raise ValueError(f"--runtime must be one of {', '.join(RUNTIMES)}, got {self.runtime!r}")


@dataclass
class DecodeOptions(Model, Budget, Decoder, Heads, Engine, Seed, Dtype, Machine, Runtime):
    """What `cllm generate` and `cllm chat` share; stopping and sampling are their own."""

    SECTION: ClassVar[Section] = SAMPLING
    stop: list[str] = field(default_factory=list, metadata={"help": r"stop strings, comma-separated (\n, \t "
        r"understood); output is cut at the first"})
    temperature: float = field(default=0.0, metadata={"help": "0 = greedy (exact); > 0 samples, with Jacobi losslessly "
        "(the law of AR sampling)"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling (with --temperature > 0)"})
    top_k: int | None = field(default=None, metadata={"help": "sample among the k most likely tokens (with "
        "--temperature > 0)"})

    def __post_init__(self):
        super().__post_init__()
        self.stop = [unescape(s) for s in self.stop]
        if any(s == "" for s in self.stop):
            raise ValueError("--stop strings must not be empty")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"--top-k must be >= 1, got {self.top_k}")
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
    chat: bool = field(default=False, metadata={"help": "send the prompt as a user's turn, written by the model's chat "
        "template; the output is the assistant's reply"})
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
