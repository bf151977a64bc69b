"""`cllm collect`: Jacobi-decode a prompt set with the target model and record every block's
trajectory (`cllm.training.collect`); rank 0 prints what the run did.
"""

from __future__ import annotations

from cllm.core.progress import echo_log, is_main_process
from cllm.training.collect import CollectConfig, CollectSummary, collect

Config = CollectConfig


def run(config: Config) -> int:
    """Collect (or resume collecting) into `config.out` and print the summary."""
    with echo_log():
        summary = collect(config)
    if is_main_process():
        _print_summary(summary)
    return 0


def _print_summary(summary: CollectSummary) -> None:
    for line in summary.lines():
        print(line)
