"""`cllm medusa --joint` as named steps: Medusa-2, the model trained together with its heads, saved
as a new checkpoint with its heads inside, and measured against the original.

1. `_open_run`: the checkpoint folder --out (an unfinished run there is resumed) and the
   original model, which is the teacher and the starting point;
2. `read_texts` (Medusa-1's): the original's greedy continuations, the last --holdout held out,
   and the original's last hidden states on them, computed once;
3. `_build_trainer` and `_train`: the heads alone for --warmup-heads steps, then heads and model
   together (`cllm.training.medusa.joint`), each step logged, the held-out loss and a checkpoint
   (model, heads, both optimizers) every --eval-every steps;
4. `_save`: the new model (`save_pretrained`, its tokenizer beside it), then its heads in
   OUT/medusa, their tree shaped by their accuracies against the NEW model's greedy tokens and
   their fingerprint the new checkpoint's, so `load_heads(OUT, load_model(OUT))` checks out;
5. `_evaluate`: Medusa vs greedy decoding of the new model (exact, tokens per forward, as
   Medusa-1), and the new model's greedy text against the original's: loop, degenerate and
   parse rates, agreement, the original's held-out text's loss under each; `evaluation.json` and
   MODEL_CARD.md.

The model changes, so unlike Medusa-1's heads the result is a model of its own: decoding with
its heads is exactly ITS greedy output, and how far that is from the original's is measured.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from cllm.core import __version__, runs
from cllm.core.config import config_to_dict
from cllm.core.errors import UserError
from cllm.core.outputs import check_folder, removed_on_early_failure, share_like_siblings
from cllm.core.progress import progress_bar
from cllm.data.prompts import Prompt
from cllm.decoding.inputs import position_limit
from cllm.decoding.rivals.medusa import build_tree
from cllm.evaluation.gates import evaluate_set
from cllm.evaluation.lm_loss import lm_loss
from cllm.modeling.heads import HEADS_DIR, MedusaHeads
from cllm.models import (
    fingerprint,
    load_heads,
    load_model,
    load_tokenizer,
    pad_token_id,
    resolve_model_path,
    save_tokenizer,
    tokenizer_fingerprint,
)
from cllm.training.cards import medusa2_card
from cllm.training.medusa.config import (
    CARD,
    CHECKPOINT,
    EVALUATION,
    JOINT_RUN_FILES,
    LOG,
    RESUME_FREE,
    RUN_FILES,
    TEXTS,
    TRAIN_CONFIG,
    MedusaConfig,
)
from cllm.training.medusa.joint import JointTrainer, frozen_copy
from cllm.training.medusa.run import (
    HeadsRun,
    MedusaResult,
    claim_run,
    evaluate_heads,
    evaluation_prompts,
    read_texts,
    resumable,
)
from cllm.training.medusa.texts import check_texts_source, hidden_states, probe_lm_head
from cllm.training.medusa.trainer import measure_accuracies, save_heads

log = logging.getLogger(__name__)

MODEL_WEIGHTS = "model.safetensors"  # save_pretrained's file: its presence marks a finished run


@dataclass
class JointRun(HeadsRun):
    """A --joint run's state: a Medusa-1 run's, and the original's frozen LM head (the teacher)."""

    teacher: Any = None


def check_joint_out(out: Path, model_dir: Path, config: MedusaConfig) -> None:
    """Refuse (touching nothing) what `check_folder` refuses, and a finished checkpoint without
    --force (an unfinished run, with its checkpoint.pt, resumes)."""
    check_folder(out, "medusa", force=config.force, inputs=[("--model", model_dir)])
    if (out / MODEL_WEIGHTS).exists() and not (out / CHECKPOINT).exists() and not config.force:
        raise UserError(f"{out} already holds a model trained with Medusa heads; --force replaces it")


def medusa2(config: MedusaConfig) -> MedusaResult:
    """Train (or resume) a model jointly with its Medusa heads, save both in `config.out`, and
    evaluate them against the original.

    Args:
        config: a validated `MedusaConfig` with `joint` set (and `out`). Rerunning with the same
            config resumes an unfinished run; Ctrl-C saves a checkpoint and returns with
            `stopped_at` set.
    """
    with removed_on_early_failure(config.out, "medusa", useful=resumable):  # a failed first run leaves no folder
        run = _open_run(config)  # 1. the checkpoint folder, a checkpoint to resume, the original
        read_texts(run)  # 2. the original's greedy text, held-out texts, its hidden states
        _build_trainer(run)  # 3. heads, model and both optimizers; restored when resuming
        if not _train(run):  # ... warm-up, joint steps, log, held-out loss and checkpoints
            return MedusaResult(run.out, run.heads, run.before, stopped_at=run.trainer.step_index)
        after = _save(run)  # 4. the new checkpoint, its heads (tree, fingerprint) and the record
        return MedusaResult(run.out, run.heads, run.before, after, _evaluate(run))  # 5. exactness, quality


