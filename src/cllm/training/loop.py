"""The optimizer steps of `cllm train` (`cllm.training.train` opens the run and finishes it):
one step on the global batch, the loop that logs, evaluates and checkpoints, and the line that
says how long the rest will take once the first step is timed.

Every process takes the same branches; the main process alone evaluates and writes. The step
number is the RNG and data-order state (see `cllm.training.train`), so a resumed run draws
exactly what the uninterrupted one drew.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cllm.core.config import config_to_dict
from cllm.core.progress import progress_bar
from cllm.core.runs import append_jsonl, save_checkpoint, sigint_flag
from cllm.core.seeds import derived_seed
from cllm.data.trajectories import TrajectoryRecord
from cllm.evaluation.gates import passes_text_gates
from cllm.evaluation.heldout import evaluate_heldout
from cllm.training import distributed
from cllm.training.batches import (
    Counts,
    MicroBatch,
    make_micro_batch,
    make_rollouts,
    sample_text_windows,
    step_records,
    step_rollout_prompts,
)
from cllm.training.config import TrainConfig
from cllm.training.objective import micro_batch_loss
from cllm.training.run import BEST, CHECKPOINT, LOG, trainable_state

log = logging.getLogger(__name__)


@dataclass
class RunState:
    """What the steps of one `train` call share (state only; the functions move it)."""

    config: TrainConfig
    accelerator: Any
    engine: Any  # `cllm.training.distributed` engine description (DDP, FSDP, DeepSpeed)
    out: Path
    meta: Any  # the trajectories' meta
    records: list[TrajectoryRecord]
    units: list  # what a step draws: records, or (--layout packed) chains of one prompt's records
    micro: int  # units per micro-batch
    accumulation: int  # micro-batches per process and step
    per_epoch: int
    max_states: int
    total: int  # optimizer steps of the whole run
    digest: str  # of the records: a resume must see the same data
    base_fingerprint: str  # of --model's checkpoint
    eval_line: str = ""  # which held-out set the run evaluates on (or why none)
    saved: dict | None = None  # the checkpoint being resumed
    tokenizer: Any = None
    model: Any = None  # as prepared by accelerate (wrapped: DDP, FSDP, peft)
    base: Any = None  # what decoding and HF calls see
    keep: bool = False  # the model takes `logits_to_keep`
    teacher: Any = None
    optimizer: Any = None
    scheduler: Any = None
    text_stream: torch.Tensor | None = None
    prompts: list[list[int]] = field(default_factory=list)  # rollout prompts
    eval_prompts: list = field(default_factory=list)
    eval_block: int = 0
    eval_seconds: float | None = None  # how long one evaluation took
    step: int = 0
    elapsed: float = 0.0
    eval_before: dict | None = None
    eval_last: dict | None = None
    best: dict | None = None  # --select gated: the fastest evaluation that passed the gates
    loss: float | None = None
    then: str = ""  # what the command does after training (distill: evaluate...), said with the time left

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def processes(self) -> int:
        return self.accelerator.num_processes

    @property
    def ckpt_path(self) -> Path:
        return self.out / CHECKPOINT

    @property
    def log_path(self) -> Path:
        return self.out / LOG


# ---------------------------------------------------------------------------------------------
# One optimizer step


def _global_batch(run: RunState) -> tuple[list[MicroBatch], list[list[int]], Counts]:
    """1. The step's records, their states, micro-batches, text windows and rollout prompts, and
    the global counts of the batch (every process builds them all: masks depend on tokens only)."""
    config, meta, recipe, step = run.config, run.meta, run.config.recipe, run.step
    batch = step_records(run.units, step, batch_size=recipe.batch_size, seed=recipe.seed)
    shares = [batch[i : i + run.micro] for i in range(0, len(batch), run.micro)]
    if recipe.layout == "packed":  # whole prompts: each micro-batch takes all of its prompts' records
        shares = [[r for chain in share for r in chain] for share in shares]
    draws = torch.rand(sum(map(len, shares)), run.max_states,
                       generator=torch.Generator().manual_seed(derived_seed(recipe.seed, "states", step)))
    mbs = [make_micro_batch(share, part, pad_id=meta.pad_token_id, block_size=meta.block_size, config=config)
           for share, part in zip(shares, draws.split([len(s) for s in shares]), strict=True)]
    if run.text_stream is not None:  # the step's text windows, dealt out to the micro-batches
        windows = sample_text_windows(run.text_stream, config, step)
        for mb, share in zip(mbs, windows.tensor_split(len(mbs)), strict=True):
            mb.text = share
    # the step's rollout prompts, dealt out to the micro-batches (decoded below, by their owner)
    picks = step_rollout_prompts(run.prompts, step, config) if run.prompts else []
    rollouts = [picks[i :: len(mbs)] for i in range(len(mbs))]
    counts = Counts()
    for mb, share in zip(mbs, rollouts, strict=True):
        counts.add(mb, config, rollouts=len(share))
    return mbs, rollouts, counts


def _roll_out(run: RunState, mb: MicroBatch, share: list[int]) -> None:
    """On-policy: the model continues its prompts as it is now (or the frozen teacher does)."""
    config, meta = run.config, run.meta
    seeds = [derived_seed(config.recipe.seed, "rollout", run.step, i) for i in share]

    def roll(m):
        return make_rollouts(m, [run.prompts[i] for i in share], config, seeds,
                             eos_token_id=meta.eos_token_id, pad_id=meta.pad_token_id)

    mb.rollout = roll(run.base) if config.recipe.rollout_policy == "model" else run.teacher(roll)


def train_step(run: RunState) -> tuple[torch.Tensor, float, float]:
    """One optimizer step on the global batch: this process's micro-batches, ONE backward each,
    then clip, AdamW and the schedule. Returns this process's loss sums (total, gc, lc, ar, kd),
    the learning rate used and the gradient norm."""
    config, accelerator = run.config, run.accelerator
    P, rank = run.processes, accelerator.process_index
    torch.manual_seed(derived_seed(config.recipe.seed, "step", run.step, rank))  # dropout
    mbs, rollouts, counts = _global_batch(run)  # 1.
    # 2. this process's micro-batches: forwards and ONE backward each; the last syncs
    sums = torch.zeros(5, dtype=torch.float64)
    for mb, share in list(zip(mbs, rollouts, strict=True))[rank::P]:
        if share:
            _roll_out(run, mb, share)
        with accelerator.accumulate(run.model):
            parts = micro_batch_loss(run.model, mb, counts, config, run.meta.pad_token_id, logits_to_keep=run.keep,
                                     teacher=run.teacher)
            # the terms are already this micro-batch's share of the global batch's loss, but
            # accelerate (or DeepSpeed's engine) divides by the accumulated micro-batches and
            # DDP, FSDP and DeepSpeed average over the processes: undo both
            accelerator.backward(parts.total * (P * run.accumulation))
        sums += torch.stack([parts.total, parts.gc, parts.lc, parts.ar, parts.kd]).detach().double().cpu()
    # 3. clip, AdamW, schedule
    grad_norm = accelerator.clip_grad_norm_(run.model.parameters(), config.grad_clip or float("inf"))
    lr = run.scheduler.get_last_lr()[0]
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    return sums, lr, float("nan") if grad_norm is None else float(grad_norm)  # None: DeepSpeed's first steps


# ---------------------------------------------------------------------------------------------
# Evaluations and checkpoints


def evaluate(run: RunState) -> dict | None:
    """The held-out evaluation (main process; None elsewhere or without prompts); every
    process waits for it."""
    config, result = run.config, None
    recipe = config.recipe
    if run.eval_prompts:
        started = time.perf_counter()
        result = evaluate_heldout(run.base, run.eval_prompts, block_size=run.eval_block,
                                  max_new_tokens=recipe.eval_max_new_tokens, batch_size=recipe.eval_batch_size,
                                  eos_token_id=run.meta.eos_token_id, pad_id=run.meta.pad_token_id,
                                  bf16=recipe.dtype == "bfloat16", seed=recipe.seed)
        run.eval_seconds = time.perf_counter() - started
    run.accelerator.wait_for_everyone()
    return result


def write_checkpoint(run: RunState) -> None:
    """OUT/checkpoints/last.pt: the position and evaluations, with the trainable weights,
    optimizer and scheduler, or (FSDP, DeepSpeed) naming accelerate's state folder beside it."""
    epoch, index = divmod(run.step, run.per_epoch)
    meta = {"step": run.step, "elapsed_s": run.elapsed, "config": config_to_dict(run.config),
            "data_digest": run.digest, "data_position": {"epoch": epoch, "batch_in_epoch": index},
            "eval_before": run.eval_before, "eval_last": run.eval_last, "best": run.best}
    if run.engine.accelerate_checkpoints:
        distributed.save_accelerate_state(run.accelerator, run.ckpt_path.parent, run.step, meta, run.ckpt_path)
    elif run.is_main:
        save_checkpoint(run.ckpt_path, {**meta, "trainable": trainable_state(run.accelerator.unwrap_model(run.model)),
                                        "optimizer": run.optimizer.state_dict(),
                                        "scheduler": run.scheduler.state_dict()})


