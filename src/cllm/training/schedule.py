"""The learning-rate schedule of every training loop here (pretrain, train, the drafters): linear
warm-up, then cosine decay to a floor."""

from __future__ import annotations

import math

import torch


def lr_factor(step: int, total: int, warmup: int, floor: float = 0.0) -> float:
    """The fraction of the peak learning rate at `step`: linear warm-up to 1 over `warmup` steps,
    then cosine decay to `floor` at `total` steps."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def warmup_cosine(optimizer: torch.optim.Optimizer, total: int, warmup: int,
                  floor: float = 0.0) -> torch.optim.lr_scheduler.LambdaLR:
    """`lr_factor` as the optimizer's scheduler (stepped once per optimizer step)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total, warmup, floor))
