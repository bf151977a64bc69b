"""Consistency (GC / LC) + AR fine-tuning on collected Jacobi trajectories
(Kou et al. 2024, Algorithm 1), as a visible loop on `accelerate`.

One optimizer step, for a global batch of `batch_size` records (all processes, all micro-batches):

1. pick the records (a seeded permutation per epoch; the step number says where we are) and,
   per record, k states among its non-fixed states (uniformly, or by the progressive noise
   schedule; a generator seeded from (seed, step)), the step's text windows and rollout prompts:
   the batch depends neither on the process count nor on resumes (`cllm.training.batches`);
2. build every micro-batch of the *global* batch and count its counted positions (GC, LC, AR,
   KD): masks depend on tokens only, so every process knows the global counts without talking;
3. for each of this process's micro-batches: decode its rollouts (the model as it is now, or the
   frozen teacher), then the forwards *with* gradients over the rows that need them (prefix +
   states; the AR rows: fixed points, ground truth, text windows, rollouts), *without* over the
   rows that are only targets (the model's own fixed point or next state, or the frozen
   teacher's logits), then ONE backward of ``consistency + ar_weight * AR + kd_weight * KD``,
   each term a sum over counted positions divided by its *global* count: accumulation and
   processes give exactly the gradient of the whole batch (`cllm.training.objective`);
4. clip, AdamW step, cosine schedule step; evaluate every `eval_interval` steps (with
   ``--select gated``, keep the weights of the fastest evaluation that passes the text gates)
   (`cllm.training.consistency`, on the skeleton `cllm.training.skeleton`).

`train` is that loop between named steps: check every input but the data before anything long
(`cllm.training.run.check_inputs`), open the run (processes, data, batch geometry, the checkpoint
to resume), build the model, load the side inputs, say what the run will do (records, steps,
the held-out set; the time left once the first step is timed), loop, finish.

Every row is ``prefix (left-padded) + block (right-padded)``, so rows of all kinds stack into one
forward and `losses.block_logits` reads them all the same way. Positions count real tokens
only, as in the decoders, so a padded row computes what it would alone.

RNG: torch's global generator is reseeded from (seed, step, process) before every step (dropout,
LoRA dropout) and the data generators from (seed, epoch) and (seed, step): the step number *is*
the RNG and data-order state, so a resumed run draws exactly what the uninterrupted one drew.
The checkpoint (OUT/checkpoints/last.pt: trainable weights, optimizer, scheduler, step, data
position, last evaluation) is written atomically every `checkpoint_interval` steps, at the end
and on Ctrl-C; rerunning the same command resumes from it.

OUT ends up an ordinary HF checkpoint (safetensors; LoRA merged) + tokenizer, with
train_config.json, train_log.jsonl (one record per step, evaluations at their steps),
train_summary.json and MODEL_CARD.md beside it.

Processes: `accelerate launch --multi_gpu --num_processes K -m cllm.cli train ...` (DDP); with
``CUDA_VISIBLE_DEVICES=""`` the same command runs K gloo CPU processes. Rank 0 alone prints,
evaluates and writes. FSDP and DeepSpeed ZeRO run the same loop from an accelerate config
(examples/accelerate/, docs/scale.md); what differs between the engines is in `cllm.training.distributed`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import parse_flag_from_env

from cllm.core.config import config_to_dict, write_config
from cllm.core.errors import UserError
from cllm.core.outputs import claim_folder
from cllm.core.runs import load_checkpoint
from cllm.decoding.inputs import position_limit
from cllm.evaluation.heldout import heldout_prompts
from cllm.modeling.forwards import enable_checkpointing
from cllm.models import fingerprint, load_model, load_tokenizer
from cllm.runtime.hf import accepts_logits_to_keep
from cllm.training import distributed
from cllm.training.batches import load_text_stream, prompt_chains, rollout_prompts
from cllm.training.cards import cllm_card, fmt
from cllm.training.config import TrainConfig
from cllm.training.consistency import ConsistencyTrainer, Learner, SideInputs, TrainData
from cllm.training.objective import load_teacher
from cllm.training.run import (
    BEST,
    CARD,
    CHECKPOINT,
    CONFIG,
    LOG,
    SUMMARY,
    add_lora,
    check_inputs,
    check_resumable,
    data_digest,
    export,
    load_trainable_state,
    open_data,
    resolve_ar_target,
    resolve_eval_set,
)
from cllm.training.schedule import warmup_cosine
from cllm.training.skeleton import Plan

log = logging.getLogger(__name__)


@dataclass
class TrainSummary:
    out: str
    finished: bool  # False when stopped early by --stop-at-step
    steps: int
    total_steps: int
    records: int
    train_time_s: float
    final_loss: float | None
    eval_before: dict | None  # the untrained model (the target)
    eval_after: dict | None  # the exported weights' evaluation
    selected_step: int | None = None  # --select gated: the step whose weights were exported

    def lines(self) -> list[str]:
        """What the run did: its steps and time, and the evaluation before and after."""
        before, after = self.eval_before or {}, self.eval_after or {}
        state = "trained" if self.finished else "stopped (rerun to continue)"
        lines = [f"{state}: {self.steps}/{self.total_steps} steps on {self.records} records in "
                 f"{self.train_time_s:.0f} s -> {self.out}"]
        if self.selected_step is not None:
            lines.append(f"  exported the weights of step {self.selected_step} (--select gated)")
        if after:
            loss = (f"{fmt(before.get('ar_loss'))} -> {fmt(after.get('ar_loss'))}" if after.get("ar_loss") is not None
                    else "- (none of the held-out prompts has a `reference` to score)")
            lines.append(f"  Jacobi tokens per forward {fmt(before.get('tokens_per_forward'))} -> "
                         f"{fmt(after.get('tokens_per_forward'))}, AR validation loss {loss}")
        return lines


def train(config: TrainConfig, *, then: str = "") -> TrainSummary:
    """Consistency-train `config.model` on `config.data` into `config.out` (resumable).

    Args:
        config: a validated `TrainConfig`. Rerunning with the same config resumes from the last
            checkpoint; Ctrl-C saves one before stopping.
        then: what the calling command does after training ("then: evaluate, ..."), said with
            the time left so that it reads as training's alone.
    """
    check_inputs(config)  # 1. model, teacher, --ar-text, held-out prompts, output dir: before anything long
    config, accelerator, engine, data, saved = _open_run(config)  # 2. processes, data, batch geometry, checkpoint
    learner = _build_model(config, accelerator, engine, data)  # 3. model (+ LoRA), teacher, AdamW, schedule
    side = _load_side_inputs(config, accelerator, data, learner)  # 4. text windows, rollout prompts, held-out prompts
    out = Path(config.out)
    plan = Plan(log=out / LOG, checkpoint=out / CHECKPOINT, total=data.total, eval_every=config.recipe.eval_interval,
                checkpoint_every=config.recipe.checkpoint_interval, desc="train", stop_at=config.stop_at_step,
                then=then)
    run = ConsistencyTrainer(config, accelerator, engine, out, data, learner, side, plan)
    _announce(run, resuming=saved is not None)  # 5. what the run will do
    run.begin(saved)  # restored when resuming, else the untrained model's evaluation: every later one's baseline
    if not run.fit():  # 6. optimizer steps, logging, evaluations, checkpoints
        raise KeyboardInterrupt(f"stopped at step {run.step}; run the same command again to resume")
    return _finish(run)  # 7. the HF checkpoint, summary and model card (a finished run only)


def _open_run(config: TrainConfig) -> tuple[TrainConfig, Accelerator, distributed.Engine, TrainData, dict | None]:
    """Accelerate's processes, the records (checked against --model), the batch geometry, the
    output directory and the checkpoint to resume, if any; the config with what the data
    decided (--ar-target auto, the held-out set, a batch fitted to few records)."""
    recipe = config.recipe
    # Without a GPU, several launched processes are gloo CPU processes (see cllm.training.collect).
    use_cpu = parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.cuda.is_available()
    accelerator = Accelerator(cpu=use_cpu, mixed_precision=distributed.mixed_precision(recipe.dtype, os.environ))
    P = accelerator.num_processes
    engine = distributed.engine_of(accelerator)
    distributed.check_engine(engine, eval_count=config.eval_count, lora=recipe.lora,
                             model_rollouts=bool(recipe.rollout_prompts) and recipe.rollout_policy == "model")
    out = Path(config.out)
    base_fingerprint = fingerprint(config.model)  # read once: checked against the data, written in the summary
    reader, records = open_data(config, base_fingerprint)
    config = resolve_ar_target(config, records)
    config, eval_line = resolve_eval_set(config, reader.meta)
    units = prompt_chains(records) if recipe.layout == "packed" else records
    config = fit_batch_size(config, len(units), P)  # a user's few records: all of them, one batch
    recipe = config.recipe
    micro = recipe.micro_batch_size or max(recipe.batch_size // P, 1)
    if recipe.batch_size % (micro * P):
        raise UserError(f"batch-size {recipe.batch_size} must be a multiple of micro-batch-size {micro} "
                        f"x {P} processes")
    per_epoch = len(units) // recipe.batch_size
    data = TrainData(meta=reader.meta, records=records, units=units, digest=data_digest(records),
                     base_fingerprint=base_fingerprint, eval_line=eval_line, micro=micro,
                     accumulation=recipe.batch_size // (micro * P), per_epoch=per_epoch,
                     max_states=max(len(r.states) + (len(r.augmented_states) if config.augmented else 0)
                                    for r in records),
                     total=recipe.total_steps(per_epoch))
    saved = _find_checkpoint(config, engine, data)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if saved is None:
            for stale in (out / CHECKPOINT, out / BEST, out / LOG, out / SUMMARY):
                stale.unlink(missing_ok=True)
        claim_folder(out, "train")
        write_config(config, out / CONFIG)
    return config, accelerator, engine, data, saved


def fit_batch_size(config: TrainConfig, units: int, processes: int = 1) -> TrainConfig:
    """`config`, its batch size cut to `units` (records; prompts with --layout packed) when the
    data hold fewer, rounded down to a multiple of the processes, with a one-line note: a
    user's first small data set trains as one batch instead of being refused."""
    recipe = config.recipe
    if units >= recipe.batch_size:
        return config
    unit = "prompts" if recipe.layout == "packed" else "records"
    fitted = units - units % processes
    if fitted < 1:
        raise UserError(f"{config.data} holds {units} {unit}, fewer than the {processes} processes")
    micro = recipe.micro_batch_size if recipe.micro_batch_size and fitted % recipe.micro_batch_size == 0 else None
    log.info("train: %s holds %d %s, fewer than batch-size %d: each step uses all %d as one batch", config.data,
             units, unit, recipe.batch_size, fitted)
    return dataclasses.replace(config, recipe=dataclasses.replace(recipe, batch_size=fitted, micro_batch_size=micro))


