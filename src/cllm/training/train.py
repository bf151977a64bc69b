"""`cllm train`: consistency (GC / LC) + AR fine-tuning on collected Jacobi trajectories
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
   ``--select gated``, keep the weights of the fastest evaluation that passes the text gates).

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
import hashlib
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from cllm.core.config import config_to_dict, write_config
from cllm.core.errors import UserError, first_line
from cllm.core.runs import append_jsonl, check_same_run, save_checkpoint, sigint_flag, truncate_log
from cllm.core.seeds import derived_seed
from cllm.data.trajectories import TrajectoryReader, TrajectoryRecord
from cllm.decoding.cache import accepts_logits_to_keep
from cllm.evaluation.gates import passes_text_gates
from cllm.evaluation.heldout import evaluate_heldout, heldout_prompts
from cllm.modeling import losses
from cllm.modeling.forwards import enable_checkpointing
from cllm.training import distributed as parallel
from cllm.training.batches import (
    Counts,
    load_text_stream,
    make_micro_batch,
    make_rollouts,
    prompt_chains,
    rollout_prompts,
    sample_text_windows,
    step_records,
    step_rollout_prompts,
)
from cllm.training.cards import cllm_card, fmt
from cllm.training.objective import load_teacher, micro_batch_loss
from cllm.training.schedule import warmup_cosine

log = logging.getLogger(__name__)

Consistency = Literal["gc", "lc", "gc+lc"]
ArTarget = Literal["auto", "labels", "fixed_points", "both"]

CHECKPOINT = "checkpoints/last.pt"
BEST = "checkpoints/best.pt"  # --select gated: the weights of the best evaluation that passed the gates
CONFIG = "train_config.json"
LOG = "train_log.jsonl"
SUMMARY = "train_summary.json"
CARD = "MODEL_CARD.md"
# Options that may change between a run and its resumption without changing what it computes
# (a different micro-batch size or gradient checkpointing changes only the order of float sums).
RESUME_FREE = {"resume", "stop_at_step", "checkpoint_interval", "eval_interval", "micro_batch_size",
               "gradient_checkpointing"}


@dataclass
class TrainConfig:
    model: str = field(default="stdlib-coder", metadata={"help": "the target the trajectories were collected with "
        "(shipped name, checkpoint dir or hub id); training starts from it"})
    data: str = field(default="runs/trajectories", metadata={"help": "trajectory directory written by `cllm collect`"})
    out: str = field(default="runs/cllm", metadata={"help": "output directory (HF checkpoint, log, model card, "
        "checkpoints/); rerun to resume"})
    consistency: Consistency = field(default="gc", metadata={"help": "consistency loss: global (GC, the reference), "
        "local (LC), or both"})
    distance: losses.Distance = field(default="fkl", metadata={"help": "distance of the consistency loss: forward KL "
        "(the reference), reverse KL, JSD, or argmax (cross-entropy on the target's argmax)"})
    ar_weight: float = field(default=10.0, metadata={"help": "weight w of the AR loss in consistency + w * AR "
        "(reference 10)"})
    ar_target: ArTarget = field(default="auto", metadata={"help": "AR rows: the ground truth (labels), the target's "
        "fixed points, both, or auto (labels when the trajectories' prompts had references, else fixed points)"})
    ar_text: str | None = field(default=None, metadata={"help": "AR loss also on random windows of this text: "
        "'stdlib-train' (the embedded corpus) or a UTF-8 text file; keeps language modelling over whole contexts, not "
        "only the prompts' continuations"})
    ar_text_windows: int = field(default=8, metadata={"help": "text windows per step (with --ar-text)"})
    ar_text_length: int = field(default=256, metadata={"help": "tokens per text window (with --ar-text)"})
    label_smoothing: float = field(default=0.1, metadata={"help": "label smoothing of the AR loss (reference 0.1)"})
    teacher: str | None = field(default=None, metadata={"help": "the frozen model of --kd-weight and "
        "--consistency-teacher target (default: --model; with LoRA and no --teacher, the model with its adapter "
        "disabled); trajectories collected with it are accepted too"})
    kd_weight: float = field(default=0.0, metadata={"help": "weight of a distillation term D(teacher || model) on the "
        "AR rows (labels / fixed points / text windows, as --ar-target and --ar-text choose) and on --rollout-prompts: "
        "soft labels from the frozen teacher, in place of (--ar-weight 0) or beside the hard AR term"})
    kd_distance: losses.Distance = field(default="fkl", metadata={"help": "distance of the distillation term: forward "
        "KL(teacher || model), reverse KL, JSD, or argmax (cross-entropy on the teacher's argmax: what greedy decoding "
        "keeps)"})
    consistency_teacher: Literal["model", "target"] = field(default="model", metadata={"help": "whose logits on the "
        "fixed point (GC) or next state (LC) the states learn: the model being trained, stop-gradient (the reference), "
        "or the frozen teacher"})
    rollout_prompts: int = field(default=0, metadata={"help": "on-policy distillation: per step, this many of the "
        "records' prompts are continued by the model being trained and the distillation term also counts on its text "
        "(GKD)"})
    rollout_tokens: int = field(default=128, metadata={"help": "new tokens per rollout"})
    rollout_temperature: float = field(default=0.0, metadata={"help": "0: greedy rollouts; > 0: sampled at this "
        "temperature"})
    rollout_policy: Literal["model", "teacher"] = field(default="model", metadata={"help": "who writes the rollouts: "
        "the model being trained (on-policy, GKD) or the frozen teacher (its own continuations, e.g. sampled at a low "
        "temperature as Medusa-2's self-distillation data)"})
    lr: float = field(default=2e-4, metadata={"help": "peak learning rate (AdamW); the reference used 2e-5 on 7B "
        "models"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    warmup_ratio: float = field(default=0.03, metadata={"help": "linear warm-up over this fraction of the steps, then "
        "cosine decay to 0"})
    epochs: int = field(default=1, metadata={"help": "passes over the records (ignored when max-steps is set)"})
    max_steps: int | None = field(default=None, metadata={"help": "optimizer steps (overrides epochs)"})
    batch_size: int = field(default=16, metadata={"help": "records (--layout packed: prompts) per optimizer step, all "
        "processes together"})
    micro_batch_size: int | None = field(default=None, metadata={"help": "records (--layout packed: prompts) per "
        "forward (gradient accumulation); default batch-size / processes"})
    grad_clip: float = field(default=1.0, metadata={"help": "clip the gradient norm to this (0: off)"})
    dtype: Literal["float32", "bfloat16"] = field(default="float32", metadata={"help": "bfloat16: the forwards in bf16 "
        "(autocast; weights, optimizer and checkpoint stay float32); under FSDP and DeepSpeed their bf16 mixed "
        "precision (DeepSpeed: bf16 weights beside float32 master weights)"})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "recompute each layer's activations in "
        "backward (transformers' gradient checkpointing): far less activation memory, about a third more compute, and "
        "each state row then recomputes its record's prefix (no shared KV cache)"})
    lora: bool = field(default=False, metadata={"help": "train a LoRA adapter (peft) instead of all weights; merged "
        "into the saved checkpoint"})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank"})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha"})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout"})
    lora_targets: str = field(default="all-linear", metadata={"help": "LoRA target modules: all-linear or "
        "comma-separated module names"})
    augmented: bool = field(default=False, metadata={"help": "GC also samples the augmented states of the data (GC "
        "only)"})
    gc_window: int | None = field(default=None, metadata={"help": "GC counts only this many positions after the first "
        "wrong one (default: all, the reference)"})
    state_schedule: Literal["uniform", "progressive"] = field(default="uniform", metadata={"help": "which states of a "
        "record train: uniformly drawn (the reference), or Jacobi Forcing's progressive schedule: block j of a prompt "
        "aims at noise linspace(0, 1, 16)[j mod 16] (noise = the fraction of the block's tokens not yet at the fixed "
        "point) and takes the states nearest to it"})
    skip_copies: bool = field(default=False, metadata={"help": "consistency counts no position whose target equals one "
        "of the two state tokens before it while that token is wrong: copying a wrong input token forward is the "
        "shortcut that teaches repetition"})
    cut_loops: bool = field(default=False, metadata={"help": "consistency counts no fixed-point token that continues a "
        "loop (the text up to it ends in a pattern of at most 8 tokens repeated over 24): an on-policy round's own "
        "repetitions are cut out of its targets, the rest of the prompt kept"})
    layout: Literal["records", "packed"] = field(default="records", metadata={"help": "how a micro-batch's forward "
        "is laid out: records (each record's prefix once, its states after it) or packed (Jacobi Forcing's: one "
        "sequence per prompt, its clean text, the prompt and every fixed point, once, then the state blocks of all its "
        "records, each attending to the prompt, the fixed points before its block and itself); packed draws whole "
        "prompts, so --batch-size and --micro-batch-size count prompts"})
    states_per_record: int = field(default=1, metadata={"help": "distinct states sampled per record and step; they "
        "share one forward of the record's prefix, so k states cost far less than k records"})
    seed: int = field(default=0, metadata={"help": "seed of data order, state sampling, dropout, LoRA init"})
    eval_prompts: str = field(default="stdlib-val", metadata={"help": "held-out prompt set (name or JSONL/Parquet "
        "file) for evaluation"})
    eval_count: int = field(default=16, metadata={"help": "evaluate on the first N held-out prompts (0: no "
        "evaluation)"})
    eval_block_size: int | None = field(default=None, metadata={"help": "Jacobi block size of the evaluation (default: "
        "the data's)"})
    eval_max_new_tokens: int = field(default=64, metadata={"help": "new tokens per prompt in the evaluation; also caps "
        "the reference tokens of the AR validation loss"})
    eval_batch_size: int = field(default=8, metadata={"help": "prompts per batch in the evaluation"})
    eval_interval: int = field(default=100, metadata={"help": "evaluate every N steps (also before the first and after "
        "the last)"})
    select: Literal["last", "gated"] = field(default="last", metadata={"help": "which weights OUT ends with: the last "
        "step's, or (gated) those of the evaluation with the most Jacobi tokens per forward over non-looping "
        "completions among those whose greedy completions loop at most 5 points more often than the target's and "
        "degenerate at most 3% of the time (the last step's when none passes)"})
    checkpoint_interval: int = field(default=100, metadata={"help": "save the trainer state every N steps (also at the "
        "end and on Ctrl-C)"})
    stop_at_step: int | None = field(default=None, metadata={"help": "stop (with a checkpoint) once this step is "
        "reached; rerun without it to continue"})
    resume: bool = field(default=True, metadata={"help": "continue from OUT/checkpoints/last.pt if present; false "
        "starts over"})
    text_field: str = field(default="prompt", metadata={"help": "field holding the prompt text in a JSONL/Parquet eval "
        "prompt file"})

    def __post_init__(self) -> None:
        positive = ["epochs", "batch_size", "eval_max_new_tokens", "eval_batch_size", "states_per_record",
                    "ar_text_windows", "ar_text_length", "rollout_tokens",
                    "eval_interval", "checkpoint_interval", "lora_r", "lora_alpha"]
        positive += [n for n in ("max_steps", "micro_batch_size", "eval_block_size", "stop_at_step", "gc_window")
                     if getattr(self, n) is not None]
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserError(f"{name.replace('_', '-')} must be a positive integer, got {value!r}")
        choices = {"consistency": ("gc", "lc", "gc+lc"), "distance": ("fkl", "rkl", "jsd", "argmax"),
                   "state_schedule": ("uniform", "progressive"), "select": ("last", "gated"),
                   "rollout_policy": ("model", "teacher"), "layout": ("records", "packed"),
                   "kd_distance": ("fkl", "rkl", "jsd", "argmax"), "consistency_teacher": ("model", "target"),
                   "ar_target": ("auto", "labels", "fixed_points", "both"), "dtype": ("float32", "bfloat16")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise UserError(f"{name.replace('_', '-')} must be one of {', '.join(allowed)}, got "
                                f"{getattr(self, name)!r}")
        if self.micro_batch_size is not None and self.batch_size % self.micro_batch_size:
            raise UserError(f"batch-size {self.batch_size} is not a multiple of micro-batch-size "
                            f"{self.micro_batch_size}")
        for name in ("ar_weight", "kd_weight", "lr", "weight_decay", "grad_clip", "rollout_temperature"):
            if not getattr(self, name) >= 0:
                raise UserError(f"{name.replace('_', '-')} must be >= 0, got {getattr(self, name)!r}")
        if self.lr == 0:
            raise UserError("lr must be positive")
        if not 0 <= self.label_smoothing < 1 or not 0 <= self.warmup_ratio < 1 or not 0 <= self.lora_dropout < 1:
            raise UserError("label-smoothing, warmup-ratio and lora-dropout must be in [0, 1)")
        if self.augmented and self.consistency != "gc":
            raise UserError("augmented states break the adjacency LC needs: use --augmented only with --consistency gc")
        if self.eval_count < 0 or self.seed < 0 or self.rollout_prompts < 0:
            raise UserError("eval-count, seed and rollout-prompts must be >= 0")
        if self.rollout_prompts and not self.kd_weight:
            raise UserError("--rollout-prompts needs --kd-weight > 0: the rollouts are scored by the teacher")
        if not self.out or not self.data:
            raise UserError("data and out must name directories")

    @property
    def uses_gc(self) -> bool:
        return self.consistency in ("gc", "gc+lc")

    @property
    def uses_lc(self) -> bool:
        return self.consistency in ("lc", "gc+lc")

    @property
    def uses_ar_rows(self) -> bool:
        """The AR rows are computed: the hard AR term or the distillation term counts on them."""
        return self.ar_weight > 0 or self.kd_weight > 0

    @property
    def ar_on_fixed_points(self) -> bool:
        return self.uses_ar_rows and self.ar_target in ("fixed_points", "both")

    @property
    def ar_on_labels(self) -> bool:
        return self.uses_ar_rows and self.ar_target in ("labels", "both")

    @property
    def needs_teacher(self) -> bool:
        return self.kd_weight > 0 or self.consistency_teacher == "target"


# ---------------------------------------------------------------------------------------------
# Inputs, checkpoints, export


def open_data(config: TrainConfig, base_fingerprint: str) -> tuple[TrajectoryReader, list[TrajectoryRecord]]:
    """The trajectory directories (comma-separated: their records together, e.g. earlier on-policy
    rounds kept beside the latest), each collected with --model (`base_fingerprint`: its
    `cllm.models.fingerprint`) or --teacher, one block size and tokenizer; every problem is one
    UserError. Returns the first directory's reader (its meta describes the run) and all records."""
    from cllm.models import fingerprint, tokenizer_fingerprint

    paths = [Path(p.strip()) for p in config.data.split(",") if p.strip()]
    allowed = {base_fingerprint: config.model}
    tokenizer_print = tokenizer_fingerprint(config.model)
    if config.teacher:
        allowed[fingerprint(config.teacher)] = config.teacher
    readers, records = [], []
    for path in paths:
        if not path.is_dir():
            raise UserError(f"trajectory directory not found: {path}")
        reader = TrajectoryReader(path)
        meta = reader.meta
        if meta.tokenizer_fingerprint != tokenizer_print:
            raise UserError(f"{path} was collected with another tokenizer than --model {config.model} "
                            f"({meta.tokenizer_fingerprint} != {tokenizer_print})")
        if meta.model_fingerprint not in allowed:
            raise UserError(f"{path} was collected with another model ({meta.model!r}, fingerprint "
                            f"{meta.model_fingerprint}) than --model {config.model} ({base_fingerprint})"
                            + (f" or --teacher {config.teacher}" if config.teacher else ""))
        if readers and meta.block_size != readers[0].meta.block_size:
            raise UserError(f"{path} has block size {meta.block_size}, {readers[0].directory} "
                            f"{readers[0].meta.block_size}: train on one block size at a time")
        readers.append(reader)
        records += reader.records()
    if len(records) < config.batch_size:
        raise UserError(f"{config.data} holds {len(records)} records, fewer than batch-size {config.batch_size}")
    if config.ar_on_labels and not any(r.labels for r in records):
        raise UserError(f"{config.data} has no ground-truth labels (its prompts had no references): "
                        "use --ar-target fixed_points or auto")
    return readers[0], records


