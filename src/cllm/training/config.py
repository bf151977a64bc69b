"""What `cllm train` and `cllm distill` are told: the training `Recipe` both share (each field,
default, help text and check declared once) and `TrainConfig`, the recipe plus what only
`cllm train` asks for (its data, the frozen teacher, LoRA's shape, resuming); and the settings of
`cllm pretrain`, `cllm collect` and `cllm drafts` (`PretrainConfig`, `CollectConfig`,
`DraftsConfig`). No torch here: a command's `--help` reads its config before anything heavy loads.

A nested dataclass's fields are flags of the command that holds it (`cllm.core.config`), and
`config_to_dict` flattens them, so train_config.json and the checkpoints stay flat. `cllm
distill`'s own defaults are one recipe value, `cllm.training.distill_config.DISTILL_RECIPE`.
Options that other commands take too (lr, seed, out, ...) are declared in `cllm.training.options`
and inherited; `retune` gives a command its own default for one.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

from cllm.core.config import Section, is_off, retune
from cllm.core.errors import UserError
from cllm.core.options import (
    EVALUATION,
    MACHINE,
    MODEL_DATA,
    RUN,
    AnyDevice,
    Dtype,
    Force,
    Machine,
    Model,
    Options,
    PromptSet,
    Resume,
    RunFolder,
    Seed,
)
from cllm.data.prompts import NAMED_SETS
from cllm.modeling.names import Distance
from cllm.models.names import SHIPPED
from cllm.runtime.choices import RUNTIME_HELP, RUNTIMES
from cllm.training.options import (
    COLLECTION,
    DRAFT_TABLE,
    LORA,
    MODEL_SHAPE,
    RECIPE,
    TRAINING,
    Checkpoints,
    Collection,
    Decay,
    DecodeBatch,
    EvalCount,
    EvalInterval,
    EvalLength,
    GradClip,
    TextField,
    Training,
)

Consistency = Literal["gc", "lc", "gc+lc"]
ArTarget = Literal["auto", "labels", "fixed_points", "both"]

STDLIB_EVAL = "stdlib-val"  # the held-out set of the shipped models' domain (Python's standard library)
NO_EVAL_PROMPTS = "no --eval-prompts"  # how the line saying a run has no held-out set begins

_CHOICES = {"consistency": ("gc", "lc", "gc+lc"), "distance": ("fkl", "rkl", "jsd", "argmax"),
            "state_schedule": ("uniform", "progressive"), "select": ("last", "gated"),
            "rollout_policy": ("model", "teacher"), "layout": ("records", "packed"),
            "kd_distance": ("fkl", "rkl", "jsd", "argmax"), "consistency_teacher": ("model", "target"),
            "ar_target": ("auto", "labels", "fixed_points", "both"), "dtype": ("float32", "bfloat16")}


def _check_positive(config, names: list[str]) -> None:
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UserError(f"{name.replace('_', '-')} must be a positive integer, got {value!r}")


@dataclass
class Recipe(Training, Seed, Checkpoints, EvalInterval, EvalLength):
    """How a CLLM is trained: the losses and their weights, the states and rows they count on,
    the optimizer, the training length and the held-out evaluation along the way."""

    SECTION: ClassVar[Section] = RECIPE

    consistency: Consistency = field(default="gc", metadata={"help": "consistency loss: global (GC, the reference), "
        "local (LC), or both"})
    distance: Distance = field(default="fkl", metadata={"help": "distance of the consistency loss: forward KL "
        "(the reference), reverse KL, JSD, or argmax (cross-entropy on the target's argmax)"})
    ar_weight: float = field(default=10.0, metadata={"help": "weight w of the AR loss in consistency + w * AR "
        "(reference 10)"})
    ar_target: ArTarget = field(default="auto", metadata={"help": "AR rows: the ground truth (labels), the target's "
        "fixed points, both, or auto (labels when the trajectories' prompts had references, else fixed points)"})
    ar_text: str | None = field(default=None, metadata={"help": "AR loss also on random windows of this text: "
        "'stdlib-train' (the embedded corpus), a UTF-8 text file of your domain, or 'none'; keeps language modelling "
        "over whole contexts, not only the prompts' continuations"})
    ar_text_windows: int = field(default=8, metadata={"help": "text windows per step (with --ar-text)"})
    ar_text_length: int = field(default=256, metadata={"help": "tokens per text window (with --ar-text)"})
    label_smoothing: float = field(default=0.1, metadata={"help": "label smoothing of the AR loss (reference 0.1)"})
    kd_weight: float = field(default=0.0, metadata={"help": "weight of a distillation term D(teacher || model) on the "
        "AR rows (labels / fixed points / text windows, as --ar-target and --ar-text choose) and on --rollout-prompts: "
        "soft labels from the frozen teacher, in place of (--ar-weight 0) or beside the hard AR term"})
    kd_distance: Distance = field(default="fkl", metadata={"help": "distance of the distillation term: forward "
        "KL(teacher || model), reverse KL, JSD, or argmax (cross-entropy on the teacher's argmax: what greedy decoding "
        "keeps)"})
    consistency_teacher: Literal["model", "target"] = field(default="model", metadata={"help": "whose logits on the "
        "fixed point (GC) or next state (LC) the states learn: the model being trained, stop-gradient (the reference), "
        "or the frozen teacher"})
    rollout_prompts: int = field(default=0, metadata={"help": "on-policy distillation: per step, this many of the "
        "records' prompts are continued by the model being trained and the distillation term also counts on its text "
        "(GKD; needs --kd-weight)"})
    rollout_tokens: int = field(default=128, metadata={"help": "new tokens per rollout"})
    rollout_temperature: float = field(default=0.0, metadata={"help": "0: greedy rollouts; > 0: sampled at this "
        "temperature"})
    rollout_policy: Literal["model", "teacher"] = field(default="model", metadata={"help": "who writes the rollouts: "
        "the model being trained (on-policy, GKD) or the frozen teacher (its own continuations, e.g. sampled at a low "
        "temperature as Medusa-2's self-distillation data)"})
    warmup_ratio: float = field(default=0.03, metadata={"section": TRAINING, "help": "linear warm-up over this "
        "fraction of the steps, then cosine decay to 0"})
    epochs: int | None = field(default=None, metadata={"section": TRAINING, "help": "passes over the records; give "
        "this or --max-steps, not both (default: 1 without --max-steps)"})
    max_steps: int | None = field(default=None, metadata={"section": TRAINING, "help": "optimizer steps, in place of "
        "--epochs (default: none: the epochs decide)"})
    micro_batch_size: int | None = field(default=None, metadata={"section": TRAINING, "help": "records (--layout "
        "packed: prompts) per forward (gradient accumulation); default batch-size / processes"})
    dtype: Literal["float32", "bfloat16"] = field(default="float32", metadata={"section": MACHINE, "help": "bfloat16: "
        "the forwards in bf16 (autocast; weights, optimizer and checkpoint stay float32); under FSDP and DeepSpeed "
        "their bf16 mixed precision (DeepSpeed: bf16 weights beside float32 master weights)"})
    lora: bool = field(default=False, metadata={"section": LORA, "help": "train a LoRA adapter (peft) instead of all "
        "weights; merged into the saved checkpoint"})
    gc_window: int | None = field(default=None, metadata={"help": "GC counts only this many positions after the first "
        "wrong one (default: all, the reference)"})
    state_schedule: Literal["uniform", "progressive"] = field(default="uniform", metadata={"help": "which states of a "
        "record train: uniformly drawn (the reference), or Jacobi Forcing's progressive schedule: block j of a prompt "
        "aims at noise linspace(0, 1, 16)[j mod 16] (noise = the fraction of the block's tokens not yet at the fixed "
        "point) and takes the states nearest to it"})
    skip_copies: bool = field(default=False, metadata={"help": "consistency counts no position whose target equals one "
        "of the two state tokens before it while that token is wrong: copying a wrong input token forward is the "
        "shortcut that teaches repetition"})
    cut_loops: bool = field(default=False, metadata={"help": "consistency counts no fixed-point token that continues a "
        "loop (the text up to it ends in a pattern of at most 8 tokens repeated over 24): an on-policy round's own "
        "repetitions are cut out of its targets, the rest of the prompt kept (distill: rounds 2+; use with "
        "--drop-loops false)"})
    layout: Literal["records", "packed"] = field(default="records", metadata={"help": "how a micro-batch's forward "
        "is laid out: records (each record's prefix once, its states after it) or packed (Jacobi Forcing's: one "
        "sequence per prompt, its clean text, the prompt and every fixed point, once, then the state blocks of all its "
        "records, each attending to the prompt, the fixed points before its block and itself); packed draws whole "
        "prompts, so --batch-size and --micro-batch-size count prompts"})
    states_per_record: int = field(default=1, metadata={"help": "distinct states sampled per record and step; they "
        "share one forward of the record's prefix, so k states cost far less than k records"})
    eval_prompts: str | None = field(default=None, metadata={"section": EVALUATION, "help": "held-out prompt set "
        "(name or JSONL/Parquet file) to evaluate on (default: stdlib-val when the model is a shipped one or the "
        "prompts a named set; else train evaluates on none and distill on the last --eval-count of --prompts, held "
        "out of collection)"})
    eval_batch_size: int = field(default=8, metadata={"section": EVALUATION, "help": "prompts per batch in the "
        "evaluation"})
    select: Literal["last", "gated"] = field(default="last", metadata={"section": EVALUATION, "help": "which weights "
        "training ends with: the last step's, or (gated) those of the evaluation with the most Jacobi tokens per "
        "forward over non-looping completions among those whose greedy completions loop at most 5 points more often "
        "than the target's and degenerate at most 3% of the time (the last step's when none passes)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive(self, ["eval_batch_size", "states_per_record", "ar_text_windows", "ar_text_length",
                               "rollout_tokens"]
                        + [n for n in ("epochs", "max_steps", "micro_batch_size", "gc_window")
                           if getattr(self, n) is not None])
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise UserError(f"{name.replace('_', '-')} must be one of {', '.join(allowed)}, got "
                                f"{getattr(self, name)!r}")
        if self.epochs is not None and self.max_steps is not None:
            raise UserError(f"give --epochs ({self.epochs}) or --max-steps ({self.max_steps}), not both")
        if self.micro_batch_size is not None and self.batch_size % self.micro_batch_size:
            raise UserError(f"batch-size {self.batch_size} is not a multiple of micro-batch-size "
                            f"{self.micro_batch_size}")
        for name in ("ar_weight", "kd_weight", "rollout_temperature"):
            if not getattr(self, name) >= 0:
                raise UserError(f"{name.replace('_', '-')} must be >= 0, got {getattr(self, name)!r}")
        if not 0 <= self.label_smoothing < 1 or not 0 <= self.warmup_ratio < 1:
            raise UserError("label-smoothing and warmup-ratio must be in [0, 1)")
        if self.rollout_prompts < 0:
            raise UserError("rollout-prompts must be >= 0")
        if self.rollout_prompts and not self.kd_weight:
            raise UserError("--rollout-prompts needs --kd-weight > 0: the rollouts are scored by the teacher")
        if is_off(self.ar_text):
            self.ar_text = None

    def total_steps(self, steps_per_epoch: int) -> int:
        """The optimizer steps of the whole run: --max-steps, or --epochs (1 by default) passes."""
        return self.max_steps or (self.epochs or 1) * steps_per_epoch

    @property
    def uses_gc(self) -> bool:
        return self.consistency in ("gc", "gc+lc")

    @property
    def uses_lc(self) -> bool:
        return self.consistency in ("lc", "gc+lc")

    @property
    def uses_ar_rows(self) -> bool:
        """The AR rows are computed: the hard AR term or the distillation term counts on them."""
        return self.ar_weight > 0 or self.kd_weight > 0

    @property
    def ar_on_fixed_points(self) -> bool:
        return self.uses_ar_rows and self.ar_target in ("fixed_points", "both")

    @property
    def ar_on_labels(self) -> bool:
        return self.uses_ar_rows and self.ar_target in ("labels", "both")

    @property
    def needs_teacher(self) -> bool:
        return self.kd_weight > 0 or self.consistency_teacher == "target"


@dataclass
class WithRecipe(Options):
    """A training `Recipe`, its fields flags of their own (train, distill)."""

    recipe: Recipe = field(default_factory=Recipe)


@dataclass
@retune(out="runs/cllm")
class TrainConfig(Model, RunFolder, Resume, WithRecipe, Decay, GradClip, EvalCount, TextField):
    SECTION: ClassVar[Section] = MODEL_DATA
    data: str = field(default="runs/trajectories", metadata={"help": "trajectory directory written by `cllm collect` "
        "with --model (or --teacher); training starts from --model"})
    teacher: str | None = field(default=None, metadata={"help": "the frozen model of --kd-weight and "
        "--consistency-teacher target (default: --model; with LoRA and no --teacher, the model with its adapter "
        "disabled); trajectories collected with it are accepted too"})
    stop_at_step: int | None = field(default=None, metadata={"section": RUN, "help": "stop (with a checkpoint) once "
        "this step is reached; rerun without it to continue"})
    eval_block_size: int | None = field(default=None, metadata={"section": EVALUATION, "help": "Jacobi block size of "
        "the evaluation (default: the data's)"})
    augmented: bool = field(default=False, metadata={"section": RECIPE, "help": "GC also samples the augmented states "
        "of the data (GC only)"})
    lora_r: int = field(default=16, metadata={"section": LORA, "help": "LoRA rank"})
    lora_alpha: int = field(default=32, metadata={"section": LORA, "help": "LoRA alpha"})
    lora_dropout: float = field(default=0.0, metadata={"section": LORA, "help": "LoRA dropout"})
    lora_targets: str = field(default="all-linear", metadata={"section": LORA, "help": "LoRA target modules: "
        "all-linear or comma-separated module names"})
    gradient_checkpointing: bool = field(default=False, metadata={"section": MACHINE, "help": "recompute each layer's "
        "activations in backward (transformers' gradient checkpointing): far less activation memory, about a third "
        "more compute, and each state row then recomputes its record's prefix (no shared KV cache)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive(self, ["lora_r", "lora_alpha"] + [n for n in ("eval_block_size", "stop_at_step")
                                                          if getattr(self, n) is not None])
        if not 0 <= self.lora_dropout < 1:
            raise UserError("lora-dropout must be in [0, 1)")
        if self.augmented and self.recipe.consistency != "gc":
            raise UserError("augmented states break the adjacency LC needs: use --augmented only with --consistency gc")
        if not self.data:
            raise UserError("data must name a directory")


def one_length(values: dict) -> dict:
    """A config as a flat dict, its training length in one form: --max-steps, or --epochs (1 when
    neither is given). Runs written before the two were exclusive carried epochs beside
    max_steps, which overrode them: what they ran is what this compares."""
    steps = values.get("max_steps")
    return {**values, "epochs": None if steps is not None else values.get("epochs") or 1}


def with_one_length(config: TrainConfig) -> TrainConfig:
    """`config` with its training length in `one_length`'s form."""
    recipe = config.recipe
    epochs = None if recipe.max_steps is not None else recipe.epochs or 1
    return dataclasses.replace(config, recipe=dataclasses.replace(recipe, epochs=epochs))


