"""`cllm medusa` as named steps: train Medusa heads for a model (Medusa-1: the model frozen) and
evaluate them.

1. `_open_run`: the heads folder (an unfinished run there is resumed) and the frozen model;
2. `read_texts`: the model's own greedy continuations of a prompt set (or the fixed points of
   `cllm collect` trajectories of this model) are the training text, the last `--holdout` texts
   held out; the frozen model's last hidden states on them are computed once;
3. `_build_trainer` and `_train`: AdamW trains the heads alone on the self-distillation loss
   (`cllm.training.medusa.loss`), logging every step to `medusa_log.jsonl` and the held-out loss
   every `--eval-every` steps, with a checkpoint there too;
4. `_save`: each head's top-k accuracy on the held-out texts shapes the default candidate tree;
   heads, accuracies and tree are saved (`save_heads`), by default in `MODEL/medusa/`;
5. `_evaluate`: greedy and Medusa decoding of a few held-out prompts (`--eval-prompts`; by
   default HumanEval for a model of the stdlib domain, else the held-out texts' prompts):
   exactness, tokens per forward, speed, in `evaluation.json`.

An existing heads folder is never overwritten without `--force`. Nothing here prints: steps are
logged (`cllm.commands.medusa` shows them) and `medusa` returns a `MedusaResult`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cllm.core import __version__, runs
from cllm.core.config import write_config
from cllm.core.errors import UserError
from cllm.core.outputs import Input, check_folder, claim_folder, removed_on_early_failure
from cllm.core.progress import progress_bar
from cllm.data.prompts import encode_prompts
from cllm.decoding import greedy_decode
from cllm.decoding.inputs import model_device, position_limit
from cllm.decoding.rivals.medusa import build_tree, medusa_decode
from cllm.modeling.heads import HEADS_DIR, WEIGHTS_FILE, MedusaHeads
from cllm.models import (
    EMBEDDED_TARGET,
    SHIPPED,
    load_model,
    load_tokenizer,
    pad_token_id,
    resolve_model_path,
    tokenizer_fingerprint,
)
from cllm.training.medusa.config import (
    AUTO,
    CHECKPOINT,
    EVALUATION,
    LOG,
    RESUME_FREE,
    RUN_FILES,
    TEXTS,
    TRAIN_CONFIG,
    MedusaConfig,
)
from cllm.training.medusa.texts import Text, check_texts_source, hidden_states, probe_lm_head, training_texts
from cllm.training.medusa.trainer import HeadsTrainer, base_model_meta, measure_accuracies, save_heads

log = logging.getLogger(__name__)

HOLDOUT_SET = "holdout"  # the evaluation's prompt set when it is the held-out texts' prompts


@dataclass
class MedusaResult:
    """What a `cllm medusa` run made: the heads, their held-out loss and per-head top-1 agreement
    before and after training, and the decoding evaluation (None with --eval-count 0)."""

    out: Path
    heads: MedusaHeads
    before: dict
    after: dict | None = None  # None when the run stopped early
    evaluation: dict | None = None
    stopped_at: int | None = None  # the step a Ctrl-C stopped the run at (a rerun resumes there)


@dataclass
class HeadsRun:
    """A run's state, filled in by the steps in order."""

    config: MedusaConfig
    out: Path
    model_dir: Path
    resuming: bool
    model: Any = None
    tokenizer: Any = None
    train_texts: list[Text] | None = None
    held_texts: list[Text] | None = None
    train_states: list[torch.Tensor] | None = None
    held_states: list[torch.Tensor] | None = None
    heads: MedusaHeads | None = None
    trainer: HeadsTrainer | None = None
    before: dict | None = None
    elapsed: float = 0.0  # training seconds, summed over resumes

    @property
    def checkpoint(self) -> Path:
        return self.out / CHECKPOINT


def check_out_dir(out: Path, model_dir: Path, config: MedusaConfig) -> None:
    """Refuse (touching nothing) what `cllm.core.outputs.check_folder` refuses (a file, the
    model's own folder or a place inside it other than its heads folder, a folder this command
    did not mark as its own), and finished heads without --force."""
    check_folder(out, "medusa", force=config.force, inputs=[Input("--model", model_dir, owned=(HEADS_DIR,))])
    if (out / WEIGHTS_FILE).exists() and not config.force:
        raise UserError(f"{out} already holds Medusa heads; --force replaces them")