def _consider(run: RunState, evaluation: dict) -> None:
    """--select gated: keep these weights if they pass the text gates and are the fastest yet."""
    score = evaluation.get("tokens_per_forward_not_looping")
    target_looping = (run.eval_before or {}).get("looping_rate", 0.0)
    if score is None or not passes_text_gates(evaluation["looping_rate"], evaluation["degenerate_rate"],
                                              target_looping):
        return
    if run.best is None or score > run.best["score"]:
        run.best = {"step": run.step, "score": score, "eval": evaluation}
        save_checkpoint(run.out / BEST, {"trainable": trainable_state(run.accelerator.unwrap_model(run.model)),
                                         **run.best})


# ---------------------------------------------------------------------------------------------
# The loop


def time_left(step_seconds: float, steps: int, evaluations: int, eval_seconds: float | None) -> str:
    """'about 42 min to go': `steps` more steps at `step_seconds`, and the evaluations among them
    at `eval_seconds` each (when one was timed)."""
    seconds = step_seconds * steps + (eval_seconds or 0.0) * evaluations
    if seconds < 90:
        return f"about {seconds:.0f} s to go"
    if seconds < 90 * 60:
        return f"about {seconds / 60:.0f} min to go"
    return f"about {seconds / 3600:.1f} h to go"


