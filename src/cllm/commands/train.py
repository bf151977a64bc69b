"""`cllm train`: consistency (GC / LC) + AR fine-tuning on collected trajectories
(`cllm.training.train`). Before the first step it says what it will do (records, steps, batch
size, the held-out set), after the first step how long the rest will take, and at the end what
it did; rank 0 alone prints.
"""

from __future__ import annotations

from pathlib import Path

from cllm.core.outputs import removed_on_early_failure
from cllm.core.progress import echo_log, is_main_process
from cllm.training.config import TrainConfig
from cllm.training.run import CHECKPOINT
from cllm.training.train import TrainSummary, train

Config = TrainConfig


def run(config: Config) -> int:
    """Train (or resume) the run in `config.out` and print its summary. A first run that fails
    before its first checkpoint leaves no folder behind."""
    with echo_log(), removed_on_early_failure(config.out, "train", useful=_resumable):
        summary = train(config)
    if is_main_process():
        _print_summary(summary)
    return 0


def _resumable(out: Path) -> bool:
    """What a rerun would resume from (a checkpoint) or keep (the trained model)."""
    return (out / CHECKPOINT).exists() or any(out.glob("*.safetensors"))


def _print_summary(summary: TrainSummary) -> None:
    for line in summary.lines():
        print(line)