def medusa(config: MedusaConfig) -> MedusaResult:
    """Train (or resume) Medusa heads for `config.model` (frozen), save and evaluate them
    (Medusa-1; `config.joint` is `cllm.training.medusa.medusa2`'s).

    Args:
        config: a validated `MedusaConfig`. Rerunning with the same config resumes an unfinished
            run from its checkpoint; Ctrl-C saves one and returns with `stopped_at` set.
    """
    if config.joint:
        raise ValueError("--joint trains a Medusa-2 checkpoint: cllm.training.medusa.medusa2 runs it")
    model_dir, out, resuming = open_folder(config, "medusa", "the heads", check_out_dir, files=(
        CHECKPOINT, TRAIN_CONFIG, RESUME_FREE))  # 1. the heads folder (checked), a checkpoint to resume
    with removed_on_early_failure(out, "medusa", useful=resumable):  # a failed first run leaves no folder
        run = _open_run(config, model_dir, out, resuming)  # ... the frozen model; the folder claimed
        read_texts(run)  # 2. the model's own greedy text, held-out texts, hidden states
        _build_trainer(run)  # 3. heads and AdamW; restored when resuming
        if not _train(run):  # ... steps, log, held-out loss and checkpoints
            return MedusaResult(run.out, run.heads, run.before, stopped_at=run.trainer.step_index)
        after = _save(run)  # 4. accuracies shape the default tree; heads + record saved
        return MedusaResult(run.out, run.heads, run.before, after, _evaluate(run))  # 5. greedy vs Medusa


def resumable(out: Path) -> bool:
    """What a rerun of a drafter trainer (`cllm medusa`, `--joint`, `cllm eagle`) resumes from
    (its checkpoint) or keeps (trained weights): once one is written, a failure keeps the folder."""
    return (out / CHECKPOINT).exists() or any(out.rglob("*.safetensors"))


def _open_run(config: MedusaConfig, model_dir: Path, out: Path, resuming: bool) -> HeadsRun:
    """The frozen model with its tokenizer, and the heads folder `out` (checked by `open_folder`)
    claimed once every input has been checked."""
    run = HeadsRun(config, out, model_dir, resuming)
    run.tokenizer = load_tokenizer(config.model)
    run.model = load_model(config.model, dtype=config.dtype, device=config.device).requires_grad_(False)
    check_texts_source(config, out / TEXTS)
    probe_lm_head(run.model)
    claim_run(config, "medusa", out, resuming, train_config=TRAIN_CONFIG, run_files=RUN_FILES)
    return run


def open_folder(config, command: str, what: str, check: Callable[[Path, Path, Any], None], *,
                files: tuple[str, str, set[str]]) -> tuple[Path, Path, bool]:
    """A drafter trainer's folder (`cllm medusa`, `cllm eagle`): --out, by default the model's
    `command` subfolder, checked by `check` before anything is loaded; whether an unfinished run
    is there to resume (its options then must match but for the resume-free ones); the threads
    set. Writes nothing: `claim_run` does, once every input has been checked. `files`: the
    command's checkpoint and config file names, the options free to change on resume. Returns
    the model's folder, --out and whether it resumes."""
    checkpoint, train_config, resume_free = files
    model_dir = Path(resolve_model_path(config.model))
    if not model_dir.is_dir() and config.out is None:
        raise UserError(f"{config.model!r} is not a local checkpoint: give --out for {what}")
    out = Path(config.out) if config.out else model_dir / command
    config.out = str(out)
    check(out, model_dir, config)
    resuming = config.resume and not config.force and (out / checkpoint).exists() and (out / train_config).exists()
    if resuming:
        runs.check_same_run(json.loads((out / train_config).read_text()), config, free=resume_free)
    if config.threads:
        torch.set_num_threads(config.threads)
    return model_dir, out, resuming


def claim_run(config, command: str, out: Path, resuming: bool, *, train_config: str,
              run_files: Iterable[str | Path]) -> None:
    """Once every input of a run has been checked: the files of an earlier run removed (unless
    this one resumes it), the folder claimed, the config written. A run refused before this
    leaves nothing behind."""
    if not resuming:
        for name in run_files:
            (out / name).unlink(missing_ok=True)
    claim_folder(out, command)
    write_config(config, out / train_config)