def _say_time_left(run: RunState, stop_at: int, step_seconds: float) -> None:
    """After the first step this call ran: how long the rest will take; inside a longer command
    (`run.then`), that the time is training's alone and what comes after it."""
    steps = stop_at - run.step
    interval = run.config.recipe.eval_interval
    evaluations = (stop_at // interval - run.step // interval + (stop_at == run.total and stop_at % interval != 0)
                   if run.eval_prompts else 0)
    log.info("step %d took %.1f s: %s%s (%d steps%s)%s", run.step, step_seconds, "train: " if run.then else "",
             time_left(step_seconds, steps, evaluations, run.eval_seconds), steps,
             f", {evaluations} evaluation{'s' if evaluations > 1 else ''}" if evaluations else "",
             f"; {run.then}" if run.then else "")


def _log_step(run: RunState, sums: torch.Tensor, lr: float, grad_norm: float, seconds: float) -> None:
    """The step's record in train_log.jsonl, with an evaluation every `eval_interval` steps."""
    config = run.config
    run.loss, gc, lc, ar, kd = sums.tolist()
    record = {"step": run.step, "epoch": round(run.step / run.per_epoch, 4), "loss": run.loss, "gc": gc,
              "lc": lc, "ar": ar, "kd": kd, "lr": lr, "grad_norm": grad_norm}
    started = time.perf_counter()
    if run.step % config.recipe.eval_interval == 0 or run.step == run.total:
        run.eval_last = evaluate(run)
        if run.eval_last:
            record |= {f"eval_{k}": v for k, v in run.eval_last.items()}
            if config.recipe.select == "gated" and run.is_main:
                _consider(run, run.eval_last)
    run.elapsed += seconds + time.perf_counter() - started
    record["elapsed_s"] = round(run.elapsed, 3)
    if run.is_main:
        append_jsonl(run.log_path, record)


def run_loop(run: RunState) -> None:
    """Steps until the end (or --stop-at-step, or Ctrl-C): each logged, evaluated every
    `eval_interval` steps, checkpointed every `checkpoint_interval` (every process takes the
    same branches)."""
    config, accelerator = run.config, run.accelerator
    stop_at = min(run.total, config.stop_at_step or run.total)
    first = run.step + 1
    bar = progress_bar(total=run.total, initial=run.step, desc="train", unit="step", disable=not run.is_main)
    with sigint_flag() as interrupted:
        while run.step < stop_at:
            t0 = time.perf_counter()
            sums, lr, grad_norm = train_step(run)
            run.step += 1
            if run.processes > 1:
                sums = accelerator.reduce(sums.to(accelerator.device), "sum").cpu()
                flag = torch.tensor([float(interrupted["set"])], device=accelerator.device)
                interrupted["set"] = bool(accelerator.reduce(flag, "sum").item())
            step_seconds = time.perf_counter() - t0
            _log_step(run, sums, lr, grad_norm, step_seconds)
            if run.step == first and run.step < stop_at:
                _say_time_left(run, stop_at, step_seconds)
            bar.update(1)
            tpf = f"{run.eval_last['tokens_per_forward']:.2f}" if run.eval_last else "-"
            bar.set_postfix(loss=f"{run.loss:.3f}", tpf=tpf, refresh=False)
            if run.step % config.recipe.checkpoint_interval == 0 or run.step == stop_at or interrupted["set"]:
                write_checkpoint(run)
                accelerator.wait_for_everyone()
            if interrupted["set"] and run.step < run.total:
                bar.close()
                raise KeyboardInterrupt(f"stopped at step {run.step}; run the same command again to resume")
    bar.close()
