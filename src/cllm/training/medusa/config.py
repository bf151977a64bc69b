"""`cllm medusa`'s settings (`MedusaConfig`: what it adds to `DrafterOptions`, validated on
construction) and the files a run writes in its heads folder (Medusa-1) or its checkpoint folder
(`--joint`, Medusa-2). `AUTO` is re-exported from `cllm.training.options`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from cllm.core.config import Section, retune
from cllm.core.errors import UserError
from cllm.core.options import check_ints
from cllm.decoding.rivals.defaults import MEDUSA_NODES as DEFAULT_NODES
from cllm.decoding.rivals.defaults import MEDUSA_TOP_K as DEFAULT_TOP_K
from cllm.modeling.names import MEDUSA_CONFIG_FILE as CONFIG_FILE
from cllm.modeling.names import MEDUSA_WEIGHTS_FILE as WEIGHTS_FILE
from cllm.training.options import MEDUSA, MEDUSA_2, DrafterOptions

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


# lr: DrafterOptions' 3e-3 (it trained better heads than 1e-3 on stdlib-coder)
@dataclass
@retune(max_steps=300, batch_size=8, warmup=20, eval_count=8, top_k=DEFAULT_TOP_K, tree_nodes=DEFAULT_NODES)
class MedusaConfig(DrafterOptions):
    SECTION: ClassVar[Section] = MEDUSA
    heads: int = field(default=4, metadata={"help": "number of heads K: head k guesses the token k + 1 positions "
        "ahead"})
    own_projection: bool = field(default=False, metadata={"help": "give each head its own vocabulary projection (a "
        "trained copy of the LM head, V x H parameters each) instead of sharing the model's frozen LM head"})
    loss: Literal["soft", "hard"] = field(default="soft", metadata={"help": "soft: KL to the model's own distribution "
        "k positions on (Medusa's self-distillation); hard: cross-entropy on its greedy token there"})
    head_decay: float = field(default=0.8, metadata={"help": "head k's loss weight is this to the power k - 1 (Medusa: "
        "0.8)"})
    joint: bool = field(default=False, metadata={"section": MEDUSA_2, "help": "Medusa-2: train the model together "
        "with its heads (after --warmup-heads steps of heads alone), on KL(original || model) at every position + "
        "--heads-weight x the heads' loss; the model changes, so it is saved as a new checkpoint in --out (required) "
        "with its heads in OUT/medusa, and its greedy text is compared with the original's"})
    warmup_heads: int = field(default=100, metadata={"section": MEDUSA_2, "help": "--joint: the first N steps train "
        "the heads alone, the model frozen (Medusa-2's warm-up: fresh heads' gradients would otherwise disturb the "
        "model)"})
    backbone_lr: float = field(default=1e-4, metadata={"section": MEDUSA_2, "help": "--joint: the model's peak "
        "learning rate (AdamW, warm-up then cosine over the joint steps); kept small, the KL to the original holds "
        "the model's text"})
    heads_weight: float = field(default=0.2, metadata={"section": MEDUSA_2, "help": "--joint: lambda, the heads' loss "
        "weight beside the model's KL to the original (Medusa-2: 0.2)"})
    init_heads: str | None = field(default=None, metadata={"section": MEDUSA_2, "help": "--joint: start from these "
        "heads of the model (a heads folder, or a checkpoint whose medusa/ holds them: its Medusa-1 heads) instead of "
        "fresh ones, so the warm-up can be short or none"})
    quality_count: int = field(default=64, metadata={"section": MEDUSA_2, "help": "--joint: the first N prompts of "
        "the evaluation set whose greedy text is compared with the original model's (loop, degenerate, parse rates, "
        "agreement)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_ints(self, ["heads"], 1)
        check_ints(self, ["warmup_heads", "quality_count"], 0)
        if not 0 < self.head_decay <= 1:
            raise UserError(f"--head-decay must be in (0, 1], got {self.head_decay}")
        if not self.backbone_lr > 0:
            raise UserError(f"--backbone-lr must be > 0, got {self.backbone_lr}")
        if not self.heads_weight >= 0:
            raise UserError(f"--heads-weight must be >= 0, got {self.heads_weight}")
        if self.init_heads and not self.joint:
            raise UserError("--init-heads is for --joint (Medusa-1 trains fresh heads)")
        if self.joint and not self.out:
            raise UserError("--joint changes the model: give --out, the folder of the new checkpoint")
