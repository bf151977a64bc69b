"""A `cllm train` run's inputs and folder: the checks made before anything long starts, the
trajectories (checked against the model), what a resume must find unchanged, the trainable
state a checkpoint holds, LoRA, and the exported HF checkpoint.

OUT holds train_config.json, train_log.jsonl, checkpoints/last.pt (and best.pt with
``--select gated``) while training; a finished run adds the HF checkpoint, train_summary.json
and MODEL_CARD.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from cllm.core.config import config_to_dict
from cllm.core.errors import UserError, first_line
from cllm.core.outputs import check_folder, share_like_siblings
from cllm.core.runs import check_same_run
from cllm.data.prompts import load_prompts
from cllm.data.trajectories import TrajectoryMeta, TrajectoryReader, TrajectoryRecord
from cllm.models import fingerprint, resolve_model_path, save_tokenizer, tokenizer_fingerprint, vocab_size
from cllm.training.batches import check_text_source
from cllm.training.config import NO_EVAL_PROMPTS, TrainConfig, default_eval_set, one_length, with_one_length

log = logging.getLogger(__name__)

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


# ---------------------------------------------------------------------------------------------
# Before anything long: every input but the trajectories (`open_data` reads those)


def check_inputs(config: TrainConfig) -> None:
    """The model, the teacher (and that it tokenizes as the model does), the --ar-text, the
    held-out prompts and the output folder: each problem one UserError, before any model loads."""
    resolve_model_path(config.model)
    recipe = config.recipe
    if config.teacher:
        resolve_model_path(config.teacher)
    teacher = config.teacher or config.model
    if recipe.needs_teacher and teacher != config.model and \
            tokenizer_fingerprint(teacher) != tokenizer_fingerprint(config.model):
        raise UserError(f"--teacher {teacher} has another tokenizer than --model {config.model}")
    if recipe.ar_text:
        check_text_source(recipe.ar_text)
    if config.eval_count and recipe.eval_prompts:
        load_prompts(recipe.eval_prompts, text_field=config.text_field, limit=1)
    check_run_folder(Path(config.out), config)


def check_run_folder(out: Path, config: TrainConfig) -> None:
    """--out is a folder this run may write (`cllm.core.outputs`: a new one, or one holding a
    `cllm train` run), never the model's or the data's own folder."""
    data = [("--data", p.strip()) for p in config.data.split(",") if p.strip()]
    check_folder(out, "train", inputs=[("--model", resolve_model_path(config.model)), *data])


# ---------------------------------------------------------------------------------------------
# The data, and what the config leaves to it


def open_data(config: TrainConfig, base_fingerprint: str) -> tuple[TrajectoryReader, list[TrajectoryRecord]]:
    """The trajectory directories (comma-separated: their records together, e.g. earlier on-policy
    rounds kept beside the latest), each collected with --model (`base_fingerprint`: its
    `cllm.models.fingerprint`) or --teacher, one block size and tokenizer; every problem is one
    UserError. Returns the first directory's reader (its meta describes the run) and all records."""
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
        records += _within_vocabulary(reader.records(), path, vocab_size(config.model))
    if not records:  # fewer than --batch-size: train fits the batch to them (`fit_batch_size`)
        raise UserError(f"{config.data} holds no records")
    if config.recipe.ar_on_labels and not any(r.labels for r in records):
        raise UserError(f"{config.data} has no ground-truth labels (its prompts had no references): "
                        "use --ar-target fixed_points or auto")
    return readers[0], records


def _within_vocabulary(records: list[TrajectoryRecord], path: Path, vocab: int | None) -> list[TrajectoryRecord]:
    """`records`, unless one holds a token id the model has no embedding for (a shard of
    another model's collect, or a damaged one): then one UserError naming it."""
    for r in records if vocab is not None else ():
        top = max(max(row, default=0) for row in r.token_rows())
        if top >= vocab:
            raise UserError(f"{path}: prompt {r.prompt_id!r} block {r.block_index} holds token id {top}, outside "
                            f"--model's vocabulary of {vocab}: not this model's trajectories")
    return records


def resolve_ar_target(config: TrainConfig, records: Sequence[TrajectoryRecord]) -> TrainConfig:
    """--ar-target auto: the labels when the records have them, else the fixed points."""
    if config.recipe.ar_target != "auto":
        return config
    has_labels = any(r.labels for r in records)
    if not has_labels:
        log.info("ar-target auto: the trajectories have no references, so the AR rows are the fixed points")
    return dataclasses.replace(config, recipe=dataclasses.replace(
        config.recipe, ar_target="labels" if has_labels else "fixed_points"))


def resolve_eval_set(config: TrainConfig, meta: TrajectoryMeta) -> tuple[TrainConfig, str]:
    """No --eval-prompts: stdlib-val in the shipped models' domain (`default_eval_set`: the model
    or the trajectories' prompts), else no held-out evaluation. Returns the config with the set
    it evaluates on and a line saying which (or why none)."""
    recipe = config.recipe
    if not config.eval_count:
        return config, "no held-out evaluation (--eval-count 0)"
    if recipe.eval_prompts is None:
        found = default_eval_set(config.model, meta.prompts)
        if found is None:
            return config, (f"{NO_EVAL_PROMPTS}: the trajectories' prompts ({meta.prompts}) are not the stdlib "
                            "domain, so no held-out evaluation; pass a JSONL of held-out prompts")
        config = dataclasses.replace(config, recipe=dataclasses.replace(recipe, eval_prompts=found))
    return config, (f"held-out evaluation on {config.recipe.eval_prompts} (its first {config.eval_count} prompts at "
                    f"most) every {recipe.eval_interval} steps")


def data_digest(records: Sequence[TrajectoryRecord]) -> str:
    h = hashlib.sha256()
    for r in records:
        h.update(repr((r.prompt_id, r.block_index, r.fixed_point, len(r.states))).encode())
    return h.hexdigest()[:16]


def check_resumable(saved: dict, config: TrainConfig, digest: str) -> None:
    """The checkpoint in OUT was written by this very run: the same options (but `RESUME_FREE`;
    the training length compared as `one_length` writes it) and the same records."""
    saved_length, length = _length(one_length(saved["config"])), _length(one_length(config_to_dict(config)))
    if saved_length != length:
        raise UserError(f"{config.out} holds a run of {saved_length}, not {length}: use another --out, --resume "
                        "false, or the same length")
    check_same_run(one_length(saved["config"]), with_one_length(config), free=RESUME_FREE)
    if saved["data_digest"] != digest:
        raise UserError(f"the records in {config.data} changed since {config.out} was checkpointed: "
                        "use another --out or --resume false")


def _length(values: dict) -> str:
    """A training length in `one_length`'s form, as the options that ask for it."""
    if values["max_steps"] is not None:
        return f"--max-steps {values['max_steps']}"
    return f"{values['epochs']} epoch{'s' if values['epochs'] > 1 else ''}"


# ---------------------------------------------------------------------------------------------
# Weights: what a checkpoint holds, LoRA, the export


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
    if lora:  # the whole model is on every process (`distributed.check_engine`): merge on the main one
        if accelerator.is_main_process:
            unwrapped.merge_and_unload().save_pretrained(out, safe_serialization=True)
    else:
        weights = accelerator.get_state_dict(model)
        if accelerator.is_main_process:
            unwrapped.save_pretrained(out, state_dict=weights, safe_serialization=True)
    if accelerator.is_main_process:
        save_tokenizer(tokenizer, out)  # the source's files: the same tokenizer, the same fingerprint
        share_like_siblings(out)