def split_holdout(texts: Sequence[Text], holdout: int, *, warn: bool = True) -> tuple[list[Text], list[Text]]:
    """The texts trained on and the last `holdout` ones, held out; a warning when fewer are left
    to train on than are held out (a drafter fit to a handful of texts), but not when `warn` is
    False (`holdout_warned`: the evaluation runs on prompts of its own)."""
    if len(texts) <= holdout:
        raise UserError(f"{len(texts)} texts leave none to train on after --holdout {holdout}")
    train, held = list(texts[:-holdout]), list(texts[-holdout:])
    if warn and len(train) < holdout:
        log.warning("warning: --holdout %d leaves %d of %d texts to train on, fewer than it holds out; "
                    "give more prompts or a smaller --holdout", holdout, len(train), len(texts))
    return train, held


def read_texts(run: HeadsRun) -> None:
    """The training text (decoded once; a resumed run reads it back), split into the texts
    trained on and the last --holdout ones, and the frozen model's hidden states on both."""
    config = run.config
    texts = training_texts(config, run.model, run.tokenizer, run.out / TEXTS)
    run.train_texts, run.held_texts = split_holdout(texts, config.holdout, warn=holdout_warned(config))
    eos, pad = run.tokenizer.eos_token_id, pad_token_id(run.tokenizer)
    with progress_bar(total=len(texts), unit="text", desc="medusa: hidden states") as bar:
        run.train_states = hidden_states(run.model, run.train_texts, pad_id=pad, eos_token_id=eos,
                                         progress=bar.update)
        run.held_states = hidden_states(run.model, run.held_texts, pad_id=pad, eos_token_id=eos,
                                        progress=bar.update)


def _build_trainer(run: HeadsRun) -> None:
    """Fresh heads and their trainer; a resumed run restores them from its checkpoint, a new
    one measures the untrained heads on the held-out texts (step 0 of the log)."""
    config = run.config
    run.heads = MedusaHeads.for_model(run.model, num_heads=config.heads, own_projection=config.own_projection)
    run.trainer = HeadsTrainer(run.heads, run.train_states, steps=config.max_steps, batch_size=config.batch_size,
                               lr=config.lr, weight_decay=config.weight_decay, warmup=config.warmup,
                               distance="fkl" if config.loss == "soft" else "argmax", head_decay=config.head_decay,
                               seed=config.seed)
    runs.begin_or_resume(run, run.out / LOG, lambda: run.trainer.evaluate(run.held_states), log)


def _train(run: HeadsRun) -> bool:
    """The optimizer steps: each logged, the held-out loss and a checkpoint every --eval-every
    steps and at the end. False when Ctrl-C stopped the run (after a checkpoint)."""
    def shown(record: dict) -> dict[str, str]:
        return {"loss": f"{record['loss']:.3f}", "head1": f"{record['agreement'][0]:.2f}"}

    return runs.train_steps(run, run.out / LOG, lambda: run.trainer.evaluate(run.held_states),
                            desc="medusa: training", postfix=shown)


def _save(run: HeadsRun) -> dict:
    """The held-out measures after training; the accuracies on the held-out texts shape the
    default tree; heads and their record saved, the run's checkpoint and texts removed."""
    config, heads = run.config, run.heads
    after = run.trainer.evaluate(run.held_states)
    heads.eval()
    heads.accuracies = measure_accuracies(heads, run.held_states, top_k=config.top_k)
    heads.tree = [list(p) for p in build_tree(heads.accuracies, config.tree_nodes, config.top_k)]
    heads.meta = {"model": config.model,
                  **base_model_meta(run.model, run.model_dir if run.model_dir.is_dir() else None),
                  "tokenizer_fingerprint": tokenizer_fingerprint(config.model), "dtype": config.dtype,
                  "training": {"texts": len(run.train_texts), "holdout_texts": len(run.held_texts),
                               "positions": sum(s.shape[0] for s in run.train_states), "steps": config.max_steps,
                               "loss": config.loss, "seconds": round(run.elapsed, 1),
                               "holdout_before": run.before, "holdout_after": after},
                  "cllm_version": __version__}
    save_heads(heads, run.out)
    for name in (CHECKPOINT, TEXTS):
        (run.out / name).unlink(missing_ok=True)
    return after


def stdlib_domain(model: str) -> bool:
    """Whether `model` speaks the embedded target's language: it has its tokenizer (the shipped
    models and what is trained from them), so HumanEval and the stdlib sets are its domain."""
    target = SHIPPED[EMBEDDED_TARGET]
    return (target / "tokenizer.json").is_file() and tokenizer_fingerprint(model) == tokenizer_fingerprint(target)


def holdout_warned(config) -> bool:
    """Whether a holdout larger than what is left to train on is worth a warning: not when
    --eval-prompts names a prompt set, as the evaluation then does not run on the held-out
    texts' prompts (they only give the held-out loss)."""
    return config.eval_prompts in (AUTO, HOLDOUT_SET)