def is_shipped(model: str) -> bool:
    """`model` names or is the folder of a shipped model (the stdlib domain's)."""
    if model in SHIPPED:
        return True
    path = Path(model).expanduser()
    return path.is_dir() and any(path.resolve() == p.resolve() for p in SHIPPED.values())


def default_eval_set(model: str, prompts: str | None) -> str | None:
    """The held-out set of a run given no --eval-prompts: stdlib-val when the run is in the
    shipped models' domain (a shipped model, or prompts from a named set), else None."""
    return STDLIB_EVAL if is_shipped(model) or prompts in NAMED_SETS else None


@dataclass
@retune(out="runs/pretrain-stdlib-coder", lr=2e-3, batch_size=8, weight_decay=0.1, checkpoint_interval=200)
class PretrainConfig(RunFolder, Resume, Seed, Checkpoints, Training, Decay, GradClip, EvalInterval, AnyDevice):
    SECTION: ClassVar[Section] = MODEL_SHAPE
    vocab_size: int = field(default=8192, metadata={"help": "BPE vocabulary size, <|endoftext|> included"})
    tokenizer: str | None = field(default=None, metadata={"help": "reuse this checkpoint's tokenizer instead of "
        "training one (a draft model must share its target's; its size must equal --vocab-size)"})
    width: int = field(default=256, metadata={"help": "hidden size"})
    layers: int = field(default=4, metadata={"help": "number of transformer blocks"})
    heads: int = field(default=4, metadata={"help": "attention heads (width must divide evenly)"})
    mlp_width: int | None = field(default=None, metadata={"help": "SwiGLU hidden size; default 8/3 * width rounded up "
        "to 64"})
    context: int = field(default=512, metadata={"help": "training window length in tokens (= max positions)"})
    max_files: int | None = field(default=None, metadata={"section": MODEL_DATA, "help": "use only the first N files "
        "of each split (quick tests)"})
    save_dtype: Literal["float32", "bfloat16"] = field(default="float32", metadata={"section": RUN, "help": "dtype of "
        "the exported weights"})
    steps: int = field(default=3200, metadata={"section": TRAINING, "help": "optimizer steps"})
    min_lr: float = field(default=2e-4, metadata={"section": TRAINING, "help": "learning rate at the end of the "
        "cosine decay"})
    warmup_steps: int = field(default=100, metadata={"section": TRAINING, "help": "linear warm-up steps"})
    eval_batches: int = field(default=8, metadata={"section": EVALUATION, "help": "validation batches of batch_size "
        "windows"})
    bf16: bool = field(default=True, metadata={"section": MACHINE, "help": "bfloat16 autocast for the forward pass "
        "(weights and optimizer stay float32)"})
    threads: int = field(default=2, metadata={"section": MACHINE, "help": "torch CPU threads"})

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("vocab_size", "width", "layers", "heads", "context", "steps", "eval_batches", "threads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.width % self.heads:
            raise ValueError(f"width {self.width} is not divisible by heads {self.heads}")
        if self.vocab_size < 257:
            raise ValueError(f"vocab_size must be at least 257 (bytes + <|endoftext|>), got {self.vocab_size}")
        if not 0 < self.min_lr <= self.lr:
            raise ValueError(f"need 0 < min_lr <= lr, got min_lr={self.min_lr}, lr={self.lr}")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"warmup_steps must be in [0, steps), got {self.warmup_steps}")
        if self.mlp_width is None:
            self.mlp_width = math.ceil(self.width * 8 / 3 / 64) * 64
        if self.max_files is not None and self.max_files <= 0:
            raise ValueError(f"max_files must be positive, got {self.max_files}")


