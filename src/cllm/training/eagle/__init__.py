"""EAGLE head training, all of it (the head's module is `cllm.modeling.eagle`, its loader
`cllm.models.load_eagle`, its decoding `cllm.decoding.rivals.eagle`):

- `config`: `EagleConfig` (`cllm eagle`'s settings) and the files a run writes;
- `loss`: EAGLE's loss (feature regression + classification), pure functions of tensors;
- `trainer`: `feature_runs` (the frozen model's features, via Medusa's texts), `EagleTrainer`,
  `train_eagle`, `save_eagle`;
- `run`: `eagle`, the command: EAGLE's hooks on the drafters' shared steps (`cllm.training.drafter`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cllm.core.lazy import lazy_exports

__all__ = [
    "EagleConfig",
    "EagleResult",
    "EagleTrainer",
    "FeatureRun",
    "check_out_dir",
    "eagle",
    "eagle_loss",
    "eagle_terms",
    "evaluate_eagle",
    "feature_runs",
    "new_head",
    "pad_runs",
    "save_eagle",
    "train_eagle",
]

# module -> the public names it defines, imported on first use (`cllm.core.lazy`)
_MODULES = {
    "cllm.training.eagle.config": ["EagleConfig"],
    "cllm.training.eagle.loss": ["eagle_loss", "eagle_terms"],
    "cllm.training.eagle.run": ["EagleResult", "check_out_dir", "eagle", "evaluate_eagle"],
    "cllm.training.eagle.trainer": ["EagleTrainer", "FeatureRun", "feature_runs", "new_head", "pad_runs",
                                    "save_eagle", "train_eagle"],
}

if TYPE_CHECKING:
    from cllm.training.eagle.config import EagleConfig
    from cllm.training.eagle.loss import eagle_loss, eagle_terms
    from cllm.training.eagle.run import EagleResult, check_out_dir, eagle, evaluate_eagle
    from cllm.training.eagle.trainer import (
        EagleTrainer,
        FeatureRun,
        feature_runs,
        new_head,
        pad_runs,
        save_eagle,
        train_eagle,
    )

lazy_exports(__name__, {name: module for module, names in _MODULES.items() for name in names})
