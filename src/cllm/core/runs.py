"""Small pieces every long-running job shares: atomic checkpoints, a JSONL log that can be
rewound on resume, a Ctrl-C that stops between steps instead of in the middle of one, and the
step loop of the drafter trainers (`cllm medusa`, `cllm medusa --joint`, `cllm eagle`)."""

from __future__ import annotations

import json
import pickle
import signal
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch

from cllm.core.config import config_to_dict, field_aliases
from cllm.core.errors import UserError, first_line
from cllm.core.outputs import replacing
from cllm.core.progress import progress_bar


class Resumable:
    """A trainer whose checkpoint is the `state_dict` of each attribute named in `STATEFUL`
    (modules, optimizers, schedulers; restored in that order), its batch generator's state and
    its step."""

    STATEFUL: ClassVar[tuple[str, ...]] = ()
    generator: torch.Generator
    step_index: int

    def state_dict(self) -> dict:
        return {**{name: getattr(self, name).state_dict() for name in self.STATEFUL},
                "generator": self.generator.get_state(), "step": self.step_index}

    def load_state_dict(self, state: dict) -> None:
        for name in self.STATEFUL:
            getattr(self, name).load_state_dict(state[name])
        self.generator.set_state(state["generator"])
        self.step_index = state["step"]


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


class StepRun(Protocol):
    """What `begin_or_resume` and `train_steps` need of a run: its settings (`steps`,
    `eval_every`), a trainer (`step() -> record`, `step_index`, `state_dict`, `load_state_dict`),
    its checkpoint file, whether it resumes one, and what it measured before training."""

    config: Any
    trainer: Any
    out: Path
    checkpoint: Path
    resuming: bool
    before: dict | None
    elapsed: float


def begin_or_resume(run: StepRun, log_path: Path, evaluate: Callable[[], dict], logger) -> None:
    """A resumed run takes its trainer, its untrained measures and its time so far from its
    checkpoint and rewinds its log to that step; a new one measures the untrained drafter
    (`evaluate`, step 0 of the log)."""
    if run.resuming:
        state = load_checkpoint(run.checkpoint)
        run.trainer.load_state_dict(state["trainer"])
        run.before, run.elapsed = state["before"], state["elapsed_s"]
        truncate_log(log_path, run.trainer.step_index)
        logger.info("resuming %s at step %d of %d", run.out, run.trainer.step_index, run.config.max_steps)
    else:
        run.before = evaluate()
        append_jsonl(log_path, {"step": 0, "holdout": run.before})


def train_steps(run: StepRun, log_path: Path, evaluate: Callable[[], dict], *, desc: str,
                postfix: Callable[[dict], dict[str, str]]) -> bool:
    """The optimizer steps: each logged, the held-out measures (`evaluate`) and a checkpoint every
    `eval_every` steps and at the end; `postfix(record)` is what the progress bar shows. False
    when Ctrl-C stopped the run (after a checkpoint)."""
    config, trainer = run.config, run.trainer
    began = time.perf_counter()

    def checkpoint() -> None:
        save_checkpoint(run.checkpoint, {"trainer": trainer.state_dict(), "before": run.before,
                                         "elapsed_s": run.elapsed + time.perf_counter() - began})

    with sigint_flag() as interrupted, progress_bar(total=config.max_steps, initial=trainer.step_index, unit="step",
                                                    desc=desc) as bar:
        while trainer.step_index < config.max_steps:
            record = trainer.step()
            if trainer.step_index % config.eval_every == 0 or trainer.step_index == config.max_steps:
                record["holdout"] = evaluate()
                checkpoint()
            append_jsonl(log_path, record)
            bar.set_postfix(**postfix(record), refresh=False)
            bar.update(1)
            if interrupted["set"]:
                checkpoint()
                return False
    run.elapsed += time.perf_counter() - began
    return True
