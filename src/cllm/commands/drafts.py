"""`cllm drafts`: build a model's draft table from its own greedy completions
(`cllm.training.drafts`), saved beside the checkpoint where `generate`, `chat`, `serve` and
`bench` find it (`--draft-table auto`).
"""

from __future__ import annotations

from cllm.core.progress import echo_log
from cllm.training.drafts import DraftsConfig, build_draft_table

Config = DraftsConfig


def run(config: Config) -> int:
    """Build the table and say how big it is and where it went."""
    with echo_log():
        summary = build_draft_table(config)
    print(summary.line())
    return 0
