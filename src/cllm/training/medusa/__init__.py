"""Medusa heads' training, all of it (the heads' module is `cllm.modeling.heads`, their loader
`cllm.models.load_heads`, their decoding `cllm.decoding.rivals.medusa`, their training text
`cllm.training.texts`, shared with EAGLE and re-exported here):

- `config`: `MedusaConfig` (`cllm medusa`'s settings) and the files a run writes;
- `loss`: the Medusa-1 self-distillation loss, pure functions of tensors;
- `trainer`: `HeadsTrainer` (AdamW on the heads alone), `train_heads`, `measure_accuracies`,
  `save_heads`;
- `run`: `medusa`, the command: Medusa's hooks on the drafters' shared steps (`cllm.training.drafter`);
- `joint`: `JointTrainer` (Medusa-2: the model trained with its heads, two optimizers);
- `medusa2`: `medusa2`, `cllm medusa --joint` as named steps (a new checkpoint with its heads,
  measured against the original).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cllm.core.lazy import lazy_exports

__all__ = [
    "HeadsTrainer",
    "JointLoss",
    "JointTrainer",
    "MedusaConfig",
    "MedusaResult",
    "Text",
    "agreement",
    "backbone_terms",
    "base_model_meta",
    "check_out_dir",
    "evaluate_heads",
    "greedy_texts",
    "hidden_states",
    "joint_loss",
    "measure_accuracies",
    "medusa",
    "medusa2",
    "medusa_loss",
    "medusa_terms",
    "pad_batch",
    "save_heads",
    "texts_from_trajectories",
    "train_heads",
]

# module -> the public names it defines, imported on first use (`cllm.core.lazy`)
_MODULES = {
    "cllm.training.medusa.config": ["MedusaConfig"],
    "cllm.training.medusa.joint": ["JointTrainer"],
    "cllm.training.medusa.loss": ["JointLoss", "agreement", "backbone_terms", "joint_loss", "medusa_loss",
                                  "medusa_terms"],
    "cllm.training.medusa.medusa2": ["medusa2"],
    "cllm.training.medusa.run": ["MedusaResult", "check_out_dir", "evaluate_heads", "medusa"],
    "cllm.training.texts": ["Text", "greedy_texts", "hidden_states", "texts_from_trajectories"],
    "cllm.training.medusa.trainer": ["HeadsTrainer", "measure_accuracies", "pad_batch", "save_heads",
                                     "train_heads"],
    "cllm.training.drafter": ["base_model_meta"],
}

if TYPE_CHECKING:
    from cllm.training.drafter import base_model_meta
    from cllm.training.medusa.config import MedusaConfig
    from cllm.training.medusa.joint import JointTrainer
    from cllm.training.medusa.loss import JointLoss, agreement, backbone_terms, joint_loss, medusa_loss, medusa_terms
    from cllm.training.medusa.medusa2 import medusa2
    from cllm.training.medusa.run import MedusaResult, check_out_dir, evaluate_heads, medusa
    from cllm.training.medusa.trainer import (
        HeadsTrainer,
        measure_accuracies,
        pad_batch,
        save_heads,
        train_heads,
    )
    from cllm.training.texts import Text, greedy_texts, hidden_states, texts_from_trajectories

lazy_exports(__name__, {name: module for module, names in _MODULES.items() for name in names})
