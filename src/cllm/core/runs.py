"""Small pieces every long-running job shares: atomic checkpoints read without running code, the
check that a resumed run is the same run, a JSONL log that can be rewound on resume, and a
Ctrl-C that stops between steps instead of in the middle of one (the training loop itself is
`cllm.training.skeleton`)."""

from __future__ import annotations

import json
import pickle
import signal
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from cllm.core.config import config_to_dict, field_aliases
from cllm.core.errors import UserError, first_line
from cllm.core.outputs import replacing


def save_checkpoint(path: Path, state: dict) -> None:
    """Write-then-rename: a crash mid-write never leaves a broken checkpoint."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path) as tmp:
        torch.save(state, tmp)


def load_checkpoint(path: Path) -> dict:
    """A checkpoint `save_checkpoint` wrote, read without running any of its code: torch's
    weights-only unpickler builds tensors and plain data only, so a file that needs anything more
    (one planted to run code, or not written by cllm) is refused in one line, before any of it
    is used."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise UserError(f"{path} holds objects other than tensors and plain data (not a checkpoint this cllm "
                        "wrote): refusing to unpickle it; delete it to start the run over") from None
    except Exception as exc:  # noqa: BLE001 - a truncated or damaged file: one line naming it
        raise UserError(f"cannot read the checkpoint {path}: {first_line(exc)}; delete it to start the run "
                        "over") from None
    if not isinstance(state, dict):
        raise UserError(f"{path} is not a checkpoint cllm wrote (a {type(state).__name__}); delete it to start "
                        "the run over")
    return state


def check_same_run(saved: dict, config, *, free: frozenset[str] | set[str] = frozenset()) -> None:
    """Refuse to resume `config.out` with options other than those of the run it holds (`saved`,
    its config as written): the `free` ones may change; an option added since the run started,
    left at its default, is no change."""
    renamed = field_aliases(type(config))  # a run written before an option was renamed
    saved = {renamed.get(key, key): value for key, value in saved.items()}
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
