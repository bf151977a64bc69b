"""`cllm train`: consistency (GC / LC) + AR fine-tuning on collected trajectories
(`cllm.training.train`). Before the first step it says what it will do (records, steps, batch
size, the held-out set), after the first step how long the rest will take, and at the end what
it did; rank 0 alone prints.
"""

from __future__ import annotations

from cllm.core.progress import echo_log, is_main_process
from cllm.training.config import TrainConfig
from cllm.training.train import TrainSummary, train

Config = TrainConfig


def run(config: Config) -> int:
    """Train (or resume) the run in `config.out` and print its summary."""
    with echo_log():
        summary = train(config)
    if is_main_process():
        _print_summary(summary)
    return 0


def _print_summary(summary: TrainSummary) -> None:
    for line in summary.lines():
        print(line)
