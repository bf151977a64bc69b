"""Small pieces every long-running job shares: atomic checkpoints, a JSONL log that can be
rewound on resume, and a Ctrl-C that stops between steps instead of in the middle of one."""

from __future__ import annotations

import json
import os
import signal
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from cllm.core.config import config_to_dict
from cllm.core.errors import UserError


def save_checkpoint(path: Path, state: dict) -> None:
    """Write-then-rename: a crash mid-write never leaves a broken checkpoint."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial")
    torch.save(state, tmp)
    os.replace(tmp, path)


def check_same_run(saved: dict, config, *, free: frozenset[str] | set[str] = frozenset()) -> None:
    """Refuse to resume `config.out` with options other than those of the run it holds (`saved`,
    its config as written): the `free` ones may change; an option added since the run started,
    left at its default, is no change."""
    current, defaults = config_to_dict(config), config_to_dict(type(config)())
    for key in sorted(set(saved) | set(current)):
        if key not in saved and current.get(key) == defaults.get(key):
            continue
        if key not in free and saved.get(key) != current.get(key):
            raise UserError(f"{config.out} holds a run with {key}={saved.get(key)!r}, not {current.get(key)!r}: "
                            "use another --out, --resume false, or the same options")


def append_jsonl(path: Path, record: dict) -> None:
    with path.open("a") as fh:
        fh.write(json.dumps(record) + "\n")


def truncate_log(path: Path, step: int) -> None:
    """Drop log records after `step`: those steps are about to be redone."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in kept))


@contextmanager
def sigint_flag():
    """Ctrl-C sets a flag checked between steps (a step is never cut in half); a second Ctrl-C
    interrupts at once. Outside the main thread no handler can be installed: plain Ctrl-C."""
    flag = {"set": False}
    if sys.platform == "win32" or signal.getsignal(signal.SIGINT) is None:
        yield flag
        return
    try:
        previous = signal.getsignal(signal.SIGINT)

        def handler(signum, frame):
            if flag["set"]:
                raise KeyboardInterrupt
            flag["set"] = True

        signal.signal(signal.SIGINT, handler)
    except ValueError:
        yield flag
        return
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)

