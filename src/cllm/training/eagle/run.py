"""`cllm eagle` as named steps: train an EAGLE head for a frozen model and evaluate it.

1. `_open_run`: the head folder (an unfinished run there is resumed) and the frozen model;
2. `_read_texts`: the model's own greedy continuations of a prompt set (Medusa's
   `training_texts`: decoded once, or the fixed points of `cllm collect` trajectories) are the
   training text, the last `--holdout` texts held out; the model's features on every position
   of both are computed once;
3. `_build_trainer` and `_train`: AdamW trains the head alone on EAGLE's loss (feature
   regression + w_cls x classification, teacher forced on true features), logging every step to
   `eagle_log.jsonl` and the held-out loss every `--eval-every` steps, with a checkpoint there;
4. `_save`: the head, its default tree (`--tree-nodes`, `--tree-depth`, `--top-k`) and what
   trained it (`save_eagle`), by default in `MODEL/eagle/`;
5. `_evaluate`: greedy and EAGLE decoding of held-out prompts (by default HumanEval for a model
   of the stdlib domain): exactness and tokens per forward, in `evaluation.json`.

An existing head is never overwritten without `--force`. Nothing here prints: steps are logged
(`cllm.commands.eagle` shows them) and `eagle` returns an `EagleResult`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cllm.core import __version__, runs
from cllm.core.errors import UserError
from cllm.core.outputs import Input, check_folder, removed_on_early_failure
from cllm.core.progress import progress_bar
from cllm.decoding import greedy_decode
from cllm.decoding.inputs import position_limit
from cllm.decoding.rivals.eagle import eagle_decode
from cllm.modeling.eagle import EAGLE_DIR, WEIGHTS_FILE, EagleHead
from cllm.models import load_model, load_tokenizer, pad_token_id, tokenizer_fingerprint
from cllm.training.eagle.config import (
    CHECKPOINT,
    EVALUATION,
    LOG,
    RESUME_FREE,
    RUN_FILES,
    TEXTS,
    TRAIN_CONFIG,
    EagleConfig,
)
from cllm.training.eagle.trainer import EagleTrainer, FeatureRun, feature_runs, new_head, save_eagle
from cllm.training.medusa.run import (
    claim_run,
    evaluation_prompts,
    holdout_warned,
    open_folder,
    resumable,
    split_holdout,
)
from cllm.training.medusa.texts import Text, check_texts_source, training_texts
from cllm.training.medusa.trainer import base_model_meta

log = logging.getLogger(__name__)


@dataclass
class EagleResult:
    """What a `cllm eagle` run made: the head, its held-out loss and top-1 agreement before and
    after training, and the decoding evaluation (None with --eval-count 0)."""

    out: Path
    head: EagleHead
    before: dict
    after: dict | None = None  # None when the run stopped early
    evaluation: dict | None = None
    stopped_at: int | None = None  # the step a Ctrl-C stopped the run at (a rerun resumes there)


@dataclass
class _Run:
    """A run's state, filled in by the steps in order."""

    config: EagleConfig
    out: Path
    model_dir: Path
    resuming: bool
    model: Any = None
    tokenizer: Any = None
    train_texts: list[Text] | None = None
    held_texts: list[Text] | None = None
    train_runs: list[FeatureRun] | None = None
    held_runs: list[FeatureRun] | None = None
    head: EagleHead | None = None
    trainer: EagleTrainer | None = None
    before: dict | None = None
    elapsed: float = 0.0  # training seconds, summed over resumes

    @property
    def checkpoint(self) -> Path:
        return self.out / CHECKPOINT


def check_out_dir(out: Path, model_dir: Path, config: EagleConfig) -> None:
    """Refuse (touching nothing) what `cllm.core.outputs.check_folder` refuses, and a finished
    head without --force."""
    check_folder(out, "eagle", force=config.force, inputs=[Input("--model", model_dir, owned=(EAGLE_DIR,))])
    if (out / WEIGHTS_FILE).exists() and not config.force:
        raise UserError(f"{out} already holds an EAGLE head; --force replaces it")


