"""`cllm collect`: Jacobi-decode a prompt set with the target model and record every block's
trajectory (`cllm.training.collect`); rank 0 prints what the run did. Ctrl-C stops it between
shards' writes; the same command resumes it (finished prompts are skipped), and says so. A first
run that fails before its first shard leaves no folder behind.
"""

from __future__ import annotations

import traceback
from pathlib import Path

from cllm.core.outputs import removed_on_early_failure
from cllm.core.progress import echo_log, is_main_process
from cllm.data import trajectories as tj
from cllm.training.collect import CollectConfig, CollectSummary, collect

Config = CollectConfig


def run(config: Config) -> int:
    """Collect (or resume collecting) into `config.out` and print the summary."""
    try:
        with echo_log(), removed_on_early_failure(config.out, "collect", useful=lambda out: bool(tj.list_shards(out))):
            summary = collect(config)
    except KeyboardInterrupt as exc:  # the CLI prints the message: where it stopped, how to go on
        traceback.clear_frames(exc.__traceback__)  # the progress bar they held closes now, not after the line
        raise KeyboardInterrupt(stopped_line(Path(config.out))) from None
    if is_main_process():
        _print_summary(summary)
    return 0


def stopped_line(out: Path) -> str:
    """Where an interrupted collection stopped: the prompts whose shards were written (a rerun
    skips them; a shard cut in half is set aside and its prompts collected again)."""
    done = len(tj.completed_prompt_ids(out)) if (out / tj.META_FILE).is_file() else 0
    return f"stopped with {done} prompt{'' if done == 1 else 's'} collected in {out}; run the same command again to " \
           "resume"


def _print_summary(summary: CollectSummary) -> None:
    for line in summary.lines():
        print(line)
