"""The option groups only the training commands share, each declared once (the way
`cllm.core.options` describes; the groups every side takes, the model, prompts, run folder, seed
and machine, are there).

The sections below print in their order between core's: what most runs set first, study-only
knobs late, the machine last. No torch here: `--help` reads these before anything heavy loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from cllm.core.config import Section, retune
from cllm.core.errors import UserError
from cllm.core.options import (
    EVALUATION,
    MACHINE,
    MODEL_DATA,
    RUN,
    Dtype,
    Force,
    Machine,
    Model,
    Options,
    PromptSet,
    Resume,
    Seed,
    check_ints,
)

# what a command is about
MODEL_SHAPE = Section("model shape", 30)  # pretrain
COLLECTION = Section("collection", 30)  # collect, distill
ROUNDS = Section("rounds", 31)  # distill
DRAFT_TABLE = Section("draft table", 32)  # drafts, distill
MEDUSA = Section("Medusa heads", 30)
MEDUSA_2 = Section("Medusa-2 (--joint)", 31)
EAGLE = Section("EAGLE head", 30)
TREE = Section("candidate tree", 33)  # medusa, eagle
TRAINING = Section("training", 40)
RECIPE = Section("recipe details (studies)", 60)  # train, distill
LORA = Section("LoRA", 70)

AUTO = "auto"  # medusa, eagle --eval-prompts: HumanEval for a model of the stdlib domain, else the held-out texts
Guess = Literal["prompt", "repeat", "random", "lookup"]


# model and data


@dataclass
class TextField(Options):
    """Where a JSONL/Parquet prompt file keeps its prompts (train, collect)."""

    SECTION: ClassVar[Section] = MODEL_DATA
    text_field: str = field(default="prompt", metadata={"help": "field holding the prompt text in a JSONL/Parquet "
        "prompt file"})


# run


@dataclass
class Checkpoints(Options):
    """How often a training run saves its state (train, distill, pretrain)."""

    SECTION: ClassVar[Section] = RUN
    checkpoint_interval: int = field(default=100, metadata={"help": "save the trainer state every N steps (also at "
        "the end and on Ctrl-C)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_ints(self, ["checkpoint_interval"], 1)


# training


@dataclass
class Training(Options):
    """Step size and batch of an optimizer run (train, distill, pretrain, medusa, eagle)."""

    SECTION: ClassVar[Section] = TRAINING
    # train's 2e-4 (the CLLM reference used 2e-5 on 7B models)
    lr: float = field(default=2e-4, metadata={"help": "peak learning rate (AdamW): linear warm-up, then cosine "
        "decay"})
    batch_size: int = field(default=16, metadata={"help": "examples per optimizer step, all processes together: "
        "records (train, distill; --layout packed: prompts), windows (pretrain), texts (medusa, eagle: every position "
        "of each counts)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.lr > 0:
            raise UserError(f"--lr must be > 0, got {self.lr}")
        check_ints(self, ["batch_size"], 1)


@dataclass
class Decay(Options):
    """AdamW's weight decay (train, pretrain, medusa, eagle)."""

    SECTION: ClassVar[Section] = TRAINING
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay (pretrain: on matrices, not "
        "norms)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.weight_decay >= 0:
            raise UserError(f"--weight-decay must be >= 0, got {self.weight_decay}")


@dataclass
class GradClip(Options):
    """Gradient clipping (train, pretrain)."""

    SECTION: ClassVar[Section] = TRAINING
    grad_clip: float = field(default=1.0, metadata={"help": "clip the gradient norm to this (0: off)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.grad_clip >= 0:
            raise UserError(f"--grad-clip must be >= 0, got {self.grad_clip}")


# evaluation


@dataclass
class EvalInterval(Options):
    """How often a training run evaluates (train, distill, pretrain)."""

    SECTION: ClassVar[Section] = EVALUATION
    eval_interval: int = field(default=100, metadata={"help": "evaluate every N steps and after the last (train, "
        "distill: also before the first)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_ints(self, ["eval_interval"], 1)


@dataclass
class EvalLength(Options):
    """The length of the evaluation's completions (train, distill, medusa, eagle)."""

    SECTION: ClassVar[Section] = EVALUATION
    eval_max_new_tokens: int = field(default=64, metadata={"help": "new tokens per prompt in the evaluation (train, "
        "distill: also caps the reference tokens of the AR validation loss)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_ints(self, ["eval_max_new_tokens"], 1)


@dataclass
class EvalCount(Options):
    """How many held-out prompts the evaluation takes (train, medusa, eagle)."""

    SECTION: ClassVar[Section] = EVALUATION
    eval_count: int = field(default=16, metadata={"help": "evaluate on the first N held-out prompts (0: no "
        "evaluation)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_ints(self, ["eval_count"], 0)


# collection


@dataclass
class Collection(Options):
    """How Jacobi trajectories are collected (collect, distill)."""

    SECTION: ClassVar[Section] = COLLECTION
    block_size: int = field(default=16, metadata={"help": "Jacobi block size n (tokens per block) of the "
        "trajectories"})
    guess: Guess = field(default="prompt", metadata={"help": "initial guess of a block: tokens sampled from the "
        "prompt (the reference), repeat the last token, random vocab, or lookup (what followed the same n-gram "
        "earlier)"})
    drop_loops: bool = field(default=False, metadata={"help": "drop a prompt's blocks from the first one where its "
        "text ends in a loop (the last 16 tokens repeat a pattern of at most 8), so that no loop is a consistency "
        "target: for on-policy rounds, whose fixed points are the CLLM's own repetitions (distill: its rounds 2+)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_ints(self, ["block_size"], 1)
        if self.guess not in ("prompt", "repeat", "random", "lookup"):
            raise UserError(f"guess must be prompt, repeat, random or lookup, got {self.guess!r}")


# machine


@dataclass
class DecodeBatch(Options):
    """Prompts per decoding forward (collect, drafts)."""

    SECTION: ClassVar[Section] = MACHINE
    batch_size: int = field(default=8, metadata={"help": "prompts per forward pass (left padding)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_ints(self, ["batch_size"], 1)


# medusa and eagle


@dataclass
@retune(max_prompts=512, lr=3e-3, eval_max_new_tokens=128)
class DrafterOptions(Model, PromptSet, Resume, Force, Seed, Training, Decay, EvalLength, EvalCount, Dtype, Machine):
    """What `cllm medusa` and `cllm eagle` share: a drafter trained on its frozen model's own
    greedy text; each names its own steps, warm-up and tree."""

    SECTION: ClassVar[Section] = TRAINING
    data: str | None = field(default=None, metadata={"section": MODEL_DATA, "help": "train on the fixed points of "
        "this `cllm collect` directory (collected with this model) instead of decoding --prompts"})
    holdout: int = field(default=16, metadata={"section": MODEL_DATA, "help": "the last N texts are not trained on: "
        "the held-out loss (medusa: and the accuracies that shape the tree); a warning when fewer texts than this are "
        "left to train on"})
    out: str | None = field(default=None, metadata={"section": RUN, "help": "the drafter's folder (default: "
        "MODEL/medusa or MODEL/eagle, where decoding finds it); medusa --joint: the new checkpoint's folder (its "
        "heads in OUT/medusa)"})
    max_steps: int = field(kw_only=True, metadata={"help": "optimizer steps", "aliases": ["steps"]})
    warmup: int = field(kw_only=True, metadata={"help": "warm-up steps"})
    top_k: int = field(kw_only=True, metadata={"section": TREE, "help": "tokens the candidate tree considers per "
        "draft position: ranks per head, measured for the tree (medusa), or children per node and nodes expanded per "
        "level (eagle); the saved default"})
    tree_nodes: int = field(kw_only=True, metadata={"section": TREE, "help": "draft tokens verified per forward "
        "besides the root: the saved default tree's (each fed token costs on a CPU; a GPU affords more)"})
    eval_prompts: str = field(default=AUTO, metadata={"section": EVALUATION, "help": "held-out prompts of the final "
        "evaluation (greedy vs the drafter, batch 1): a prompt set, or 'auto': humaneval for a model with the "
        "embedded target's tokenizer (the stdlib domain), else the prompts of the --holdout texts"})
    eval_every: int = field(default=50, metadata={"section": EVALUATION, "help": "held-out loss and a checkpoint "
        "every N steps"})
    decode_batch_size: int = field(default=16, metadata={"section": MACHINE, "help": "prompts per forward when "
        "decoding the training text"})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_ints(self, ["decode_batch_size", "holdout", "max_steps", "top_k", "eval_every"], 1)
        check_ints(self, ["warmup", "tree_nodes"], 0)
        if self.max_prompts is not None and self.max_prompts <= self.holdout:
            raise UserError(f"--holdout {self.holdout} leaves no prompt of --max-prompts {self.max_prompts} "
                            "to train on")