def evaluation_prompts(run: HeadsRun, new: int, count: int | None = None) -> tuple[str, list[list[int]]]:
    """The evaluation's prompt set and its first --eval-count (or `count`) prompts (token ids, cut from the
    left to leave `new` positions): --eval-prompts, or with 'auto' HumanEval for a model of the
    stdlib domain, else the prompts of the held-out texts (never trained on)."""
    config, limit = run.config, position_limit(run.model)
    keep = limit - new if limit else None
    count = config.eval_count if count is None else count
    name = config.eval_prompts
    if name == AUTO:
        name = "humaneval" if stdlib_domain(config.model) else HOLDOUT_SET
        log.info("evaluating on %s (--eval-prompts auto: %s)", name,
                 "the model has the stdlib domain's tokenizer" if name == "humaneval" else
                 "the prompts of the held-out texts; the model has a tokenizer of its own, not the stdlib domain's")
    if name == HOLDOUT_SET:
        return name, [t.prompt[-keep:] if keep else t.prompt for t in run.held_texts[:count]]
    return name, [p.ids for p in encode_prompts(name, run.tokenizer, limit=count, keep=keep)]


def _evaluate(run: HeadsRun) -> dict | None:
    """Greedy vs Medusa on held-out prompts, batch 1, written to evaluation.json."""
    config = run.config
    if not config.eval_count:
        return None
    limit = position_limit(run.model)
    new = min(config.eval_max_new_tokens, limit // 2) if limit else config.eval_max_new_tokens
    prompt_set, prompts = evaluation_prompts(run, new)
    with progress_bar(total=len(prompts), unit="prompt", desc="medusa: evaluation") as bar:
        evaluation = evaluate_heads(run.model, run.heads, prompts, max_new_tokens=new,
                                    eos_token_id=run.tokenizer.eos_token_id, progress=bar.update)
    evaluation.update(prompt_set=prompt_set, max_new_tokens=new, threads=torch.get_num_threads(),
                      device=config.device, dtype=config.dtype, tree_nodes=len(run.heads.tree))
    (run.out / EVALUATION).write_text(json.dumps(evaluation, indent=2) + "\n")
    return evaluation


@torch.inference_mode()
def evaluate_heads(model: torch.nn.Module, heads: MedusaHeads, prompts: Sequence[Sequence[int]], *,
                   max_new_tokens: int, eos_token_id: int | Iterable[int] | None = None,
                   tree: int | Sequence[Sequence[int]] | None = None,
                   progress: Callable[[int], object] | None = None) -> dict:
    """Greedy and Medusa decoding of each prompt (batch 1): whether Medusa wrote greedy's tokens,
    tokens per forward (all prompts pooled, docs/method.md#counting), the accepted histogram, and
    wall-clock tokens per second of both."""
    device = model_device(model)
    tokens = forwards = exact = greedy_tokens = 0
    seconds = {"greedy": 0.0, "medusa": 0.0}
    histogram: dict[int, int] = {}
    mismatches = []
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([list(prompt)], device=device)
        started = time.perf_counter()
        expected = greedy_decode(model, ids, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id).new_tokens[0]
        seconds["greedy"] += time.perf_counter() - started
        started = time.perf_counter()
        out = medusa_decode(model, heads, ids, tree=tree, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)
        seconds["medusa"] += time.perf_counter() - started
        got = out.new_tokens[0]
        if got == expected:
            exact += 1
        else:
            first = next((j for j, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b),
                         min(len(got), len(expected)))
            mismatches.append({"prompt": i, "first_difference": first})
        tokens, forwards, greedy_tokens = (tokens + len(got), forwards + out.forward_passes,
                                           greedy_tokens + len(expected))
        for n, c in out.stats.accepted_histogram().items():
            histogram[n] = histogram.get(n, 0) + c
        if progress is not None:
            progress(1)
    made = {"greedy": greedy_tokens, "medusa": tokens}
    return {"prompts": len(prompts), "exact": exact, "mismatches": mismatches, "new_tokens": tokens,
            "forward_passes": forwards, "tokens_per_forward": tokens / max(forwards, 1),
            "accepted_histogram": {str(k): v for k, v in sorted(histogram.items())},
            "seconds": seconds, "tokens_per_second": {k: made[k] / v if v else None for k, v in seconds.items()},
            "speedup_vs_greedy": seconds["greedy"] / seconds["medusa"] if seconds["medusa"] else None}