def resolve_ar_target(config: TrainConfig, records: Sequence[TrajectoryRecord]) -> TrainConfig:
    """--ar-target auto: the labels when the records have them, else the fixed points."""
    if config.ar_target != "auto":
        return config
    has_labels = any(r.labels for r in records)
    if not has_labels:
        log.info("ar-target auto: the trajectories have no references, so the AR rows are the fixed points")
    return dataclasses.replace(config, ar_target="labels" if has_labels else "fixed_points")


def data_digest(records: Sequence[TrajectoryRecord]) -> str:
    h = hashlib.sha256()
    for r in records:
        h.update(repr((r.prompt_id, r.block_index, r.fixed_point, len(r.states))).encode())
    return h.hexdigest()[:16]


def check_out_dir(out: Path, config: TrainConfig) -> None:
    from cllm.models import resolve_model_path

    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a directory")
    model_dir = Path(resolve_model_path(config.model))
    for other, what in ((model_dir, "--model"), (Path(config.data), "--data")):
        if other.exists() and out.resolve() == other.resolve():
            raise UserError(f"--out {out} is the {what} directory; choose another")
    if out.is_dir() and any(out.iterdir()) and not (out / CONFIG).exists():
        raise UserError(f"--out {out} holds other files (no {CONFIG}); use a new directory")