def _open_run(config: MedusaConfig) -> JointRun:
    """The checkpoint folder (checked; a new run clears what an earlier one left), whether an
    unfinished run is there to resume, the original model, its tokenizer and the first heads."""
    model_dir = Path(resolve_model_path(config.model))
    out = Path(config.out)
    check_joint_out(out, model_dir, config)
    resuming = (config.resume and not config.force and (out / CHECKPOINT).exists()
                and (out / TRAIN_CONFIG).exists())
    if resuming:
        runs.check_same_run(json.loads((out / TRAIN_CONFIG).read_text()), config, free=RESUME_FREE)
    if config.threads:
        torch.set_num_threads(config.threads)
    run = JointRun(config, out, model_dir, resuming)
    run.tokenizer = load_tokenizer(config.model)
    run.model = load_model(config.model, dtype=config.dtype, device=config.device).requires_grad_(False)
    run.heads = _initial_heads(run)  # checked now, before the long steps
    check_texts_source(config, out / TEXTS)
    probe_lm_head(run.model)
    # every input checked: only now is the folder cleared of an earlier run and claimed
    run_files = [*JOINT_RUN_FILES, MODEL_WEIGHTS, *(Path(HEADS_DIR) / name for name in RUN_FILES)]
    claim_run(config, "medusa", out, resuming, train_config=TRAIN_CONFIG, run_files=run_files)
    return run


def _build_trainer(run: JointRun) -> None:
    """The teacher (a copy of the original's LM head, taken before anything trains), fresh
    heads and the trainer; a resumed run restores model, heads and optimizers from its
    checkpoint, a new one measures the start on the held-out texts (step 0 of the log)."""
    config = run.config
    run.teacher = frozen_copy(run.model.get_output_embeddings())
    run.model.requires_grad_(True)
    run.trainer = JointTrainer(run.model, run.heads, run.train_texts, run.train_states, run.teacher,
                               steps=config.max_steps, warmup_heads=config.warmup_heads, batch_size=config.batch_size,
                               lr=config.lr, backbone_lr=config.backbone_lr, heads_weight=config.heads_weight,
                               weight_decay=config.weight_decay, warmup=config.warmup,
                               distance="fkl" if config.loss == "soft" else "argmax", head_decay=config.head_decay,
                               pad_id=pad_token_id(run.tokenizer), seed=config.seed)
    runs.begin_or_resume(run, run.out / LOG, lambda: run.trainer.evaluate(run.held_texts, run.held_states), log)


def _initial_heads(run: JointRun) -> MedusaHeads:
    """Fresh heads, or --init-heads (checked against the original: they must be its heads, and
    of the configured shape)."""
    config = run.config
    if not config.init_heads:
        return MedusaHeads.for_model(run.model, num_heads=config.heads, own_projection=config.own_projection)
    source = Path(config.init_heads)
    source = source if source.exists() else Path(resolve_model_path(config.init_heads))  # a shipped name
    heads = load_heads(source, run.model, model_path=run.model_dir if run.model_dir.is_dir() else None)
    if heads is None:
        raise UserError(f"--init-heads {config.init_heads}: no Medusa heads there")
    if (heads.num_heads, heads.own_projection) != (config.heads, config.own_projection):
        raise UserError(f"--init-heads {config.init_heads} holds {heads.num_heads} heads (own projection: "
                        f"{heads.own_projection}), not --heads {config.heads} "
                        f"(--own-projection {config.own_projection})")
    heads.meta, heads.accuracies, heads.tree = {}, None, None
    return heads.train().requires_grad_(True)


def _train(run: JointRun) -> bool:
    """The optimizer steps, as Medusa-1's `_train`; False when Ctrl-C stopped the run."""
    def shown(record: dict) -> dict[str, str]:
        return {"kl": f"{record['backbone_kl']:.4f}", "heads": f"{record['heads_loss']:.2f}",
                "head1": f"{record['agreement'][0]:.2f}"}

    return runs.train_steps(run, run.out / LOG, lambda: run.trainer.evaluate(run.held_texts, run.held_states),
                            desc="medusa --joint: training", postfix=shown)


def _save(run: JointRun) -> dict:
    """The held-out measures after training; the new model and its tokenizer saved; the heads'
    accuracies measured against the NEW model's greedy tokens (what its decoding accepts) shape
    the tree; the heads saved in OUT/medusa with the new checkpoint's fingerprint."""
    config, heads, model, out = run.config, run.heads, run.model, run.out
    after = run.trainer.evaluate(run.held_texts, run.held_states)
    model.eval().requires_grad_(False)
    heads.eval()
    model.save_pretrained(out, safe_serialization=True)
    save_tokenizer(run.tokenizer, out)
    share_like_siblings(out)
    eos, pad = run.tokenizer.eos_token_id, pad_token_id(run.tokenizer)
    states = hidden_states(model, run.held_texts, pad_id=pad, eos_token_id=eos)  # the new model's
    heads.accuracies = measure_accuracies(heads, states, top_k=config.top_k)
    heads.tree = [list(p) for p in build_tree(heads.accuracies, config.tree_nodes, config.top_k)]
    heads.meta = {"model": str(out), "model_fingerprint": fingerprint(out),
                  "parameters_fingerprint": fingerprint(model),
                  "base_model": config.model, "base_fingerprint": fingerprint(run.model_dir),
                  "tokenizer_fingerprint": tokenizer_fingerprint(config.model), "dtype": config.dtype,
                  "training": {"recipe": "medusa-2 (joint)", "texts": len(run.train_texts),
                               "holdout_texts": len(run.held_texts),
                               "positions": sum(s.shape[0] for s in run.train_states), "steps": config.max_steps,
                               "warmup_heads": config.warmup_heads, "init_heads": config.init_heads,
                               "backbone_lr": config.backbone_lr,
                               "heads_weight": config.heads_weight, "loss": config.loss,
                               "seconds": round(run.elapsed, 1), "holdout_before": run.before,
                               "holdout_after": after},
                  "cllm_version": __version__}
    save_heads(heads, out / HEADS_DIR)
    for name in (CHECKPOINT, TEXTS):
        (out / name).unlink(missing_ok=True)
    return after