def eagle(config: EagleConfig) -> EagleResult:
    """Train (or resume) an EAGLE head for `config.model`, save and evaluate it.

    Args:
        config: a validated `EagleConfig`. Rerunning with the same config resumes an unfinished
            run from its checkpoint; Ctrl-C saves one and returns with `stopped_at` set.
    """
    model_dir, out, resuming = open_folder(config, "eagle", "the head", check_out_dir, files=(
        CHECKPOINT, TRAIN_CONFIG, RESUME_FREE))  # 1. the head folder (checked), a checkpoint to resume
    with removed_on_early_failure(out, "eagle", useful=resumable):  # a failed first run leaves no folder
        run = _open_run(config, model_dir, out, resuming)  # ... the frozen model; the folder claimed
        _read_texts(run)  # 2. the model's own greedy text, held-out texts, features
        _build_trainer(run)  # 3. head and AdamW; restored when resuming
        if not _train(run):  # ... steps, log, held-out loss and checkpoints
            return EagleResult(run.out, run.head, run.before, stopped_at=run.trainer.step_index)
        after = _save(run)  # 4. head, default tree, record
        return EagleResult(run.out, run.head, run.before, after, _evaluate(run))  # 5. greedy vs EAGLE


def _open_run(config: EagleConfig, model_dir: Path, out: Path, resuming: bool) -> _Run:
    """The frozen model with its tokenizer, and the head folder `out` (checked by `open_folder`
    before anything is loaded) claimed once every input has been checked."""
    run = _Run(config, out, model_dir, resuming)
    run.tokenizer = load_tokenizer(config.model)
    run.model = load_model(config.model, dtype=config.dtype, device=config.device).requires_grad_(False)
    check_texts_source(config, out / TEXTS)
    claim_run(config, "eagle", out, resuming, train_config=TRAIN_CONFIG, run_files=RUN_FILES)
    return run


def _read_texts(run: _Run) -> None:
    """The training text (decoded once; a resumed run reads it back), split into the texts
    trained on and the last --holdout ones, and the frozen model's features on both."""
    config = run.config
    texts = training_texts(config, run.model, run.tokenizer, run.out / TEXTS, command="eagle")
    run.train_texts, run.held_texts = split_holdout(texts, config.holdout, warn=holdout_warned(config))
    eos, pad = run.tokenizer.eos_token_id, pad_token_id(run.tokenizer)
    with progress_bar(total=len(texts), unit="text", desc="eagle: features") as bar:
        run.train_runs = feature_runs(run.model, run.train_texts, pad_id=pad, eos_token_id=eos, progress=bar.update)
        run.held_runs = feature_runs(run.model, run.held_texts, pad_id=pad, eos_token_id=eos, progress=bar.update)


def _build_trainer(run: _Run) -> None:
    """A fresh head and its trainer; a resumed run restores them from its checkpoint, a new one
    measures the untrained head on the held-out texts (step 0 of the log)."""
    config = run.config
    run.head = new_head(run.model, config.seed)
    run.trainer = EagleTrainer(run.head, run.train_runs, steps=config.max_steps, batch_size=config.batch_size,
                               lr=config.lr, weight_decay=config.weight_decay, warmup=config.warmup,
                               w_cls=config.w_cls, noise=config.noise, seed=config.seed)
    runs.begin_or_resume(run, run.out / LOG, lambda: run.trainer.evaluate(run.held_runs), log)


def _train(run: _Run) -> bool:
    """The optimizer steps: each logged, the held-out loss and a checkpoint every --eval-every
    steps and at the end. False when Ctrl-C stopped the run (after a checkpoint)."""
    def shown(record: dict) -> dict[str, str]:
        return {"loss": f"{record['loss']:.3f}", "agree": f"{record['agreement']:.2f}"}

    return runs.train_steps(run, run.out / LOG, lambda: run.trainer.evaluate(run.held_runs),
                            desc="eagle: training", postfix=shown)