def check_resumable(saved: dict, config: TrainConfig, digest: str) -> None:
    check_same_run(saved["config"], config, free=RESUME_FREE)
    if saved["data_digest"] != digest:
        raise UserError(f"the records in {config.data} changed since {config.out} was checkpointed: "
                        "use another --out or --resume false")


def trainable_state(model) -> dict[str, torch.Tensor]:
    """The weights training changes: all of them, or the LoRA adapter's."""
    return {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters() if p.requires_grad}


def load_trainable_state(model, state: dict[str, torch.Tensor]) -> None:
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    if set(state) != names:
        raise UserError(f"checkpoint weights do not match the model ({len(set(state) ^ names)} names differ)")
    model.load_state_dict(state, strict=False)


def add_lora(model, config: TrainConfig):
    from peft import LoraConfig, get_peft_model

    targets = config.lora_targets if config.lora_targets == "all-linear" else [
        t.strip() for t in config.lora_targets.split(",") if t.strip()]
    lora = LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                      target_modules=targets, task_type="CAUSAL_LM")
    try:
        return get_peft_model(model, lora)
    except ValueError as exc:
        raise UserError(f"cannot add LoRA: {first_line(exc)}") from None


def export(accelerator, model, tokenizer, out: Path, *, lora: bool) -> None:
    """An ordinary HF checkpoint: LoRA merged into the weights, safetensors (float32; bf16 under
    DeepSpeed's bf16). Called by every process: gathering split weights (FSDP, ZeRO-3) takes all
    of them; the main process writes."""
    unwrapped = accelerator.unwrap_model(model)
    if lora:  # the whole model is on every process (`parallel.check_engine`): merge on the main one
        if accelerator.is_main_process:
            unwrapped.merge_and_unload().save_pretrained(out, safe_serialization=True)
    else:
        weights = accelerator.get_state_dict(model)
        if accelerator.is_main_process:
            unwrapped.save_pretrained(out, state_dict=weights, safe_serialization=True)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(out)


