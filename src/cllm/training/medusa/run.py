"""`cllm medusa`: Medusa-1 heads for a frozen model, a drafter on the shared steps
(`cllm.training.drafter.run_drafter`: folder, training text, skeleton, save, evaluation). What is
Medusa's own: the frozen model's last hidden states are the items (`hidden_states`, computed
once), fresh heads train on the self-distillation loss (`HeadsTrainer`); each head's top-k
accuracy on the held-out texts shapes the default candidate tree, saved with the heads
(`save_heads`, by default in MODEL/medusa/); the evaluation decodes held-out prompts with greedy
and with Medusa (`evaluate_heads`: exactness, tokens per forward, speed).

An existing heads folder is never overwritten without `--force`. Nothing here prints.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

from cllm.core.errors import UserError
from cllm.core.outputs import Input, check_folder
from cllm.core.progress import progress_bar
from cllm.decoding.rivals.medusa import build_tree, medusa_decode
from cllm.modeling.heads import HEADS_DIR, WEIGHTS_FILE, MedusaHeads
from cllm.models import pad_token_id
from cllm.training import drafter
from cllm.training.medusa import config as names
from cllm.training.medusa.config import MedusaConfig
from cllm.training.medusa.trainer import HeadsTrainer, measure_accuracies, save_heads
from cllm.training.skeleton import Plan
from cllm.training.texts import hidden_states, probe_lm_head

log = logging.getLogger(__name__)

MedusaResult = drafter.DrafterResult  # what `medusa` and `medusa2` return; `.drafter` is the heads


def check_out_dir(out: Path, model_dir: Path, config: MedusaConfig) -> None:
    """Refuse (touching nothing) what `cllm.core.outputs.check_folder` refuses (a file, the
    model's own folder or a place inside it other than its heads folder, a folder this command
    did not mark as its own), and finished heads without --force."""
    check_folder(out, "medusa", force=config.force, inputs=[Input("--model", model_dir, owned=(HEADS_DIR,))])
    if (out / WEIGHTS_FILE).exists() and not config.force:
        raise UserError(f"{out} already holds Medusa heads; --force replaces them")


def medusa(config: MedusaConfig) -> drafter.DrafterResult:
    """Train (or resume) Medusa heads for `config.model` (frozen), save and evaluate them
    (Medusa-1; `config.joint` is `cllm.training.medusa.medusa2`'s).

    Args:
        config: a validated `MedusaConfig`. Rerunning with the same config resumes an unfinished
            run from its checkpoint; Ctrl-C saves one and returns with `stopped_at` set.
    """
    if config.joint:
        raise ValueError("--joint trains a Medusa-2 checkpoint: cllm.training.medusa.medusa2 runs it")
    return drafter.run_drafter(MEDUSA, config)


def states_of(run: drafter.DrafterRun, desc: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The frozen model's last hidden states on the texts trained on and on the held-out ones."""
    eos, pad = run.tokenizer.eos_token_id, pad_token_id(run.tokenizer)
    with progress_bar(total=len(run.train_texts) + len(run.held_texts), unit="text", desc=desc) as bar:
        return tuple(hidden_states(run.model, texts, pad_id=pad, eos_token_id=eos, progress=bar.update)
                     for texts in (run.train_texts, run.held_texts))


def _trainer(run: drafter.DrafterRun, plan: Plan) -> HeadsTrainer:
    """The hidden states (once), fresh heads and their trainer."""
    config = run.config
    train, held = states_of(run, "medusa: hidden states")
    heads = MedusaHeads.for_model(run.model, num_heads=config.heads, own_projection=config.own_projection)
    return HeadsTrainer(heads, train, held, steps=config.max_steps, batch_size=config.batch_size, lr=config.lr,
                        weight_decay=config.weight_decay, warmup=config.warmup,
                        distance="fkl" if config.loss == "soft" else "argmax", head_decay=config.head_decay,
                        seed=config.seed, plan=plan)


def _save(run: drafter.DrafterRun, trainer: HeadsTrainer, after: dict) -> None:
    """The accuracies on the held-out texts shape the default tree; heads and their record saved."""
    config, heads = run.config, trainer.heads
    heads.eval()
    heads.accuracies = measure_accuracies(heads, trainer.held, top_k=config.top_k)
    heads.tree = [list(p) for p in build_tree(heads.accuracies, config.tree_nodes, config.top_k)]
    heads.meta = drafter.drafter_meta(run, trainer, after, loss=config.loss)
    save_heads(heads, run.out)


def _evaluate(run: drafter.DrafterRun, trainer: HeadsTrainer) -> dict | None:
    """Greedy vs Medusa on held-out prompts, batch 1, written to evaluation.json."""
    heads = trainer.heads
    return drafter.evaluate_drafter(run, lambda prompts, new, progress: evaluate_heads(
        run.model, heads, prompts, max_new_tokens=new, eos_token_id=run.tokenizer.eos_token_id, progress=progress),
        tree_nodes=len(heads.tree))


MEDUSA = drafter.Drafter(command="medusa", what="the heads", files=drafter.RunFiles.named_in(names),
                         check=check_out_dir, trainer=_trainer, save=_save, evaluate=_evaluate,
                         prepare=lambda run: probe_lm_head(run.model))


@torch.inference_mode()
def evaluate_heads(model: torch.nn.Module, heads: MedusaHeads, prompts: Sequence[Sequence[int]], *,
                   max_new_tokens: int, eos_token_id: int | Iterable[int] | None = None,
                   tree: int | Sequence[Sequence[int]] | None = None,
                   progress: Callable[[int], object] | None = None) -> dict:
    """Greedy and Medusa decoding of each prompt (batch 1, `against_greedy`): whether Medusa
    wrote greedy's tokens, tokens per forward, the accepted histogram, and wall-clock tokens per
    second of both."""
    result = drafter.against_greedy(model, prompts, lambda ids: medusa_decode(
        model, heads, ids, tree=tree, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id),
        max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, progress=progress)
    timed, greedy_tokens = result.pop("seconds"), result.pop("greedy_tokens")
    seconds = {"greedy": timed["greedy"], "medusa": timed["drafter"]}
    made = {"greedy": greedy_tokens, "medusa": result["new_tokens"]}
    return {**result, "seconds": seconds,
            "tokens_per_second": {k: made[k] / v if v else None for k, v in seconds.items()},
            "speedup_vs_greedy": seconds["greedy"] / seconds["medusa"] if seconds["medusa"] else None}
