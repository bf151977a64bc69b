"""`cllm medusa`'s settings (`MedusaConfig`, validated on construction) and the files a run
writes in its heads folder (Medusa-1) or its checkpoint folder (`--joint`, Medusa-2)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from cllm.core.errors import UserError
from cllm.decoding.rivals.defaults import MEDUSA_NODES as DEFAULT_NODES
from cllm.decoding.rivals.defaults import MEDUSA_TOP_K as DEFAULT_TOP_K
from cllm.modeling.names import MEDUSA_CONFIG_FILE as CONFIG_FILE
from cllm.modeling.names import MEDUSA_WEIGHTS_FILE as WEIGHTS_FILE

TRAIN_CONFIG = "medusa_train_config.json"
LOG = "medusa_log.jsonl"
CHECKPOINT = "checkpoint.pt"
TEXTS = "texts.jsonl"  # the training texts while a run is unfinished (a resume reuses them)
EVALUATION = "evaluation.json"
# every file a run writes in its folder: nothing else may be there
RUN_FILES = {CONFIG_FILE, WEIGHTS_FILE, TRAIN_CONFIG, LOG, CHECKPOINT, TEXTS, EVALUATION}
CARD = "MODEL_CARD.md"  # --joint: the fine-tuned checkpoint's card
# --joint: what a run writes in its checkpoint folder besides the model's and tokenizer's own files
# (`save_pretrained`) and the heads' subfolder
JOINT_RUN_FILES = {TRAIN_CONFIG, LOG, CHECKPOINT, TEXTS, EVALUATION, CARD}
# options that may change between a checkpoint and its resumption
RESUME_FREE = {"eval_prompts", "eval_count", "eval_max_new_tokens", "quality_count", "tree_nodes", "top_k", "threads",
               "device", "force", "resume", "out", "decode_batch_size"}
AUTO = "auto"  # --eval-prompts: HumanEval for a model of the stdlib domain, else the held-out texts


@dataclass
class MedusaConfig:
    model: str = field(default="stdlib-coder", metadata={"help": "the model the heads are for (shipped name or local "
        "checkpoint dir); it stays frozen, unless --joint"})
    heads: int = field(default=4, metadata={"help": "number of heads K: head k guesses the token k + 1 positions "
        "ahead"})
    own_projection: bool = field(default=False, metadata={"help": "give each head its own vocabulary projection (a "
        "trained copy of the LM head, V x H parameters each) instead of sharing the model's frozen LM head"})
    prompts: str = field(default="stdlib-train", metadata={"help": "prompts whose greedy continuations are the "
        "training text: stdlib-train, stdlib-val, humaneval, or a JSONL/Parquet file (not the prompts you benchmark "
        "on)"})
    max_prompts: int | None = field(default=512, metadata={"help": "use the first N prompts of the set"})
    data: str | None = field(default=None, metadata={"help": "train on the fixed points of this `cllm collect` "
        "directory (collected with this model) instead of decoding --prompts"})
    max_new_tokens: int = field(default=128, metadata={"help": "greedy tokens decoded per training prompt"})
    decode_batch_size: int = field(default=16, metadata={"help": "prompts per forward when decoding the training text"})
    holdout: int = field(default=16, metadata={"help": "the last N texts are not trained on: held-out loss and the "
        "accuracies that shape the tree (a warning when fewer texts than this are left to train on)"})
    max_steps: int = field(default=300, metadata={"help": "optimizer steps", "aliases": ["steps"]})
    batch_size: int = field(default=8, metadata={"help": "texts per step (every position of each counts)"})
    lr: float = field(default=3e-3, metadata={"help": "peak learning rate (AdamW), linear warm-up then cosine decay to "
        "0 (3e-3 beat 1e-3 on stdlib-coder: held-out head-1 agreement 0.48 vs 0.38 after 300 steps)"})
    warmup: int = field(default=20, metadata={"help": "warm-up steps"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    loss: Literal["soft", "hard"] = field(default="soft", metadata={"help": "soft: KL to the model's own distribution "
        "k positions on (Medusa's self-distillation); hard: cross-entropy on its greedy token there"})
    head_decay: float = field(default=0.8, metadata={"help": "head k's loss weight is this to the power k - 1 (Medusa: "
        "0.8)"})
    top_k: int = field(default=DEFAULT_TOP_K, metadata={"help": "ranks per head measured and considered for the "
        "candidate tree"})
    tree_nodes: int = field(default=DEFAULT_NODES, metadata={"help": "candidate tree nodes verified per forward "
        "besides the root: the saved default tree (each fed token costs on a CPU; a GPU affords 60+)"})
    eval_prompts: str = field(default=AUTO, metadata={"help": "held-out prompts of the final evaluation (greedy vs "
        "Medusa, batch 1): a prompt set, or 'auto': humaneval for a model with the embedded target's tokenizer (the "
        "stdlib domain), else the prompts of the --holdout texts"})
    eval_count: int = field(default=8, metadata={"help": "evaluate on the first N of them (0: no evaluation)"})
    eval_max_new_tokens: int = field(default=128, metadata={"help": "new tokens per evaluation prompt"})
    eval_every: int = field(default=50, metadata={"help": "held-out loss and a checkpoint every N steps"})
    joint: bool = field(default=False, metadata={"help": "Medusa-2: train the model together with its heads "
        "(after --warmup-heads steps of heads alone), on KL(original || model) at every position + --heads-weight x "
        "the heads' loss; the model changes, so it is saved as a new checkpoint in --out (required) with its heads "
        "in OUT/medusa, and its greedy text is compared with the original's"})
    warmup_heads: int = field(default=100, metadata={"help": "--joint: the first N steps train the heads alone, the "
        "model frozen (Medusa-2's warm-up: fresh heads' gradients would otherwise disturb the model)"})
    backbone_lr: float = field(default=1e-4, metadata={"help": "--joint: the model's peak learning rate (AdamW, "
        "warm-up then cosine over the joint steps); kept small, the KL to the original holds the model's text"})
    heads_weight: float = field(default=0.2, metadata={"help": "--joint: lambda, the heads' loss weight beside the "
        "model's KL to the original (Medusa-2: 0.2)"})
    init_heads: str | None = field(default=None, metadata={"help": "--joint: start from these heads of the model "
        "(a heads folder, or a checkpoint whose medusa/ holds them: its Medusa-1 heads) instead of fresh ones, so "
        "the warm-up can be short or none"})
    quality_count: int = field(default=64, metadata={"help": "--joint: the first N prompts of the evaluation set "
        "whose greedy text is compared with the original model's (loop, degenerate, parse rates, agreement)"})
    out: str | None = field(default=None, metadata={"help": "heads folder (default: MODEL/medusa, found there by "
        "load_heads); with --joint, the new checkpoint's folder (its heads in OUT/medusa)"})
    force: bool = field(default=False, metadata={"help": "replace heads already in --out (a finished run); an "
        "unfinished run resumes without it"})
    resume: bool = field(default=True, metadata={"help": "continue an unfinished run in --out from its checkpoint; "
        "false starts over"})
    seed: int = field(default=0, metadata={"help": "seed of the batch order"})
    dtype: str = field(default="float32", metadata={"help": "model (and heads) dtype"})
    device: str = field(default="cpu", metadata={"help": "torch device"})
    threads: int = field(default=0, metadata={"help": "torch CPU threads (0: torch's default)"})

    def __post_init__(self) -> None:
        for name in ("heads", "max_new_tokens", "decode_batch_size", "holdout", "max_steps", "batch_size", "top_k",
                     "eval_max_new_tokens", "eval_every"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be an int >= 1, got {getattr(self, name)!r}")
        for name in ("warmup", "tree_nodes", "eval_count", "threads", "warmup_heads", "quality_count"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise UserError(f"--{name.replace('_', '-')} must be an int >= 0, got {getattr(self, name)!r}")
        if self.max_prompts is not None and self.max_prompts < 1:
            raise UserError(f"--max-prompts must be >= 1, got {self.max_prompts}")
        if self.max_prompts is not None and self.max_prompts <= self.holdout:
            raise UserError(f"--holdout {self.holdout} leaves no prompt of --max-prompts {self.max_prompts} "
                            "to train on")
        if not self.lr > 0:
            raise UserError(f"--lr must be > 0, got {self.lr}")
        if not 0 < self.head_decay <= 1:
            raise UserError(f"--head-decay must be in (0, 1], got {self.head_decay}")
        if self.weight_decay < 0:
            raise UserError(f"--weight-decay must be >= 0, got {self.weight_decay}")
        if not self.backbone_lr > 0:
            raise UserError(f"--backbone-lr must be > 0, got {self.backbone_lr}")
        if not self.heads_weight >= 0:
            raise UserError(f"--heads-weight must be >= 0, got {self.heads_weight}")
        if self.init_heads and not self.joint:
            raise UserError("--init-heads is for --joint (Medusa-1 trains fresh heads)")
        if self.joint and not self.out:
            raise UserError("--joint changes the model: give --out, the folder of the new checkpoint")