# ------------------------------------------------------------------------ evaluation


def _evaluate(run: JointRun) -> dict | None:
    """Greedy vs Medusa decoding of the new model (batch 1, --eval-count prompts), and its
    greedy text vs the original's (--quality-count prompts of the same set); written to
    evaluation.json, summed up in MODEL_CARD.md."""
    config = run.config
    limit = position_limit(run.model)
    new = min(config.eval_max_new_tokens, limit // 2) if limit else config.eval_max_new_tokens
    count = max(config.eval_count, config.quality_count)
    if not count:
        _write_card(run, None)
        return None
    prompt_set, prompts = evaluation_prompts(run, new, count)
    evaluation: dict = {"prompt_set": prompt_set, "max_new_tokens": new, "threads": torch.get_num_threads(),
                        "device": config.device, "dtype": config.dtype, "tree_nodes": len(run.heads.tree)}
    if config.eval_count:
        with progress_bar(total=config.eval_count, unit="prompt", desc="medusa --joint: exactness") as bar:
            decoding = evaluate_heads(run.model, run.heads, prompts[: config.eval_count], max_new_tokens=new,
                                      eos_token_id=run.tokenizer.eos_token_id, progress=bar.update)
        evaluation.update(decoding)
    if config.quality_count:
        evaluation["quality"] = compare_with_original(run, prompts[: config.quality_count], new)
    (run.out / EVALUATION).write_text(json.dumps(evaluation, indent=2) + "\n")
    _write_card(run, evaluation)
    return evaluation


def compare_with_original(run: JointRun, prompts: list[list[int]], new: int) -> dict:
    """The original's and the new model's greedy text on `prompts` (`cllm.evaluation.gates`'
    measures, the original the judge), and the loss of each on the original's held-out text."""
    tokenizer, pad = run.tokenizer, pad_token_id(run.tokenizer)
    original = load_model(run.config.model, dtype=run.config.dtype, device=run.config.device)
    items = [Prompt(str(i), tokenizer.decode(ids), list(ids)) for i, ids in enumerate(prompts)]
    common = dict(block_sizes=[], max_new_tokens=new, batch_size=8, pad_id=pad, seed=0)
    with progress_bar(total=2, unit="model", desc="medusa --joint: quality") as bar:
        base, base_greedy = evaluate_set(original, original, items, tokenizer, target_greedy=None, **common)
        bar.update(1)
        mine, _ = evaluate_set(run.model, original, items, tokenizer, target_greedy=base_greedy, **common)
        bar.update(1)
    held = [t.prompt for t in run.held_texts], [t.completion for t in run.held_texts]
    measures = ("parse_rate", "degenerate_rate", "looping_rate", "target_nll", "first_divergence",
                "token_agreement", "same_as_target")
    return {"prompts": len(items), "original": {k: asdict(base)[k] for k in measures[:4]},
            "model": {k: asdict(mine)[k] for k in measures},
            "heldout_text_loss": {"original": lm_loss(original, *held, pad_id=pad),
                                  "model": lm_loss(run.model, *held, pad_id=pad)}}


def _write_card(run: JointRun, evaluation: dict | None) -> None:
    write_card(run.out, run.config, run.heads, evaluation)


def write_card(out: Path, config: MedusaConfig, heads: MedusaHeads, evaluation: dict | None,
               section: str = "") -> None:
    """OUT/MODEL_CARD.md (`cllm.training.cards.medusa2_card`), with the command that remakes
    the run: its options that differ from the defaults; `section`: extra markdown after the
    evaluation."""
    options, defaults = config_to_dict(config), config_to_dict(MedusaConfig(joint=True, out=config.out))
    flags = [f"--{k.replace('_', '-')} {v}" for k, v in options.items()
             if k not in ("joint", "force", "resume") and (k in ("model", "out") or v != defaults[k])]
    info = {"config": options, "command": " ".join(["cllm medusa --joint", *flags]), "heads": dict(heads.meta),
            "parameters_added": heads.parameters_added(), "tree_nodes": len(heads.tree or [])}
    (out / CARD).write_text(medusa2_card(info, evaluation, section))
    share_like_siblings(out)