# ---------------------------------------------------------------------------------------------
# The loop


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


@dataclass
class _Run:
    """What the steps of one `train` call share (state only; the functions below move it)."""

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
    step: int = 0
    elapsed: float = 0.0
    eval_before: dict | None = None
    eval_last: dict | None = None
    best: dict | None = None  # --select gated: the fastest evaluation that passed the gates
    loss: float | None = None

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


def train(config: TrainConfig) -> TrainSummary:
    """Consistency-train `config.model` on `config.data` into `config.out` (resumable).

    Args:
        config: a validated `TrainConfig`. Rerunning with the same config resumes from the last
            checkpoint; Ctrl-C saves one before stopping.
    """
    run = _open_run(config)  # 1. processes, data, batch geometry, output dir, checkpoint to resume
    _build_model(run)  # 2. model (+ LoRA), teacher, AdamW, schedule; restored when resuming
    _load_side_inputs(run)  # 3. text windows, rollout prompts, held-out prompts
    if run.saved is None:  # the untrained model's evaluation: the baseline of every later one
        run.eval_before = run.eval_last = _evaluate(run)
        if run.is_main and run.eval_before:
            append_jsonl(run.log_path, {"step": 0, **{f"eval_{k}": v for k, v in run.eval_before.items()}})
    _loop(run)  # 4. optimizer steps, logging, evaluations, checkpoints
    return _finish(run)  # 5. the HF checkpoint, summary and model card (a finished run only)