def _save(run: _Run) -> dict:
    """The held-out measures after training; head, default tree and record saved, the run's
    checkpoint and texts removed."""
    config, head = run.config, run.head
    after = run.trainer.evaluate(run.held_runs)
    head.eval()
    head.tree = {"nodes": config.tree_nodes, "depth": config.tree_depth, "top_k": config.top_k}
    head.meta = {"model": config.model,
                 **base_model_meta(run.model, run.model_dir if run.model_dir.is_dir() else None),
                 "tokenizer_fingerprint": tokenizer_fingerprint(config.model), "dtype": config.dtype,
                 "training": {"texts": len(run.train_texts), "holdout_texts": len(run.held_texts),
                              "positions": sum(r.next_tokens.shape[0] for r in run.train_runs),
                              "steps": config.max_steps,
                              "w_cls": config.w_cls, "noise": config.noise, "seconds": round(run.elapsed, 1),
                              "holdout_before": run.before, "holdout_after": after},
                 "cllm_version": __version__}
    save_eagle(head, run.out)
    for name in (CHECKPOINT, TEXTS):
        (run.out / name).unlink(missing_ok=True)
    return after


def _evaluate(run: _Run) -> dict | None:
    """Greedy vs EAGLE on held-out prompts, batch 1, written to evaluation.json."""
    config = run.config
    if not config.eval_count:
        return None
    limit = position_limit(run.model)
    new = min(config.eval_max_new_tokens, limit // 2) if limit else config.eval_max_new_tokens
    prompt_set, prompts = evaluation_prompts(run, new)
    with progress_bar(total=len(prompts), unit="prompt", desc="eagle: evaluation") as bar:
        evaluation = evaluate_eagle(run.model, run.head, prompts, max_new_tokens=new,
                                    eos_token_id=run.tokenizer.eos_token_id, progress=bar.update)
    evaluation.update(prompt_set=prompt_set, max_new_tokens=new, threads=torch.get_num_threads(),
                      device=config.device, dtype=config.dtype, tree=run.head.tree)
    (run.out / EVALUATION).write_text(json.dumps(evaluation, indent=2) + "\n")
    return evaluation


@torch.inference_mode()
def evaluate_eagle(model: torch.nn.Module, head: EagleHead, prompts: Sequence[Sequence[int]], *,
                   max_new_tokens: int, eos_token_id: int | Iterable[int] | None = None,
                   nodes: int | None = None, depth: int | None = None, top_k: int | None = None,
                   progress: Callable[[int], object] | None = None) -> dict:
    """Greedy and EAGLE decoding of each prompt (batch 1): whether EAGLE wrote greedy's tokens,
    tokens per target forward and head forwards per target forward (all prompts pooled,
    docs/method.md#counting), the mean tokens fed per forward and the accepted histogram."""
    device = next(model.parameters()).device
    tokens = forwards = exact = drafts = 0
    fed: list[int] = []
    histogram: dict[int, int] = {}
    mismatches = []
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([list(prompt)], device=device)
        expected = greedy_decode(model, ids, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id).new_tokens[0]
        out = eagle_decode(model, head, ids, nodes=nodes, depth=depth, top_k=top_k, max_new_tokens=max_new_tokens,
                           eos_token_id=eos_token_id)
        got = out.new_tokens[0]
        if got == expected:
            exact += 1
        else:
            first = next((j for j, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b),
                         min(len(got), len(expected)))
            mismatches.append({"prompt": i, "first_difference": first})
        tokens, forwards = tokens + len(got), forwards + out.forward_passes
        drafts += out.stats.draft_forward_passes
        fed += out.stats.fed
        for n, c in out.stats.accepted_histogram().items():
            histogram[n] = histogram.get(n, 0) + c
        if progress is not None:
            progress(1)
    return {"prompts": len(prompts), "exact": exact, "mismatches": mismatches, "new_tokens": tokens,
            "forward_passes": forwards, "tokens_per_forward": tokens / max(forwards, 1),
            "head_forward_passes": drafts, "mean_fed": sum(fed) / max(len(fed), 1),
            "accepted_histogram": {str(k): v for k, v in sorted(histogram.items())}}
