"""The options several commands share, each declared once, in a small group class.

A command's config inherits the groups it takes (dataclass inheritance, so `config.seed` stays
flat) and gives an inherited option its own default with `cllm.core.config.retune`; the help,
type and checks stay with the group. Each group validates its options in `__post_init__` and
hands on to the next (`super().__post_init__()`, ended by `Options`). A group without a default
for an option (keyword-only) leaves it to each command's `retune`.

The groups here are the ones commands of every layer take (the model, the prompts, the run's
folder, the machine); groups only one side shares live beside it (`cllm.training.options`,
`cllm.serving.options`, `cllm.profiling.config`, `cllm.bench.config`). A group's `SECTION` titles
where `--help` lists what it declares. No torch here: `--help` reads these before anything heavy
loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from cllm.core.config import Section
from cllm.core.errors import UserError

MODEL_DATA = Section("model and data", 10)
RUN = Section("run", 20)  # where it writes, resuming, checkpoints, seed
EVALUATION = Section("evaluation", 50)
MACHINE = Section("machine", 80)

# the dtypes `--dtype` takes (`cllm.models.loading.DTYPES` maps them to torch's)
DTYPE_NAMES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16")


def check_dtype(name: str) -> str:
    """`name` when it names a dtype (`DTYPE_NAMES`, any case), else a UserError listing them."""
    if name.lower() not in DTYPE_NAMES:
        raise UserError(f"unknown dtype {name!r}; choose one of {sorted(DTYPE_NAMES)}")
    return name


def check_ints(config, names: list[str], minimum: int) -> None:
    """Each option of `names` an int >= `minimum`, else a UserError naming its flag."""
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise UserError(f"--{name.replace('_', '-')} must be an int >= {minimum}, got {value!r}")


class Options:
    """The root of every option group: ends the `__post_init__` chain."""

    def __post_init__(self) -> None:
        pass


# model and data


@dataclass
class Model(Options):
    """The model a command loads (the training commands, generate, chat, serve, export, tune)."""

    SECTION: ClassVar[Section] = MODEL_DATA
    model: str = field(default="stdlib-coder", metadata={"help": "the model: a shipped name, local checkpoint dir "
        "or hub id"})


@dataclass
class Budget(Options):
    """New tokens per prompt (generate, chat, bench, demo, and the data of the training commands)."""

    SECTION: ClassVar[Section] = MODEL_DATA
    max_new_tokens: int = field(default=128, metadata={"help": "new tokens per prompt at most (fewer at EOS; bench: "
        "the same for every method)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_ints(self, ["max_new_tokens"], 1)


@dataclass
class PromptSet(Budget):
    """A set of prompts (collect, distill, drafts, medusa, eagle: their data; bench, demo: what is
    timed)."""

    SECTION: ClassVar[Section] = MODEL_DATA
    prompts: str = field(default="stdlib-train", metadata={"help": "prompt set: stdlib-train, stdlib-val, humaneval, "
        "or a JSONL/Parquet file (collect, distill, drafts, medusa, eagle: its greedy continuations make the data, so "
        "not the prompts you benchmark on)"})
    max_prompts: int | None = field(default=None, metadata={"help": "only the first N prompts of the set (unset: "
        "all)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_prompts is not None:
            check_ints(self, ["max_prompts"], 1)


# run


@dataclass
class RunFolder(Options):
    """The folder a run writes and resumes (train, pretrain, collect, distill, bench, demo); each
    command names its own default."""

    SECTION: ClassVar[Section] = RUN
    out: str = field(kw_only=True, metadata={"help": "output folder; rerun with the same options to resume"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.out:
            raise UserError("out must name a directory")


@dataclass
class Resume(Options):
    """Whether a run continues what an earlier one left (train, pretrain, medusa, eagle, bench, demo)."""

    SECTION: ClassVar[Section] = RUN
    resume: bool = field(default=True, metadata={"help": "continue an unfinished run in --out (training: from its "
        "checkpoint; bench, demo: reuse the decodes OUT/progress.jsonl records for the same models and measuring "
        "settings); false starts over (bench, demo: the old record kept renamed)"})


@dataclass
class Force(Options):
    """Whether what an earlier run wrote is replaced (drafts, medusa, eagle, export, tune)."""

    SECTION: ClassVar[Section] = RUN
    force: bool = field(default=False, metadata={"help": "replace what an earlier run wrote (drafts, medusa, eagle: "
        "at --out, or inside MODEL without it, never a file cllm did not write, and an unfinished medusa or eagle "
        "run resumes without it; export: the GGUF and its side folder; tune: the defaults file)"})


@dataclass
class Seed(Options):
    """The seed of whatever a command draws."""

    SECTION: ClassVar[Section] = RUN
    seed: int = field(default=0, metadata={"help": "random seed of what the command draws: initial guesses, sampling, "
        "data order, initial or random weights, sampled states, dropout, noise"})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_ints(self, ["seed"], 0)


# machine


@dataclass
class Dtype(Options):
    """The dtype a model is loaded in (collect, drafts, medusa, eagle, generate, chat, serve, bench, tune)."""

    SECTION: ClassVar[Section] = MACHINE
    dtype: str = field(default="float32", metadata={"help": "model dtype: float32, bfloat16 or float16 (exactness "
        "is promised in float32; medusa, eagle: the trained heads' too)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_dtype(self.dtype)


@dataclass
class Device(Options):
    """The torch device a model runs on (drafts, medusa, eagle, generate, chat, serve, bench)."""

    SECTION: ClassVar[Section] = MACHINE
    device: str = field(default="cpu", metadata={"help": "torch device"})


@dataclass
class AnyDevice(Options):
    """A device found at run time (pretrain, profile, tune)."""

    SECTION: ClassVar[Section] = MACHINE
    device: Literal["auto", "cpu", "cuda"] = field(default="auto", metadata={"help": "auto: cuda when torch sees a "
        "GPU, else the CPU"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.device not in ("auto", "cpu", "cuda"):
            raise UserError(f"--device must be auto, cpu or cuda, got {self.device!r}")


@dataclass
class Threads(Options):
    """CPU threads, 0 leaving the choice to the library (drafts, medusa, eagle, generate, chat, export)."""

    SECTION: ClassVar[Section] = MACHINE
    threads: int = field(default=0, metadata={"help": "CPU threads of torch, or of llama.cpp where it runs (--runtime "
        "llamacpp; export's quantizer); 0: their default"})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_ints(self, ["threads"], 0)


@dataclass
class Machine(Device, Threads):
    """Where torch runs and on how many CPU threads."""
