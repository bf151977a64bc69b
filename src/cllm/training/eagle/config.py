"""`cllm eagle`'s settings (`EagleConfig`: what it adds to `DrafterOptions`, validated on
construction) and the files a run writes in its head folder."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from cllm.core.config import Section, retune
from cllm.core.errors import UserError
from cllm.core.options import check_ints
from cllm.decoding.rivals.defaults import EAGLE_DEPTH as DEFAULT_DEPTH
from cllm.decoding.rivals.defaults import EAGLE_NODES as DEFAULT_NODES
from cllm.decoding.rivals.defaults import EAGLE_TOP_K as DEFAULT_TOP_K
from cllm.modeling.names import EAGLE_CONFIG_FILE as CONFIG_FILE
from cllm.modeling.names import EAGLE_DRAFT_CONFIG_FILE as DRAFT_CONFIG_FILE
from cllm.modeling.names import EAGLE_WEIGHTS_FILE as WEIGHTS_FILE
from cllm.training.options import EAGLE, TREE, DrafterOptions

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
@retune(max_steps=400, batch_size=6, warmup=30, top_k=DEFAULT_TOP_K, tree_nodes=DEFAULT_NODES)
class EagleConfig(DrafterOptions):
    SECTION: ClassVar[Section] = EAGLE
    w_cls: float = field(default=0.1, metadata={"help": "weight of the classification term (KL from the model's "
        "next-token distribution to the LM head on the predicted feature) beside the feature regression "
        "(SmoothL1); EAGLE: 0.1"})
    noise: float = field(default=0.2, metadata={"help": "width of the uniform noise added to the input features while "
        "training, so the head tolerates its own errors when it drafts from predicted features (EAGLE: 0.2, i.e. "
        "U(-0.1, 0.1)); 0: none"})
    tree_depth: int = field(default=DEFAULT_DEPTH, metadata={"section": TREE, "help": "draft levels, the head's "
        "forwards per step: the saved default"})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_ints(self, ["tree_depth"], 1)
        for name in ("w_cls", "noise"):
            if not getattr(self, name) >= 0:
                raise UserError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
