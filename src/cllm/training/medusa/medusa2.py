"""`cllm medusa --joint` as named steps: Medusa-2, the model trained together with its heads, saved
as a new checkpoint with its heads inside, and measured against the original.

It runs on the drafters' shared steps (`cllm.training.drafter.run_drafter`); what is its own:

1. the checkpoint folder --out (an unfinished run there is resumed) and the original model,
   which is the teacher and the starting point; --init-heads checked (`_prepare`);
2. the original's greedy continuations (the last --holdout held out) and its last hidden states
   on them, computed once (Medusa-1's);
3. `_trainer`: the heads alone for --warmup-heads steps, then heads and model together
   (`cllm.training.medusa.joint`) on the training skeleton, each step logged, the held-out loss
   and a checkpoint (model, heads, both optimizers) every --eval-every steps;
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

import dataclasses
import json
import logging
from dataclasses import asdict
from pathlib import Path

import torch

from cllm.core import __version__
from cllm.core.config import config_to_dict
from cllm.core.errors import UserError
from cllm.core.outputs import check_folder, share_like_siblings
from cllm.core.progress import progress_bar
from cllm.data.prompts import Prompt
from cllm.decoding.rivals.medusa import build_tree
from cllm.evaluation.gates import evaluate_set
from cllm.evaluation.lm_loss import lm_loss
from cllm.modeling.heads import HEADS_DIR, MedusaHeads
from cllm.models import (
    fingerprint,
    load_heads,
    load_model,
    pad_token_id,
    resolve_model_path,
    save_tokenizer,
    tokenizer_fingerprint,
)
from cllm.training import drafter
from cllm.training.cards import medusa2_card
from cllm.training.medusa import config as names
from cllm.training.medusa.config import CARD, CHECKPOINT, EVALUATION, JOINT_RUN_FILES, RUN_FILES, MedusaConfig
from cllm.training.medusa.joint import JointTrainer, frozen_copy
from cllm.training.medusa.run import evaluate_heads, states_of
from cllm.training.medusa.trainer import measure_accuracies, save_heads
from cllm.training.skeleton import Plan
from cllm.training.texts import hidden_states, probe_lm_head

log = logging.getLogger(__name__)

MODEL_WEIGHTS = "model.safetensors"  # save_pretrained's file: its presence marks a finished run


def check_joint_out(out: Path, model_dir: Path, config: MedusaConfig) -> None:
    """Refuse (touching nothing) what `check_folder` refuses, and a finished checkpoint without
    --force (an unfinished run, with its checkpoint.pt, resumes)."""
    check_folder(out, "medusa", force=config.force, inputs=[("--model", model_dir)])
    if (out / MODEL_WEIGHTS).exists() and not (out / CHECKPOINT).exists() and not config.force:
        raise UserError(f"{out} already holds a model trained with Medusa heads; --force replaces it")


def medusa2(config: MedusaConfig) -> drafter.DrafterResult:
    """Train (or resume) a model jointly with its Medusa heads, save both in `config.out`, and
    evaluate them against the original.

    Args:
        config: a validated `MedusaConfig` with `joint` set (and `out`). Rerunning with the same
            config resumes an unfinished run; Ctrl-C saves a checkpoint and returns with
            `stopped_at` set.
    """
    return drafter.run_drafter(MEDUSA2, config)


def _prepare(run: drafter.DrafterRun) -> None:
    """Before the folder is claimed: --init-heads checked against the original, its LM head probed."""
    if run.config.init_heads:
        _initial_heads(run)
    probe_lm_head(run.model)


def _trainer(run: drafter.DrafterRun, plan: Plan) -> JointTrainer:
    """The original's hidden states (once) and a copy of its LM head, taken before anything
    trains: the teacher; the first heads; the trainer of both."""
    config = run.config
    train, held = states_of(run, "medusa: hidden states")
    teacher = frozen_copy(run.model.get_output_embeddings())
    run.model.requires_grad_(True)
    return JointTrainer(run.model, _initial_heads(run), run.train_texts, train, teacher, steps=config.max_steps,
                        held=list(zip(run.held_texts, held, strict=True)), warmup_heads=config.warmup_heads,
                        batch_size=config.batch_size, lr=config.lr, backbone_lr=config.backbone_lr,
                        heads_weight=config.heads_weight, weight_decay=config.weight_decay, warmup=config.warmup,
                        distance="fkl" if config.loss == "soft" else "argmax", head_decay=config.head_decay,
                        pad_id=pad_token_id(run.tokenizer), seed=config.seed, plan=plan)


def _initial_heads(run: drafter.DrafterRun) -> MedusaHeads:
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


def _save(run: drafter.DrafterRun, trainer: JointTrainer, after: dict) -> None:
    """The new model and its tokenizer saved; the heads' accuracies measured against the NEW
    model's greedy tokens (what its decoding accepts) shape the tree; the heads saved in
    OUT/medusa with the new checkpoint's fingerprint."""
    config, heads, model, out = run.config, trainer.heads, run.model, run.out
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
                  "training": drafter.training_record(run, trainer, after, recipe="medusa-2 (joint)",
                                              warmup_heads=config.warmup_heads, init_heads=config.init_heads,
                                              backbone_lr=config.backbone_lr, heads_weight=config.heads_weight,
                                              loss=config.loss),
                  "cllm_version": __version__}
    save_heads(heads, out / HEADS_DIR)


# ------------------------------------------------------------------------ evaluation


def _evaluate(run: drafter.DrafterRun, trainer: JointTrainer) -> dict | None:
    """Greedy vs Medusa decoding of the new model (batch 1, --eval-count prompts), and its
    greedy text vs the original's (--quality-count prompts of the same set); written to
    evaluation.json, summed up in MODEL_CARD.md."""
    config, heads = run.config, trainer.heads
    new = drafter.evaluation_length(run)
    count = max(config.eval_count, config.quality_count)
    if not count:
        write_card(run.out, config, heads, None)
        return None
    prompt_set, prompts = drafter.evaluation_prompts(run, new, count)
    evaluation: dict = {"prompt_set": prompt_set, "max_new_tokens": new, "threads": torch.get_num_threads(),
                        "device": config.device, "dtype": config.dtype, "tree_nodes": len(heads.tree)}
    if config.eval_count:
        with progress_bar(total=config.eval_count, unit="prompt", desc="medusa --joint: exactness") as bar:
            decoding = evaluate_heads(run.model, heads, prompts[: config.eval_count], max_new_tokens=new,
                                      eos_token_id=run.tokenizer.eos_token_id, progress=bar.update)
        evaluation.update(decoding)
    if config.quality_count:
        evaluation["quality"] = compare_with_original(run, prompts[: config.quality_count], new)
    (run.out / EVALUATION).write_text(json.dumps(evaluation, indent=2) + "\n")
    write_card(run.out, config, heads, evaluation)
    return evaluation


def compare_with_original(run: drafter.DrafterRun, prompts: list[list[int]], new: int) -> dict:
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



# what a run writes in its folder: the new checkpoint, the run's files, the heads' folder
FILES = dataclasses.replace(drafter.RunFiles.named_in(names), run_files=(
    *JOINT_RUN_FILES, MODEL_WEIGHTS, *(Path(HEADS_DIR) / name for name in RUN_FILES)))
MEDUSA2 = drafter.Drafter(command="medusa", what="the checkpoint", files=FILES, check=check_joint_out,
                          trainer=_trainer, save=_save, evaluate=_evaluate, prepare=_prepare,
                          desc="medusa --joint: training")
