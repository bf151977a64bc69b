"""`cllm eagle`'s settings (`EagleConfig`, validated on construction) and the files a run writes
in its head folder."""

from __future__ import annotations

from dataclasses import dataclass, field

from cllm.core.errors import UserError
from cllm.decoding.rivals.defaults import EAGLE_DEPTH as DEFAULT_DEPTH
from cllm.decoding.rivals.defaults import EAGLE_NODES as DEFAULT_NODES
from cllm.decoding.rivals.defaults import EAGLE_TOP_K as DEFAULT_TOP_K
from cllm.modeling.names import EAGLE_CONFIG_FILE as CONFIG_FILE
from cllm.modeling.names import EAGLE_DRAFT_CONFIG_FILE as DRAFT_CONFIG_FILE
from cllm.modeling.names import EAGLE_WEIGHTS_FILE as WEIGHTS_FILE
from cllm.training.medusa.config import AUTO

TRAIN_CONFIG = "eagle_train_config.json"
LOG = "eagle_log.jsonl"
CHECKPOINT = "checkpoint.pt"
TEXTS = "texts.jsonl"  # the training texts while a run is unfinished (a resume reuses them)
EVALUATION = "evaluation.json"
# every file a run writes in its folder: nothing else may be there
RUN_FILES = {CONFIG_FILE, WEIGHTS_FILE, DRAFT_CONFIG_FILE, TRAIN_CONFIG, LOG, CHECKPOINT, TEXTS, EVALUATION}
# options that may change between a checkpoint and its resumption
RESUME_FREE = {"eval_prompts", "eval_count", "eval_max_new_tokens", "tree_nodes", "tree_depth", "top_k", "threads",
               "device", "force", "resume", "out", "decode_batch_size"}


@dataclass
class EagleConfig:
    model: str = field(default="stdlib-coder", metadata={"help": "the model the head drafts for (shipped name or "
        "local checkpoint dir); it stays frozen"})
    prompts: str = field(default="stdlib-train", metadata={"help": "prompts whose greedy continuations are the "
        "training text: stdlib-train, stdlib-val, humaneval, or a JSONL/Parquet file (not the prompts you benchmark "
        "on)"})
    max_prompts: int | None = field(default=512, metadata={"help": "use the first N prompts of the set"})
    data: str | None = field(default=None, metadata={"help": "train on the fixed points of this `cllm collect` "
        "directory (collected with this model) instead of decoding --prompts"})
    max_new_tokens: int = field(default=128, metadata={"help": "greedy tokens decoded per training prompt"})
    decode_batch_size: int = field(default=16, metadata={"help": "prompts per forward when decoding the training text"})
    holdout: int = field(default=16, metadata={"help": "the last N texts are not trained on: the held-out loss"})
    max_steps: int = field(default=400, metadata={"aliases": ["steps"], "help": "optimizer steps (400 x 6 texts: "
        "9 min on one CPU thread for stdlib-coder)"})
    batch_size: int = field(default=6, metadata={"help": "texts per step (every position of each counts: prompt and "
        "completion)"})
    lr: float = field(default=3e-3, metadata={"help": "peak learning rate (AdamW), linear warm-up then cosine decay to "
        "0"})
    warmup: int = field(default=30, metadata={"help": "warm-up steps"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    w_cls: float = field(default=0.1, metadata={"help": "weight of the classification term (KL from the model's "
        "next-token distribution to the LM head on the predicted feature) beside the feature regression "
        "(SmoothL1); EAGLE: 0.1"})
    noise: float = field(default=0.2, metadata={"help": "width of the uniform noise added to the input features while "
        "training, so the head tolerates its own errors when it drafts from predicted features (EAGLE: 0.2, i.e. "
        "U(-0.1, 0.1)); 0: none"})
    tree_nodes: int = field(default=DEFAULT_NODES, metadata={"help": "draft tokens verified per forward besides the "
        "root: the saved default (each fed token costs on a CPU)"})
    tree_depth: int = field(default=DEFAULT_DEPTH, metadata={"help": "draft levels, the head's forwards per step: the "
        "saved default"})
    top_k: int = field(default=DEFAULT_TOP_K, metadata={"help": "nodes expanded per level and children per node: the "
        "saved default"})
    eval_prompts: str = field(default=AUTO, metadata={"help": "held-out prompts of the final evaluation (greedy vs "
        "EAGLE, batch 1): a prompt set, or 'auto': humaneval for a model with the embedded target's tokenizer (the "
        "stdlib domain), else the prompts of the --holdout texts"})
    eval_count: int = field(default=16, metadata={"help": "evaluate on the first N of them (0: no evaluation)"})
    eval_max_new_tokens: int = field(default=128, metadata={"help": "new tokens per evaluation prompt"})
    eval_every: int = field(default=50, metadata={"help": "held-out loss and a checkpoint every N steps"})
    out: str | None = field(default=None, metadata={"help": "head folder (default: MODEL/eagle, found there by "
        "load_eagle)"})
    force: bool = field(default=False, metadata={"help": "replace a head already in --out (a finished run); an "
        "unfinished run resumes without it"})
    resume: bool = field(default=True, metadata={"help": "continue an unfinished run in --out from its checkpoint; "
        "false starts over"})
    seed: int = field(default=0, metadata={"help": "seed of the head's initial weights, the batch order and the "
        "noise"})
    dtype: str = field(default="float32", metadata={"help": "model (and head) dtype"})
    device: str = field(default="cpu", metadata={"help": "torch device"})
    threads: int = field(default=0, metadata={"help": "torch CPU threads (0: torch's default)"})

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "decode_batch_size", "holdout", "max_steps", "batch_size", "tree_depth", "top_k",
                     "eval_max_new_tokens", "eval_every"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be an int >= 1, got {getattr(self, name)!r}")
        for name in ("warmup", "tree_nodes", "eval_count", "threads"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise UserError(f"--{name.replace('_', '-')} must be an int >= 0, got {getattr(self, name)!r}")
        if self.max_prompts is not None and self.max_prompts < 1:
            raise UserError(f"--max-prompts must be >= 1, got {self.max_prompts}")
        if self.max_prompts is not None and self.max_prompts <= self.holdout:
            raise UserError(f"--holdout {self.holdout} leaves no prompt of --max-prompts {self.max_prompts} "
                            "to train on")
        if not self.lr > 0:
            raise UserError(f"--lr must be > 0, got {self.lr}")
        for name in ("w_cls", "noise", "weight_decay"):
            if not getattr(self, name) >= 0:
                raise UserError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