@dataclass
@retune(out="runs/trajectories")
class CollectConfig(Model, PromptSet, TextField, RunFolder, Seed, Collection, DecodeBatch, Dtype):
    SECTION: ClassVar[Section] = COLLECTION
    augment: bool = field(default=False, metadata={"help": "off by default; also store extra states made by copying "
        "the leftmost half of a state's wrong tokens from the fixed point (column augmented_states; states stay the "
        "true trajectory)"})
    shard_size: int = field(default=64, metadata={"section": RUN, "help": "prompts per Parquet shard (a prompt's "
        "records never span shards)"})
    runtime: Literal["auto", "transformers", "lean"] = field(default="auto", metadata={"section": MACHINE,
        "help": RUNTIME_HELP + " (speed only: the trajectories are the same)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.shard_size, int) or self.shard_size < 1:
            raise UserError(f"shard-size must be a positive integer, got {self.shard_size!r}")
        if self.runtime not in RUNTIMES:
            raise UserError(f"runtime must be one of {', '.join(RUNTIMES)}, got {self.runtime!r}")


@dataclass
@retune(model="stdlib-coder-cllm", batch_size=16)
class DraftsConfig(Model, PromptSet, Force, DecodeBatch, Dtype, Machine):
    SECTION: ClassVar[Section] = DRAFT_TABLE
    min_count: int = field(default=2, metadata={"help": "a context's next token is kept if the model wrote it there at "
        "least this often"})
    min_share: float = field(default=0.3, metadata={"help": "... and in at least this share of the context's "
        "occurrences"})
    out: str | None = field(default=None, metadata={"section": RUN, "help": "table file (default: "
        "MODEL/drafts/ngram.safetensors, found there by --draft-table auto)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.min_count, int) or self.min_count < 1:
            raise UserError(f"--min-count must be an int >= 1, got {self.min_count!r}")
        if not 0 < self.min_share <= 1:
            raise UserError(f"--min-share must be in (0, 1], got {self.min_share}")
