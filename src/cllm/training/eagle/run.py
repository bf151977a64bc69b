"""`cllm eagle`: an EAGLE head for a frozen model, a drafter on the shared steps
(`cllm.training.drafter.run_drafter`: folder, training text, skeleton, save, evaluation). What is
EAGLE's own: the frozen model's features on every position of the texts are the items
(`feature_runs`, computed once); a fresh head trains on EAGLE's loss (feature regression +
w_cls x classification, teacher forced on true features, `EagleTrainer`); it is saved with its
default tree (`--tree-nodes`, `--tree-depth`, `--top-k`, `save_eagle`, by default in
MODEL/eagle/); the evaluation decodes held-out prompts with greedy and with EAGLE
(`evaluate_eagle`: exactness and tokens per forward).

An existing head is never overwritten without `--force`. Nothing here prints.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

from cllm.core.errors import UserError
from cllm.core.outputs import Input, check_folder
from cllm.core.progress import progress_bar
from cllm.decoding.rivals.eagle import eagle_decode
from cllm.modeling.eagle import EAGLE_DIR, WEIGHTS_FILE, EagleHead
from cllm.models import pad_token_id
from cllm.training import drafter
from cllm.training.eagle import config as names
from cllm.training.eagle.config import EagleConfig
from cllm.training.eagle.trainer import EagleTrainer, feature_runs, new_head, save_eagle
from cllm.training.skeleton import Plan

log = logging.getLogger(__name__)

EagleResult = drafter.DrafterResult  # what `eagle` returns; `.drafter` is the head


def check_out_dir(out: Path, model_dir: Path, config: EagleConfig) -> None:
    """Refuse (touching nothing) what `cllm.core.outputs.check_folder` refuses, and a finished
    head without --force."""
    check_folder(out, "eagle", force=config.force, inputs=[Input("--model", model_dir, owned=(EAGLE_DIR,))])
    if (out / WEIGHTS_FILE).exists() and not config.force:
        raise UserError(f"{out} already holds an EAGLE head; --force replaces it")


def eagle(config: EagleConfig) -> drafter.DrafterResult:
    """Train (or resume) an EAGLE head for `config.model`, save and evaluate it.

    Args:
        config: a validated `EagleConfig`. Rerunning with the same config resumes an unfinished
            run from its checkpoint; Ctrl-C saves one and returns with `stopped_at` set.
    """
    return drafter.run_drafter(EAGLE, config)


def _trainer(run: drafter.DrafterRun, plan: Plan) -> EagleTrainer:
    """The model's features on every position of the texts (once), a fresh head and its trainer."""
    config = run.config
    eos, pad = run.tokenizer.eos_token_id, pad_token_id(run.tokenizer)
    with progress_bar(total=len(run.train_texts) + len(run.held_texts), unit="text", desc="eagle: features") as bar:
        train, held = (feature_runs(run.model, texts, pad_id=pad, eos_token_id=eos, progress=bar.update)
                       for texts in (run.train_texts, run.held_texts))
    return EagleTrainer(new_head(run.model, config.seed), train, held, steps=config.max_steps,
                        batch_size=config.batch_size, lr=config.lr, weight_decay=config.weight_decay,
                        warmup=config.warmup, w_cls=config.w_cls, noise=config.noise, seed=config.seed, plan=plan)


def _save(run: drafter.DrafterRun, trainer: EagleTrainer, after: dict) -> None:
    """The head, its default tree and its record."""
    config, head = run.config, trainer.head
    head.eval()
    head.tree = {"nodes": config.tree_nodes, "depth": config.tree_depth, "top_k": config.top_k}
    head.meta = drafter.drafter_meta(run, trainer, after, w_cls=config.w_cls, noise=config.noise)
    save_eagle(head, run.out)


def _evaluate(run: drafter.DrafterRun, trainer: EagleTrainer) -> dict | None:
    """Greedy vs EAGLE on held-out prompts, batch 1, written to evaluation.json."""
    head = trainer.head
    return drafter.evaluate_drafter(run, lambda prompts, new, progress: evaluate_eagle(
        run.model, head, prompts, max_new_tokens=new, eos_token_id=run.tokenizer.eos_token_id, progress=progress),
        tree=head.tree)


EAGLE = drafter.Drafter(command="eagle", what="the head", files=drafter.RunFiles.named_in(names),
                        check=check_out_dir, trainer=_trainer, save=_save, evaluate=_evaluate)


@torch.inference_mode()
def evaluate_eagle(model: torch.nn.Module, head: EagleHead, prompts: Sequence[Sequence[int]], *,
                   max_new_tokens: int, eos_token_id: int | Iterable[int] | None = None,
                   nodes: int | None = None, depth: int | None = None, top_k: int | None = None,
                   progress: Callable[[int], object] | None = None) -> dict:
    """Greedy and EAGLE decoding of each prompt (batch 1, `against_greedy`): whether EAGLE wrote
    greedy's tokens, tokens per target forward and head forwards per target forward (all prompts
    pooled, docs/method.md#counting), the mean tokens fed per forward and the accepted histogram."""
    drafts, fed = [0], []

    def seen(out) -> None:
        drafts[0] += out.stats.draft_forward_passes
        fed.extend(out.stats.fed)

    result = drafter.against_greedy(model, prompts, lambda ids: eagle_decode(
        model, head, ids, nodes=nodes, depth=depth, top_k=top_k, max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id), max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, seen=seen,
        progress=progress)
    result.pop("seconds"), result.pop("greedy_tokens")
    return {**result, "head_forward_passes": drafts[0], "mean_fed": sum(fed) / max(len(fed), 1)}