def _open_run(config: TrainConfig) -> _Run:
    """Accelerate's processes, the records (checked against --model), the batch geometry, the
    output directory and the checkpoint to resume, if any."""
    from accelerate import Accelerator
    from accelerate.utils import parse_flag_from_env

    # Without a GPU, several launched processes are gloo CPU processes (see cllm.training.collect).
    use_cpu = parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.cuda.is_available()
    accelerator = Accelerator(cpu=use_cpu, mixed_precision=parallel.mixed_precision(config.dtype, os.environ))
    P = accelerator.num_processes
    engine = parallel.engine_of(accelerator)
    parallel.check_engine(engine, eval_count=config.eval_count, lora=config.lora,
                          model_rollouts=bool(config.rollout_prompts) and config.rollout_policy == "model")
    out = Path(config.out)
    from cllm.models import fingerprint

    base_fingerprint = fingerprint(config.model)  # read once: checked against the data, written in the summary
    reader, records = open_data(config, base_fingerprint)
    config = resolve_ar_target(config, records)
    check_out_dir(out, config)
    micro = config.micro_batch_size or max(config.batch_size // P, 1)
    if config.batch_size % (micro * P):
        raise UserError(f"batch-size {config.batch_size} must be a multiple of micro-batch-size {micro} "
                        f"x {P} processes")
    units = prompt_chains(records) if config.layout == "packed" else records
    if len(units) < config.batch_size:  # (records: `open_data` checked them)
        raise UserError(f"{config.data} holds {len(units)} prompts, fewer than batch-size {config.batch_size} "
                        "(--layout packed counts prompts)")
    per_epoch = len(units) // config.batch_size
    run = _Run(config=config, accelerator=accelerator, engine=engine, out=out, meta=reader.meta, records=records,
               units=units,
               micro=micro, accumulation=config.batch_size // (micro * P), per_epoch=per_epoch,
               max_states=max(len(r.states) + (len(r.augmented_states) if config.augmented else 0)
                              for r in records),
               total=config.max_steps or config.epochs * per_epoch, digest=data_digest(records),
               base_fingerprint=base_fingerprint)
    if run.ckpt_path.exists() and config.resume:
        run.saved = torch.load(run.ckpt_path, map_location="cpu", weights_only=False)
        check_resumable(run.saved, config, run.digest)
        if not engine.accelerate_checkpoints and "trainable" not in run.saved:
            raise UserError(f"{out} was checkpointed by FSDP / DeepSpeed: resume it under the same engine, "
                            "or --resume false")
    accelerator.wait_for_everyone()
    if run.is_main:
        if run.saved is None:
            for stale in (run.ckpt_path, out / BEST, run.log_path, out / SUMMARY):
                stale.unlink(missing_ok=True)
        out.mkdir(parents=True, exist_ok=True)
        write_config(config, out / CONFIG)
    return run


def _build_model(run: _Run) -> None:
    """Model (+ LoRA), frozen teacher, AdamW, warm-up + cosine, prepared by accelerate; the
    checkpoint's weights, optimizer, schedule and position when resuming."""
    from cllm.models import load_model, load_tokenizer

    config, accelerator = run.config, run.accelerator
    run.tokenizer = load_tokenizer(config.model)
    torch.manual_seed(config.seed)
    model = load_model(config.model, dtype="float32")
    if config.gradient_checkpointing:
        enable_checkpointing(model)
    if config.lora:
        model = add_lora(model, config)
    model.train()
    run.base = model.get_base_model() if config.lora else model
    run.keep = accepts_logits_to_keep(run.base)
    run.teacher = load_teacher(config, model, accelerator.device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    warmup = round(config.warmup_ratio * run.total)
    run.scheduler = warmup_cosine(optimizer, run.total, warmup)
    # accelerate's `accumulate` syncs gradients (DDP, FSDP) and steps DeepSpeed's engine on the
    # last of a step's micro-batches; DeepSpeed reads its batch geometry from the same numbers
    accelerator.gradient_accumulation_steps = run.accumulation
    if run.engine.name == "deepspeed":
        parallel.fill_deepspeed_config(accelerator.state.deepspeed_plugin.deepspeed_config, micro_batch=run.micro,
                                       accumulation=run.accumulation, grad_clip=config.grad_clip)
    run.model, run.optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(run.scheduler)
    saved = run.saved
    if saved is None:
        return
    if run.engine.accelerate_checkpoints:
        parallel.load_accelerate_state(accelerator, run.ckpt_path.parent, saved)
    else:
        load_trainable_state(accelerator.unwrap_model(run.model), saved["trainable"])
        run.optimizer.load_state_dict(saved["optimizer"])
        run.scheduler.load_state_dict(saved["scheduler"])
    run.step, run.elapsed = saved["step"], saved["elapsed_s"]
    run.eval_before, run.eval_last, run.best = saved["eval_before"], saved["eval_last"], saved.get("best")
    if run.is_main:
        truncate_log(run.log_path, run.step)
    log.info("resuming %s from step %d of %d", run.out, run.step, run.total)


def _load_side_inputs(run: _Run) -> None:
    """The text stream of the AR windows, the rollout prompts, and the held-out prompts (the
    main process alone evaluates)."""
    from cllm.decoding.inputs import position_limit

    config = run.config
    run.text_stream = load_text_stream(config.ar_text, run.tokenizer) if config.ar_text else None
    context = position_limit(run.base)
    rollout_room = (context or 10**9) - config.rollout_tokens
    if config.rollout_prompts and rollout_room < 1:
        raise UserError(f"rollout-tokens {config.rollout_tokens} leaves no room for a prompt")
    run.prompts = [p[-rollout_room:] for p in rollout_prompts(run.records)] if config.rollout_prompts else []
    run.eval_block = config.eval_block_size or run.meta.block_size
    if config.eval_count and run.is_main:
        run.eval_prompts = heldout_prompts(config.eval_prompts, run.tokenizer, count=config.eval_count,
                                           max_new_tokens=config.eval_max_new_tokens, context=context,
                                           text_field=config.text_field)


def _evaluate(run: _Run) -> dict | None:
    """The held-out evaluation (main process; None elsewhere or without prompts); every
    process waits for it."""
    config, result = run.config, None
    if run.eval_prompts:
        result = evaluate_heldout(run.base, run.eval_prompts, block_size=run.eval_block,
                          max_new_tokens=config.eval_max_new_tokens, batch_size=config.eval_batch_size,
                          eos_token_id=run.meta.eos_token_id, pad_id=run.meta.pad_token_id,
                          bf16=config.dtype == "bfloat16", seed=config.seed)
    run.accelerator.wait_for_everyone()
    return result


def _write_checkpoint(run: _Run) -> None:
    """OUT/checkpoints/last.pt: the position and evaluations, with the trainable weights,
    optimizer and scheduler, or (FSDP, DeepSpeed) naming accelerate's state folder beside it."""
    epoch, index = divmod(run.step, run.per_epoch)
    meta = {"step": run.step, "elapsed_s": run.elapsed, "config": config_to_dict(run.config),
            "data_digest": run.digest, "data_position": {"epoch": epoch, "batch_in_epoch": index},
            "eval_before": run.eval_before, "eval_last": run.eval_last, "best": run.best}
    if run.engine.accelerate_checkpoints:
        parallel.save_accelerate_state(run.accelerator, run.ckpt_path.parent, run.step, meta, run.ckpt_path)
    elif run.is_main:
        save_checkpoint(run.ckpt_path, {**meta, "trainable": trainable_state(run.accelerator.unwrap_model(run.model)),
                                        "optimizer": run.optimizer.state_dict(),
                                        "scheduler": run.scheduler.state_dict()})


def _consider(run: _Run, evaluation: dict) -> None:
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


def _train_step(run: _Run) -> tuple[torch.Tensor, float, float]:
    """One optimizer step on the global batch: this process's micro-batches, ONE backward each,
    then clip, AdamW and the schedule. Returns this process's loss sums (total, gc, lc, ar, kd),
    the learning rate used and the gradient norm."""
    config, accelerator, meta = run.config, run.accelerator, run.meta
    P, rank, micro, step = run.processes, run.accelerator.process_index, run.micro, run.step
    # 1. the global batch: records, one state each, micro-batches, global counts
    torch.manual_seed(derived_seed(config.seed, "step", step, rank))  # dropout
    batch = step_records(run.units, step, batch_size=config.batch_size, seed=config.seed)
    shares = [batch[i : i + micro] for i in range(0, len(batch), micro)]
    if config.layout == "packed":  # whole prompts: each micro-batch takes all of its prompts' records
        shares = [[r for chain in share for r in chain] for share in shares]
    draws = torch.rand(sum(map(len, shares)), run.max_states,
                       generator=torch.Generator().manual_seed(derived_seed(config.seed, "states", step)))
    mbs = [make_micro_batch(share, part, pad_id=meta.pad_token_id, block_size=meta.block_size, config=config)
           for share, part in zip(shares, draws.split([len(s) for s in shares]), strict=True)]
    if run.text_stream is not None:  # the step's text windows, dealt out to the micro-batches
        windows = sample_text_windows(run.text_stream, config, step)
        for mb, share in zip(mbs, windows.tensor_split(len(mbs)), strict=True):
            mb.text = share
    # the step's rollout prompts, dealt out to the micro-batches (decoded below, by their owner)
    picks = step_rollout_prompts(run.prompts, step, config) if run.prompts else []
    shares = [picks[i :: len(mbs)] for i in range(len(mbs))]
    counts = Counts()
    for mb, share in zip(mbs, shares, strict=True):
        counts.add(mb, config, rollouts=len(share))
    # 2. this process's micro-batches: forwards and ONE backward each; the last syncs
    sums = torch.zeros(5, dtype=torch.float64)
    for mb, share in list(zip(mbs, shares, strict=True))[rank::P]:
        if share:  # on-policy: the model continues its prompts as it is now (or the teacher)
            seeds = [derived_seed(config.seed, "rollout", step, i) for i in share]

            def roll(m, share=share, seeds=seeds):
                return make_rollouts(m, [run.prompts[i] for i in share], config, seeds,
                                     eos_token_id=meta.eos_token_id, pad_id=meta.pad_token_id)

            mb.rollout = roll(run.base) if config.rollout_policy == "model" else run.teacher(roll)
        with accelerator.accumulate(run.model):
            parts = micro_batch_loss(run.model, mb, counts, config, meta.pad_token_id, logits_to_keep=run.keep,
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


def _loop(run: _Run) -> None:
    """Steps until the end (or --stop-at-step, or Ctrl-C): each logged, evaluated every
    `eval_interval` steps, checkpointed every `checkpoint_interval` (every process takes the
    same branches)."""
    from tqdm.auto import tqdm

    config, accelerator = run.config, run.accelerator
    stop_at = min(run.total, config.stop_at_step or run.total)
    bar = tqdm(total=run.total, initial=run.step, desc="train", unit="step", disable=not run.is_main,
               mininterval=1.0 if sys.stderr.isatty() else 30.0, dynamic_ncols=True)
    with sigint_flag() as interrupted:
        while run.step < stop_at:
            t0 = time.perf_counter()
            sums, lr, grad_norm = _train_step(run)
            run.step += 1
            if run.processes > 1:
                sums = accelerator.reduce(sums.to(accelerator.device), "sum").cpu()
                flag = torch.tensor([float(interrupted["set"])], device=accelerator.device)
                interrupted["set"] = bool(accelerator.reduce(flag, "sum").item())
            run.loss, gc, lc, ar, kd = sums.tolist()
            record = {"step": run.step, "epoch": round(run.step / run.per_epoch, 4), "loss": run.loss, "gc": gc,
                      "lc": lc, "ar": ar, "kd": kd, "lr": lr,
                      "grad_norm": grad_norm}
            if run.step % config.eval_interval == 0 or run.step == run.total:
                run.eval_last = _evaluate(run)
                if run.eval_last:
                    record |= {f"eval_{k}": v for k, v in run.eval_last.items()}
                    if config.select == "gated" and run.is_main:
                        _consider(run, run.eval_last)
            run.elapsed += time.perf_counter() - t0
            record["elapsed_s"] = round(run.elapsed, 3)
            if run.is_main:
                append_jsonl(run.log_path, record)
            bar.update(1)
            tpf = f"{run.eval_last['tokens_per_forward']:.2f}" if run.eval_last else "-"
            bar.set_postfix(loss=f"{run.loss:.3f}", tpf=tpf, refresh=False)
            if run.step % config.checkpoint_interval == 0 or run.step == stop_at or interrupted["set"]:
                _write_checkpoint(run)
                accelerator.wait_for_everyone()
            if interrupted["set"] and run.step < run.total:
                bar.close()
                raise KeyboardInterrupt(f"stopped at step {run.step}; rerun the command to resume")
    bar.close()


def _finish(run: _Run) -> TrainSummary:
    """A finished run exports the HF checkpoint (with --select gated, the chosen step's
    weights), train_summary.json and MODEL_CARD.md; every run returns its summary."""
    from cllm.models import fingerprint

    config, accelerator, out = run.config, run.accelerator, run.out
    finished = run.step >= run.total
    chosen = run.best if config.select == "gated" else None
    if config.select == "gated" and run.best is None and finished and run.is_main:
        log.warning("no evaluation passed the gates (looping, degenerate); the last step's weights are exported")
    summary = TrainSummary(out=str(out), finished=finished, steps=run.step, total_steps=run.total,
                           records=len(run.records), train_time_s=round(run.elapsed, 1),
                           final_loss=run.loss if run.loss is not None else _last_loss(run.log_path),
                           eval_before=run.eval_before,
                           eval_after=(chosen["eval"] if chosen else run.eval_last) if finished else None,
                           selected_step=chosen["step"] if chosen and finished else None)
    if finished and chosen and run.is_main:  # the gated choice's weights (the run's own state stays in last.pt)
        saved = torch.load(out / BEST, map_location="cpu", weights_only=False)
        load_trainable_state(accelerator.unwrap_model(run.model), saved["trainable"])
    if finished:
        export(accelerator, run.model, run.tokenizer, out, lora=config.lora)
    if finished and run.is_main:
        info = {"summary": asdict(summary), "base_model": config.model,
                "base_fingerprint": run.base_fingerprint, "model_fingerprint": fingerprint(out),
                "data": config.data, "data_meta": asdict(run.meta), "config": config_to_dict(config),
                "processes": run.processes, "engine": run.engine.name,
                "eval_settings": {"prompts": config.eval_prompts, "count": len(run.eval_prompts),
                                  "block_size": run.eval_block, "max_new_tokens": config.eval_max_new_tokens}}
        (out / SUMMARY).write_text(json.dumps(info, indent=2) + "\n")
        (out / CARD).write_text(cllm_card(info))
    accelerator.wait_for_everyone()
    if run.is_main:
        _print_summary(summary)
    return summary


def _last_loss(log_path: Path) -> float | None:
    lines = [json.loads(x) for x in log_path.read_text().splitlines()] if log_path.exists() else []
    losses_ = [r["loss"] for r in lines if "loss" in r]
    return losses_[-1] if losses_ else None


def _print_summary(s: TrainSummary) -> None:
    before, after = s.eval_before or {}, s.eval_after or {}
    state = "trained" if s.finished else "stopped (rerun to continue)"
    print(f"{state}: {s.steps}/{s.total_steps} steps on {s.records} records in {s.train_time_s:.0f} s -> {s.out}")
    if s.selected_step is not None:
        print(f"  exported the weights of step {s.selected_step} (--select gated)")
    if after:
        print(f"  Jacobi tokens per forward {fmt(before.get('tokens_per_forward'))} -> "
              f"{fmt(after.get('tokens_per_forward'))}, AR validation loss "
              f"{fmt(before.get('ar_loss'))} -> {fmt(after.get('ar_loss'))}")