def _find_checkpoint(config: TrainConfig, engine: distributed.Engine, data: TrainData) -> dict | None:
    """The checkpoint to resume (with --resume, when OUT holds one), checked against this run."""
    path = Path(config.out) / CHECKPOINT
    if not (path.exists() and config.resume):
        return None
    saved = load_checkpoint(path)
    check_resumable(saved, config, data.digest)
    if not engine.accelerate_checkpoints and "trainable" not in saved:
        raise UserError(f"{config.out} was checkpointed by FSDP / DeepSpeed: resume it under the same engine, "
                        "or --resume false")
    return saved


def _build_model(config: TrainConfig, accelerator: Accelerator, engine: distributed.Engine,
                 data: TrainData) -> Learner:
    """Model (+ LoRA), frozen teacher, AdamW, warm-up + cosine, prepared by accelerate (a
    resumed run's state is restored by `ConsistencyTrainer.restore`)."""
    recipe = config.recipe
    tokenizer = load_tokenizer(config.model)
    torch.manual_seed(recipe.seed)
    model = load_model(config.model, dtype="float32")
    if config.gradient_checkpointing:
        enable_checkpointing(model)
    if recipe.lora:
        model = add_lora(model, config)
    model.train()
    base = model.get_base_model() if recipe.lora else model
    teacher = load_teacher(config, model, accelerator.device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=config.weight_decay)
    scheduler = warmup_cosine(optimizer, data.total, round(recipe.warmup_ratio * data.total))
    # accelerate's `accumulate` syncs gradients (DDP, FSDP) and steps DeepSpeed's engine on the
    # last of a step's micro-batches; DeepSpeed reads its batch geometry from the same numbers
    accelerator.gradient_accumulation_steps = data.accumulation
    if engine.name == "deepspeed":
        distributed.fill_deepspeed_config(accelerator.state.deepspeed_plugin.deepspeed_config, micro_batch=data.micro,
                                          accumulation=data.accumulation, grad_clip=config.grad_clip)
    prepared, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(scheduler)
    return Learner(tokenizer=tokenizer, model=prepared, base=base, keep=accepts_logits_to_keep(base), teacher=teacher,
                   optimizer=optimizer, scheduler=scheduler)


