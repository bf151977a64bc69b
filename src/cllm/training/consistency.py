"""Consistency training on the training skeleton: `ConsistencyTrainer`, the hooks of `cllm train`
(and of each `cllm distill` round): one optimizer step on the global batch, the held-out
evaluation with the `--select gated` choice, and the checkpoint (one file, or accelerate's state
folder under FSDP / DeepSpeed). `cllm.training.train` opens the run, builds what it carries
(`TrainData`, `Learner`, `SideInputs`) and finishes it.

Every process takes the same branches; the main process alone evaluates and writes. The step
number is the RNG and data-order state (see `cllm.training.train`), so a resumed run draws
exactly what the uninterrupted one drew.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from cllm.core.config import config_to_dict
from cllm.core.runs import save_checkpoint
from cllm.core.seeds import derived_seed
from cllm.data.prompts import Prompt
from cllm.data.trajectories import TrajectoryMeta, TrajectoryRecord
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
from cllm.training.objective import FrozenTeacher, micro_batch_loss
from cllm.training.run import BEST, load_trainable_state, trainable_state
from cllm.training.skeleton import Plan, Trainer


@dataclass(frozen=True)
class TrainData:
    """The records a run trains on and the batch geometry they give."""

    meta: TrajectoryMeta  # the (first) trajectory directory's
    records: list[TrajectoryRecord]
    units: list[TrajectoryRecord] | list[list[TrajectoryRecord]]  # what a step draws: records, or chains
    digest: str  # of the records: a resume must see the same data
    base_fingerprint: str  # of --model's checkpoint
    eval_line: str  # which held-out set the run evaluates on (or why none)
    micro: int  # units per micro-batch
    accumulation: int  # micro-batches per process and step
    per_epoch: int
    max_states: int
    total: int  # optimizer steps of the whole run


@dataclass
class Learner:
    """The model being trained, as accelerate prepared it, and what trains it."""

    tokenizer: PreTrainedTokenizerBase
    model: nn.Module  # as prepared by accelerate (wrapped: DDP, FSDP, peft)
    base: PreTrainedModel  # what decoding and HF calls see
    keep: bool  # the model takes `logits_to_keep`
    teacher: FrozenTeacher | None
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


@dataclass
class SideInputs:
    """The text windows of the AR term, the rollout prompts and the held-out prompts."""

    text_stream: torch.Tensor | None = None
    prompts: list[list[int]] = field(default_factory=list)  # rollout prompts
    eval_prompts: list[Prompt] = field(default_factory=list)  # the main process's alone
    eval_block: int = 0


class ConsistencyTrainer(Trainer):
    """GC / LC + AR (+ KD) on collected trajectories, on `accelerate`'s processes."""

    def __init__(self, config: TrainConfig, accelerator: Accelerator, engine: distributed.Engine, out: Path,
                 data: TrainData, learner: Learner, side: SideInputs, plan: Plan) -> None:
        self.config, self.accelerator, self.engine, self.out = config, accelerator, engine, out
        self.data, self.learner, self.side, self.plan = data, learner, side, plan
        self.is_main = accelerator.is_main_process
        self.eval_before: dict | None = None  # the untrained model's (the target's) evaluation
        self.eval_last: dict | None = None
        self.best: dict | None = None  # --select gated: the fastest evaluation that passed the gates
        self.loss: float | None = None

    @property
    def processes(self) -> int:
        return self.accelerator.num_processes

    # ------------------------------------------------------------------ one optimizer step

    def _global_batch(self) -> tuple[list[MicroBatch], list[list[int]], Counts]:
        """1. The step's records, their states, micro-batches, text windows and rollout prompts,
        and the global counts of the batch (every process builds them all: masks depend on tokens
        only)."""
        config, data, recipe, step = self.config, self.data, self.config.recipe, self.step
        meta = data.meta
        batch = step_records(data.units, step, batch_size=recipe.batch_size, seed=recipe.seed)
        shares = [batch[i : i + data.micro] for i in range(0, len(batch), data.micro)]
        if recipe.layout == "packed":  # whole prompts: each micro-batch takes all of its prompts' records
            shares = [[r for chain in share for r in chain] for share in shares]
        draws = torch.rand(sum(map(len, shares)), data.max_states,
                           generator=torch.Generator().manual_seed(derived_seed(recipe.seed, "states", step)))
        mbs = [make_micro_batch(share, part, pad_id=meta.pad_token_id, block_size=meta.block_size, config=config)
               for share, part in zip(shares, draws.split([len(s) for s in shares]), strict=True)]
        if self.side.text_stream is not None:  # the step's text windows, dealt out to the micro-batches
            windows = sample_text_windows(self.side.text_stream, config, step)
            for mb, share in zip(mbs, windows.tensor_split(len(mbs)), strict=True):
                mb.text = share
        # the step's rollout prompts, dealt out to the micro-batches (decoded below, by their owner)
        picks = step_rollout_prompts(self.side.prompts, step, config) if self.side.prompts else []
        rollouts = [picks[i :: len(mbs)] for i in range(len(mbs))]
        counts = Counts()
        for mb, share in zip(mbs, rollouts, strict=True):
            counts.add(mb, config, rollouts=len(share))
        return mbs, rollouts, counts

    def _roll_out(self, mb: MicroBatch, share: list[int]) -> None:
        """On-policy: the model continues its prompts as it is now (or the frozen teacher does)."""
        config, meta, learner = self.config, self.data.meta, self.learner
        seeds = [derived_seed(config.recipe.seed, "rollout", self.step, i) for i in share]

        def roll(m):
            return make_rollouts(m, [self.side.prompts[i] for i in share], config, seeds,
                                 eos_token_id=meta.eos_token_id, pad_id=meta.pad_token_id)

        mb.rollout = roll(learner.base) if config.recipe.rollout_policy == "model" else learner.teacher(roll)

    def train_step(self) -> dict:
        """One optimizer step on the global batch: this process's micro-batches, ONE backward
        each, then clip, AdamW and the schedule. Logs the batch's loss and its terms (summed over
        the processes), the learning rate used and the gradient norm."""
        config, accelerator, learner = self.config, self.accelerator, self.learner
        P, rank = self.processes, accelerator.process_index
        torch.manual_seed(derived_seed(config.recipe.seed, "step", self.step, rank))  # dropout
        mbs, rollouts, counts = self._global_batch()  # 1.
        # 2. this process's micro-batches: forwards and ONE backward each; the last syncs
        sums = torch.zeros(5, dtype=torch.float64)
        for mb, share in list(zip(mbs, rollouts, strict=True))[rank::P]:
            if share:
                self._roll_out(mb, share)
            with accelerator.accumulate(learner.model):
                parts = micro_batch_loss(learner.model, mb, counts, config, self.data.meta.pad_token_id,
                                         logits_to_keep=learner.keep, teacher=learner.teacher)
                # the terms are already this micro-batch's share of the global batch's loss, but
                # accelerate (or DeepSpeed's engine) divides by the accumulated micro-batches and
                # DDP, FSDP and DeepSpeed average over the processes: undo both
                accelerator.backward(parts.total * (P * self.data.accumulation))
            sums += torch.stack([parts.total, parts.gc, parts.lc, parts.ar, parts.kd]).detach().double().cpu()
        # 3. clip, AdamW, schedule
        grad_norm = accelerator.clip_grad_norm_(learner.model.parameters(), config.grad_clip or float("inf"))
        lr = learner.scheduler.get_last_lr()[0]
        learner.optimizer.step()
        learner.scheduler.step()
        learner.optimizer.zero_grad(set_to_none=True)
        if P > 1:
            sums = accelerator.reduce(sums.to(accelerator.device), "sum").cpu()
        self.loss, gc, lc, ar, kd = sums.tolist()
        return {"epoch": round((self.step + 1) / self.data.per_epoch, 4), "loss": self.loss, "gc": gc, "lc": lc,
                "ar": ar, "kd": kd, "lr": lr,
                "grad_norm": float("nan") if grad_norm is None else float(grad_norm)}  # None: DeepSpeed's first steps

    def agree(self, interrupted: bool) -> bool:
        if self.processes == 1:
            return interrupted
        flag = torch.tensor([float(interrupted)], device=self.accelerator.device)
        return bool(self.accelerator.reduce(flag, "sum").item())

    def postfix(self, record: dict) -> dict[str, str]:
        tpf = f"{self.eval_last['tokens_per_forward']:.2f}" if self.eval_last else "-"
        return {"loss": f"{record['loss']:.3f}", "tpf": tpf}

    # ------------------------------------------------------------------ evaluations and gates

    @property
    def evaluates(self) -> bool:
        return bool(self.side.eval_prompts)

    def evaluate(self) -> dict:
        """The held-out evaluation (the main process's; every process waits for it), with
        `--select gated`'s choice; as log fields (eval_*)."""
        recipe, result = self.config.recipe, None
        if self.side.eval_prompts:
            meta = self.data.meta
            result = evaluate_heldout(self.learner.base, self.side.eval_prompts, block_size=self.side.eval_block,
                                      max_new_tokens=recipe.eval_max_new_tokens, batch_size=recipe.eval_batch_size,
                                      eos_token_id=meta.eos_token_id, pad_id=meta.pad_token_id,
                                      bf16=recipe.dtype == "bfloat16", seed=recipe.seed)
        self.accelerator.wait_for_everyone()
        self.eval_last = result
        if self.step == 0:
            self.eval_before = result
        elif result and recipe.select == "gated" and self.is_main:
            self._consider(result)
        return {f"eval_{k}": v for k, v in (result or {}).items()}

    def _consider(self, evaluation: dict) -> None:
        """--select gated: keep these weights if they pass the text gates and are the fastest yet."""
        score = evaluation.get("tokens_per_forward_not_looping")
        target_looping = (self.eval_before or {}).get("looping_rate", 0.0)
        if score is None or not passes_text_gates(evaluation["looping_rate"], evaluation["degenerate_rate"],
                                                  target_looping):
            return
        if self.best is None or score > self.best["score"]:
            self.best = {"step": self.step, "score": score, "eval": evaluation}
            save_checkpoint(self.out / BEST, {"trainable": self._trainable(), **self.best})

    # ------------------------------------------------------------------ checkpoints

    def _trainable(self) -> dict[str, torch.Tensor]:
        return trainable_state(self.accelerator.unwrap_model(self.learner.model))

    def state_dict(self) -> dict:
        epoch, index = divmod(self.step, self.data.per_epoch)
        return {"config": config_to_dict(self.config), "data_digest": self.data.digest,
                "data_position": {"epoch": epoch, "batch_in_epoch": index},
                "eval_before": self.eval_before, "eval_last": self.eval_last, "best": self.best}

    def save(self) -> None:
        """OUT/checkpoints/last.pt: the position and evaluations, with the trainable weights,
        optimizer and scheduler, or (FSDP, DeepSpeed) naming accelerate's state folder beside it."""
        meta = {"step": self.step, "elapsed_s": self.elapsed, **self.state_dict()}
        path = self.plan.checkpoint
        if self.engine.accelerate_checkpoints:
            distributed.save_accelerate_state(self.accelerator, path.parent, self.step, meta, path)
        elif self.is_main:
            save_checkpoint(path, {**meta, "trainable": self._trainable(),
                                   "optimizer": self.learner.optimizer.state_dict(),
                                   "scheduler": self.learner.scheduler.state_dict()})
        self.accelerator.wait_for_everyone()

    def restore(self, saved: dict) -> None:
        """The checkpoint's weights, optimizer, schedule, position and evaluations."""
        if self.engine.accelerate_checkpoints:
            distributed.load_accelerate_state(self.accelerator, self.plan.checkpoint.parent, saved)
        else:
            load_trainable_state(self.accelerator.unwrap_model(self.learner.model), saved["trainable"])
            self.learner.optimizer.load_state_dict(saved["optimizer"])
            self.learner.scheduler.load_state_dict(saved["scheduler"])
        self.step, self.elapsed = saved["step"], saved["elapsed_s"]
        self.eval_before, self.eval_last, self.best = saved["eval_before"], saved["eval_last"], saved.get("best")
