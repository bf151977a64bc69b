"""Medusa heads' training, all of it (the heads' module is `cllm.modeling.heads`, their loader
`cllm.models.load_heads`, their decoding `cllm.decoding.rivals.medusa`):

- `config`: `MedusaConfig` (`cllm medusa`'s settings) and the files a run writes;
- `texts`: the training text, the model's own greedy output, and its hidden states;
- `loss`: the Medusa-1 self-distillation loss, pure functions of tensors;
- `trainer`: `HeadsTrainer` (AdamW on the heads alone), `train_heads`, `measure_accuracies`,
  `save_heads`;
- `run`: `medusa`, the command as named steps (texts, training, saving, evaluation).
"""

from cllm.training.medusa.config import MedusaConfig
from cllm.training.medusa.loss import agreement, medusa_loss, medusa_terms
from cllm.training.medusa.run import MedusaResult, check_out_dir, evaluate_heads, medusa
from cllm.training.medusa.texts import Text, greedy_texts, hidden_states, texts_from_trajectories
from cllm.training.medusa.trainer import (
    HeadsTrainer,
    base_model_meta,
    measure_accuracies,
    pad_batch,
    save_heads,
    train_heads,
)

__all__ = [
    "HeadsTrainer",
    "MedusaConfig",
    "MedusaResult",
    "Text",
    "agreement",
    "base_model_meta",
    "check_out_dir",
    "evaluate_heads",
    "greedy_texts",
    "hidden_states",
    "measure_accuracies",
    "medusa",
    "medusa_loss",
    "medusa_terms",
    "pad_batch",
    "save_heads",
    "texts_from_trajectories",
    "train_heads",
]