def _load_side_inputs(config: TrainConfig, accelerator: Accelerator, data: TrainData, learner: Learner) -> SideInputs:
    """The text stream of the AR windows, the rollout prompts, and the held-out prompts (the
    main process alone evaluates)."""
    recipe = config.recipe
    side = SideInputs(eval_block=config.eval_block_size or data.meta.block_size)
    side.text_stream = load_text_stream(recipe.ar_text, learner.tokenizer) if recipe.ar_text else None
    context = position_limit(learner.base)
    rollout_room = (context or 10**9) - recipe.rollout_tokens
    if recipe.rollout_prompts and rollout_room < 1:
        raise UserError(f"rollout-tokens {recipe.rollout_tokens} leaves no room for a prompt")
    side.prompts = [p[-rollout_room:] for p in rollout_prompts(data.records)] if recipe.rollout_prompts else []
    if config.eval_count and recipe.eval_prompts and accelerator.is_main_process:
        side.eval_prompts = heldout_prompts(recipe.eval_prompts, learner.tokenizer, count=config.eval_count,
                                            max_new_tokens=recipe.eval_max_new_tokens, context=context,
                                            text_field=config.text_field)
    return side


def _announce(run: ConsistencyTrainer, *, resuming: bool) -> None:
    """What the run will do, in the log: its data, batch and length, and its held-out set."""
    recipe, data = run.config.recipe, run.data
    unit = "prompts" if recipe.layout == "packed" else "records"
    batch = f"batch size {recipe.batch_size}"
    if data.accumulation > 1:
        batch += f" ({data.accumulation} micro-batches of {data.micro} per process)"
    if recipe.max_steps is not None:
        length = f"--max-steps {data.total} ({data.total / data.per_epoch:.2f} epochs)"
    else:
        epochs = recipe.epochs or 1
        length = f"{epochs} epoch{'s' if epochs > 1 else ''} = {data.total} steps"
    where = "resuming" if resuming else "starting"
    log.info("train: %s %s, %s: %d steps per epoch, %s; %s", f"{len(data.units):,}", unit, batch, data.per_epoch,
             length, where)
    log.info("train: %s", data.eval_line)


