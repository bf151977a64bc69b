"""`cllm distill`: from a target model to a CLLM in one command (`cllm.training.distill`):
collect, train, evaluate target against CLLM on held-out prompts, build the CLLM's draft
table. Each stage's lines as it ends, then the evaluation: its table, the held-out set and the
measures it applied, a warning when the CLLM loops far more than its target, and the verdict
of its gates: which failed, with one line of advice each.
"""

from __future__ import annotations

from pathlib import Path

from cllm.core.outputs import removed_on_early_failure
from cllm.core.progress import echo_log, is_main_process
from cllm.data.trajectories import list_shards
from cllm.evaluation.gates import gates_verdict, measures_line
from cllm.training.cards import evaluation_table
from cllm.training.distill import DistillSummary, distill, repetition_warning
from cllm.training.distill_config import DistillConfig

Config = DistillConfig


def run(config: Config) -> int:
    """Distill (each finished stage skipped on a rerun) and print the evaluation. A first run
    that fails before its first trajectory shard leaves no folder behind."""
    with echo_log(), removed_on_early_failure(config.out, "distill", useful=_resumable):
        summary = distill(config)
    if is_main_process():
        _print_summary(config, summary)
    return 0


def _resumable(out: Path) -> bool:
    """What a rerun would resume from: a shard of trajectories (the model is trained after one)."""
    return any(list_shards(folder) for folder in out.glob("trajectories*"))


def _print_summary(config: Config, summary: DistillSummary) -> None:
    skipped = f" (skipped: {', '.join(summary.skipped)})" if summary.skipped else ""
    print(f"distilled {config.model} -> {summary.model_dir}{skipped}")
    evaluation = summary.evaluation
    print(evaluation_table(evaluation))
    print(measures_line(evaluation["quality"]))
    if (warning := repetition_warning(evaluation)) is not None:
        print(warning)
    for line in gates_verdict(evaluation.get("gates", [])) if evaluation.get("gates") else ():
        print(line)  # which gates failed, and what to change for each
