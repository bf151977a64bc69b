"""The one training loop of cllm. Every trainer is a `Trainer`: consistency training (`cllm train`,
and each round of `cllm distill`), pretraining (`cllm pretrain`), Medusa-1 heads and the EAGLE
head (`cllm medusa`, `cllm eagle`) and Medusa-2 (`cllm medusa --joint`). What they share is here,
once; what differs is a hook:

- `train_step`: one optimizer step, its loss and what it logs (the trainer's own module);
- `evaluate`: the held-out measures, as log fields (and the gates that keep a step's weights);
- `state_dict` / `load_state_dict`: what a checkpoint holds besides the step and the time;
  `save` / `restore` where the checkpoint is not one file (accelerate's engines);
- `agree`: processes agree on a Ctrl-C (one process: nothing to agree on);
- `postfix`: what the progress bar shows.

`Trainer.begin` resumes from a checkpoint or measures the untrained model (step 0 of the log);
`Trainer.fit` runs the steps: each logged (`Plan.log`, JSONL, the main process alone), evaluated
every `Plan.eval_every` steps and at the end, checkpointed every `Plan.checkpoint_every` steps, at
the end, at `Plan.stop_at` and on Ctrl-C (which finishes the step it is in), with a progress bar
and, once the first step is timed, a line saying how long the rest will take. The step number is
each trainer's data and RNG position, so a resumed run draws exactly what the uninterrupted one
drew.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from cllm.core.progress import progress_bar
from cllm.core.runs import append_jsonl, save_checkpoint, sigint_flag, truncate_log

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    """Where a run logs and checkpoints, and when the loop evaluates and saves."""

    log: Path  # one JSON record per step; step 0: the untrained model's evaluation
    checkpoint: Path
    total: int  # optimizer steps of the whole run
    eval_every: int
    checkpoint_every: int
    desc: str  # the progress bar's label, and the time-left line's inside a longer command
    stop_at: int | None = None  # stop there (with a checkpoint); a rerun continues
    then: str = ""  # what the command does after training, said with the time left


class Trainer:
    """A training run as `fit` drives it: the state every trainer carries, and the hooks."""

    plan: Plan
    step: int = 0  # optimizer steps done
    elapsed: float = 0.0  # seconds of steps and evaluations, summed over resumes
    eval_seconds: float | None = None  # how long the last evaluation took
    is_main: bool = True  # the process that logs and writes

    # ------------------------------------------------------------------------------ hooks

    def train_step(self) -> dict:
        """One optimizer step on batch `self.step` (counted from 0); returns its log fields."""
        raise NotImplementedError

    def evaluate(self) -> dict:
        """The held-out measures as log fields ({}: none). Every process calls it."""
        return {}

    @property
    def evaluates(self) -> bool:
        """Whether `evaluate` measures anything (the time-left line counts its evaluations)."""
        return True

    def state_dict(self) -> dict:
        """What the checkpoint holds besides the step and the time."""
        raise NotImplementedError

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError

    def checkpoint(self) -> dict:
        """What `save` writes: the step, the time and `state_dict`."""
        return {"step": self.step, "elapsed_s": self.elapsed, **self.state_dict()}

    def save(self) -> None:
        """Write the checkpoint (atomically: a crash mid-write keeps the previous one)."""
        if self.is_main:
            save_checkpoint(self.plan.checkpoint, self.checkpoint())

    def restore(self, saved: dict) -> None:
        """Take a checkpoint's state, step and time."""
        self.load_state_dict(saved)
        self.step, self.elapsed = saved["step"], saved["elapsed_s"]

    def agree(self, interrupted: bool) -> bool:
        """Whether any process was interrupted (every process must stop at the same step)."""
        return interrupted

    def postfix(self, record: dict) -> dict[str, str]:
        return {"loss": f"{record['loss']:.3f}"}

    # ------------------------------------------------------------------------------ the loop

    def advance(self) -> dict:
        """One step and its log record, no evaluation or checkpoint (`fit` adds those; scripts and
        tests call it alone)."""
        record = self.train_step()
        self.step += 1
        return {"step": self.step, **record}

    def begin(self, saved: dict | None) -> None:
        """A resumed run restores `saved` (its checkpoint) and rewinds the log to its step; a new
        one measures the untrained model, step 0 of the log."""
        if saved is not None:
            self.restore(saved)
            if self.is_main:
                truncate_log(self.plan.log, self.step)
            return
        before = self._timed_evaluation()
        if before and self.is_main:
            append_jsonl(self.plan.log, {"step": 0, **before})

    def fit(self) -> bool:
        """The steps until the end, or `Plan.stop_at`. Returns False when Ctrl-C stopped the run
        before its end (after a checkpoint): rerunning the command resumes it."""
        plan = self.plan
        stop_at = min(plan.total, plan.stop_at or plan.total)
        first = self.step + 1
        with sigint_flag() as interrupted, progress_bar(total=plan.total, initial=self.step, desc=plan.desc,
                                                         unit="step", disable=not self.is_main) as bar:
            while self.step < stop_at:
                started = time.perf_counter()
                record = self.advance()
                stop = self.agree(interrupted["set"])
                step_seconds = time.perf_counter() - started
                if self.step % plan.eval_every == 0 or self.step == plan.total:
                    record |= self._timed_evaluation()
                self.elapsed += time.perf_counter() - started
                record["elapsed_s"] = round(self.elapsed, 3)
                if self.is_main:
                    append_jsonl(plan.log, record)
                if self.step == first and self.step < stop_at:
                    self._say_time_left(stop_at, step_seconds)
                bar.set_postfix(**self.postfix(record), refresh=False)
                bar.update(1)
                if self.step % plan.checkpoint_every == 0 or self.step == stop_at or stop:
                    self.save()
                if stop and self.step < plan.total:
                    return False
        return True

    def _timed_evaluation(self) -> dict:
        started = time.perf_counter()
        result = self.evaluate()
        if result:
            self.eval_seconds = time.perf_counter() - started
        return result

    def _say_time_left(self, stop_at: int, step_seconds: float) -> None:
        """After the first step this call ran: how long the rest will take; inside a longer command
        (`Plan.then`), that the time is this training's alone and what comes after it."""
        plan, steps = self.plan, stop_at - self.step
        every = plan.eval_every
        evaluations = (stop_at // every - self.step // every + (stop_at == plan.total and stop_at % every != 0)
                       if self.evaluates else 0)
        log.info("step %d took %.1f s: %s%s (%d steps%s)%s", self.step, step_seconds,
                 f"{plan.desc}: " if plan.then else "", time_left(step_seconds, steps, evaluations, self.eval_seconds),
                 steps, f", {evaluations} evaluation{'s' if evaluations > 1 else ''}" if evaluations else "",
                 f"; {plan.then}" if plan.then else "")


def time_left(step_seconds: float, steps: int, evaluations: int, eval_seconds: float | None) -> str:
    """'about 42 min to go': `steps` more steps at `step_seconds`, and the evaluations among them
    at `eval_seconds` each (when one was timed)."""
    seconds = step_seconds * steps + (eval_seconds or 0.0) * evaluations
    if seconds < 90:
        return f"about {seconds:.0f} s to go"
    if seconds < 90 * 60:
        return f"about {seconds / 60:.0f} min to go"
    return f"about {seconds / 3600:.1f} h to go"


# ---------------------------------------------------------------------------------------------
# What the single-process trainers share


def descend(loss: torch.Tensor, optimizer: torch.optim.Optimizer, scheduler, *, clip: float = 0.0,
            params=None) -> None:
    """Backward, the gradient norm of `params` clipped to `clip` (0: not clipped), the optimizer's
    step, the schedule's, gradients cleared."""
    loss.backward()
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(params, clip)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def draw(population: int, size: int, generator: torch.Generator) -> list[int]:
    """`size` indices into a population, with replacement, from the run's seeded generator (its
    state is checkpointed: a resumed run draws what the uninterrupted one drew)."""
    return torch.randint(population, (size,), generator=generator).tolist()