def _finish(run: ConsistencyTrainer) -> TrainSummary:
    """A finished run exports the HF checkpoint (with --select gated, the chosen step's
    weights), train_summary.json and MODEL_CARD.md; every run returns its summary."""
    config, accelerator, out, data = run.config, run.accelerator, run.out, run.data
    finished = run.step >= data.total
    chosen = run.best if config.recipe.select == "gated" else None
    if config.recipe.select == "gated" and run.best is None and finished and run.is_main:
        log.warning("no evaluation passed the gates (looping, degenerate); the last step's weights are exported")
    summary = TrainSummary(out=str(out), finished=finished, steps=run.step, total_steps=data.total,
                           records=len(data.records), train_time_s=round(run.elapsed, 1),
                           final_loss=run.loss if run.loss is not None else _last_loss(run.plan.log),
                           eval_before=run.eval_before,
                           eval_after=(chosen["eval"] if chosen else run.eval_last) if finished else None,
                           selected_step=chosen["step"] if chosen and finished else None)
    if finished and chosen and run.is_main:  # the gated choice's weights (the run's own state stays in last.pt)
        saved = load_checkpoint(out / BEST)
        load_trainable_state(accelerator.unwrap_model(run.learner.model), saved["trainable"])
    if finished:
        export(accelerator, run.learner.model, run.learner.tokenizer, out, lora=config.recipe.lora)
    if finished and run.is_main:
        _write_summary(run, summary)
    accelerator.wait_for_everyone()
    return summary


def _write_summary(run: ConsistencyTrainer, summary: TrainSummary) -> None:
    """train_summary.json and MODEL_CARD.md beside the exported checkpoint."""
    config = run.config
    info = {"summary": asdict(summary), "base_model": config.model,
            "base_fingerprint": run.data.base_fingerprint, "model_fingerprint": fingerprint(run.out),
            "data": config.data, "data_meta": asdict(run.data.meta), "config": config_to_dict(config),
            "processes": run.processes, "engine": run.engine.name,
            "eval_settings": {"prompts": config.recipe.eval_prompts, "count": len(run.side.eval_prompts),
                              "block_size": run.side.eval_block,
                              "max_new_tokens": config.recipe.eval_max_new_tokens}}
    (run.out / SUMMARY).write_text(json.dumps(info, indent=2) + "\n")
    (run.out / CARD).write_text(cllm_card(info))


def _last_loss(log_path: Path) -> float | None:
    lines = [json.loads(x) for x in log_path.read_text().splitlines()] if log_path.exists() else []
    losses_ = [r["loss"] for r in lines if "loss" in r]
    return losses_[-1] if losses_ else None
