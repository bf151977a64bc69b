"""What training a drafter for a frozen model shares, whichever drafter it is (Medusa-1's heads,
EAGLE's head, Medusa-2's heads with the model): the trainer on the skeleton and the command's
steps. Each drafter's own modules hold its loss, its data and what it saves and measures.

`DrafterTrainer` (`cllm.training.skeleton.Trainer`): AdamW on the drafter, linear warm-up then
cosine decay; batches drawn from the training items by a seeded generator; the held-out loss and
top-1 agreement as its evaluation. A drafter says how it scores a batch (`score`).

`run_drafter` is `cllm medusa`, `cllm medusa --joint` and `cllm eagle` as named steps, a `Drafter`
saying what differs:

1. `open_folder` + `_open_run`: the folder (by default MODEL/<command>; an unfinished run there is
   resumed, its options checked), the frozen model and its tokenizer, the drafter's own checks
   (`Drafter.prepare`), then the folder claimed (`claim_run`);
2. `read_texts`: the model's own greedy continuations of a prompt set (decoded once, or the fixed
   points of `cllm collect` trajectories), the last --holdout texts held out;
3. `Drafter.trainer`: what the model computes on the texts (once) and the trainer; then the
   skeleton's steps, each logged, the held-out loss and a checkpoint every --eval-every steps;
4. `Drafter.save`: the drafter, its default tree and what trained it (`training_record`); the
   run's checkpoint and texts removed;
5. `Drafter.evaluate`: greedy against the drafter's decoding of held-out prompts
   (`against_greedy`), in evaluation.json.

Nothing here prints: steps are logged and `run_drafter` returns a `DrafterResult`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Generic, TypeVar

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from cllm.core import __version__, runs
from cllm.core.config import write_config
from cllm.core.errors import UserError
from cllm.core.outputs import claim_folder, removed_on_early_failure
from cllm.core.progress import progress_bar
from cllm.data.prompts import encode_prompts
from cllm.decoding import greedy_decode
from cllm.decoding.inputs import model_device, position_limit
from cllm.models import (
    EMBEDDED_TARGET,
    SHIPPED,
    fingerprint,
    load_model,
    load_tokenizer,
    resolve_model_path,
    tokenizer_fingerprint,
)
from cllm.training.options import AUTO, DrafterOptions
from cllm.training.schedule import warmup_cosine
from cllm.training.skeleton import Plan, Trainer, descend, draw
from cllm.training.texts import Text, check_texts_source, training_texts

log = logging.getLogger(__name__)

HOLDOUT_SET = "holdout"  # the evaluation's prompt set when it is the held-out texts' prompts
Item = TypeVar("Item")  # what one training example is to a drafter (hidden states, a feature run, ...)


# ---------------------------------------------------------------------------------------------
# The trainer


@dataclass(frozen=True)
class Score:
    """A batch as a drafter scores it: the loss, the top-1 hits and counted positions (per head,
    or one of each), and the weight of the loss in a held-out mean (its positions)."""

    loss: torch.Tensor
    hits: torch.Tensor
    counts: torch.Tensor
    weight: int


class DrafterTrainer(Trainer, Generic[Item]):
    """AdamW on `drafter` alone (the model frozen, what it computes on the text precomputed in the
    items), linear warm-up then cosine decay; batches drawn from `items` by a seeded generator;
    `held` the held-out items of the evaluation."""

    def __init__(self, drafter: nn.Module, items: Sequence[Item], held: Sequence[Item], *, steps: int,
                 batch_size: int = 8, lr: float = 3e-3, weight_decay: float = 0.0, warmup: int = 0, seed: int = 0,
                 plan: Plan | None = None) -> None:
        if not items:
            raise UserError("no training texts for the drafter")
        self.drafter, self.items, self.held = drafter, list(items), list(held)
        self.steps, self.batch_size = steps, batch_size
        self.optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=lr,
                                           weight_decay=weight_decay)
        self.scheduler = warmup_cosine(self.optimizer, steps, min(warmup, steps))
        self.generator = torch.Generator().manual_seed(seed)
        self.before: dict | None = None  # the untrained drafter's held-out measures
        self.measured: tuple[int, dict] = (-1, {})  # the step of the latest held-out measures, and they
        if plan is not None:
            self.plan = plan

    # ------------------------------------------------------------------ what a drafter says

    def score(self, batch: Sequence[Item], *, training: bool) -> Score:
        raise NotImplementedError

    @property
    def positions(self) -> int:
        """Positions trained on (the record of what trained the drafter)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the skeleton's hooks

    def train_step(self) -> dict:
        """One optimizer step on a random batch: its loss, lr and top-1 agreement."""
        self.drafter.train()
        score = self.score([self.items[i] for i in draw(len(self.items), self.batch_size, self.generator)],
                           training=True)
        descend(score.loss, self.optimizer, self.scheduler)
        return {"loss": score.loss.item(), "lr": self.scheduler.get_last_lr()[0],
                "agreement": self.agreement(score.hits, score.counts)}

    def evaluate(self) -> dict:
        if not self.held:  # nothing held out (scripts, tests): no held-out measures
            return {}
        result = self.holdout()
        if self.step == 0:
            self.before = result
        self.measured = (self.step, result)
        return {"holdout": result}

    def final_holdout(self) -> dict:
        """The held-out measures after the last step: its evaluation's, else measured now (a run
        resumed at its end, or nothing held out)."""
        step, result = self.measured
        return result if step == self.step else self.holdout()

    @torch.no_grad()
    def holdout(self) -> dict:
        """Mean loss per position and top-1 agreement on the held-out items."""
        self.drafter.eval()
        total, weight, hits, counts = 0.0, 0, 0, 0
        for start in range(0, len(self.held), self.batch_size):
            score = self.score(self.held[start : start + self.batch_size], training=False)
            total, weight = total + float(score.loss) * score.weight, weight + score.weight
            hits, counts = hits + score.hits, counts + score.counts
        return {"loss": total / max(weight, 1), "agreement": self.agreement(hits, counts)}

    def agreement(self, hits: torch.Tensor, counts: torch.Tensor) -> list[float] | float:
        """Top-1 agreement: per head (a list), or one share."""
        return (hits / counts.clamp(min=1)).tolist()

    def postfix(self, record: dict) -> dict[str, str]:
        agreement = record["agreement"]
        first = agreement[0] if isinstance(agreement, list) else agreement
        return {"loss": f"{record['loss']:.3f}", "agree": f"{first:.2f}"}

    def state_dict(self) -> dict:
        return {"drafter": self.drafter.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "generator": self.generator.get_state(),
                "before": self.before}

    def load_state_dict(self, state: dict) -> None:
        self.drafter.load_state_dict(state["drafter"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.generator.set_state(state["generator"])
        self.before = state["before"]

    def train_in_memory(self) -> nn.Module:
        """All the steps in memory, no log or checkpoint (scripts, tests); returns the drafter."""
        while self.step < self.steps:
            self.advance()
        return self.drafter.eval()


# ---------------------------------------------------------------------------------------------
# The command


@dataclass(frozen=True)
class RunFiles:
    """The files a drafter run writes in its folder."""

    train_config: str
    log: str
    checkpoint: str
    texts: str  # the training texts while a run is unfinished (a resume reuses them)
    evaluation: str
    resume_free: frozenset[str]  # options that may change between a checkpoint and its resumption
    run_files: tuple[str | Path, ...]  # every file a run writes: removed when a new run starts there

    @classmethod
    def named_in(cls, names: ModuleType) -> RunFiles:
        """The files as a command's config module names them (TRAIN_CONFIG, LOG, CHECKPOINT, TEXTS,
        EVALUATION, RESUME_FREE, RUN_FILES)."""
        return cls(train_config=names.TRAIN_CONFIG, log=names.LOG, checkpoint=names.CHECKPOINT, texts=names.TEXTS,
                   evaluation=names.EVALUATION, resume_free=frozenset(names.RESUME_FREE),
                   run_files=tuple(sorted(names.RUN_FILES)))


@dataclass
class DrafterRun:
    """A drafter run's state, filled in by the steps in order."""

    config: DrafterOptions  # `MedusaConfig` or `EagleConfig`
    out: Path
    model_dir: Path
    resuming: bool
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    kind: Drafter
    train_texts: list[Text] = field(default_factory=list)
    held_texts: list[Text] = field(default_factory=list)


@dataclass(frozen=True)
class Drafter:
    """What one drafter command is: its names and files, and the steps that differ."""

    command: str  # "medusa", "eagle": the log's and progress bars' name, the folder's owner
    what: str  # "the heads": what --out holds, in messages
    files: RunFiles
    check: Callable[[Path, Path, DrafterOptions], None]  # refuse an --out (touching nothing), before anything loads
    trainer: Callable[[DrafterRun, Plan], DrafterTrainer]  # the model's features on the texts, the trainer
    save: Callable[[DrafterRun, DrafterTrainer, dict], None]  # the trained drafter, its tree and record
    evaluate: Callable[[DrafterRun, DrafterTrainer], dict | None]  # decoding against greedy
    prepare: Callable[[DrafterRun], None] = lambda run: None  # checks before the folder is claimed
    desc: str = ""  # the progress bar's label (default: "<command>: training")


@dataclass
class DrafterResult:
    """What a drafter run made: the drafter, its held-out loss and top-1 agreement before and
    after training, and the decoding evaluation (None with --eval-count 0)."""

    out: Path
    drafter: nn.Module
    before: dict | None
    after: dict | None = None  # None when the run stopped early
    evaluation: dict | None = None
    stopped_at: int | None = None  # the step a Ctrl-C stopped the run at (a rerun resumes there)


def run_drafter(kind: Drafter, config: DrafterOptions) -> DrafterResult:
    """Train (or resume) a drafter for `config.model` (frozen), save and evaluate it.

    Rerunning with the same config resumes an unfinished run from its checkpoint; Ctrl-C saves
    one and returns with `stopped_at` set."""
    files = kind.files
    model_dir, out, resuming = open_folder(config, kind.command, kind.what, kind.check, files=files)
    with removed_on_early_failure(out, kind.command, useful=lambda folder: resumable(folder, files)):
        run = _open_run(kind, config, model_dir, out, resuming)  # 1. the frozen model; the folder claimed
        read_texts(run)  # 2. the model's own greedy text, held-out texts
        plan = Plan(log=out / files.log, checkpoint=out / files.checkpoint, total=config.max_steps,
                    eval_every=config.eval_every, checkpoint_every=config.eval_every,
                    desc=kind.desc or f"{kind.command}: training")
        trainer = kind.trainer(run, plan)  # 3. features, the drafter and AdamW
        trainer.begin(_checkpoint(run.out / files.checkpoint) if resuming else None)
        if resuming:
            log.info("resuming %s at step %d of %d", out, trainer.step, config.max_steps)
        if not trainer.fit():  # ... steps, log, held-out loss and checkpoints
            return DrafterResult(out, trainer.drafter, trainer.before, stopped_at=trainer.step)
        after = trainer.final_holdout()
        kind.save(run, trainer, after)  # 4. the drafter, its tree and record
        for name in (files.checkpoint, files.texts):
            (out / name).unlink(missing_ok=True)
        return DrafterResult(out, trainer.drafter, trainer.before, after, kind.evaluate(run, trainer))  # 5.


def _checkpoint(path: Path) -> dict:
    """A drafter run's checkpoint; one written before the skeleton held its trainer's state under
    "trainer" (flattened here so that such a run still resumes)."""
    saved = runs.load_checkpoint(path)
    if "trainer" in saved:
        trainer = saved.pop("trainer")
        renamed = {"heads": "drafter", "head": "drafter", "heads_optimizer": "optimizer",
                   "heads_scheduler": "scheduler"}
        saved = {**saved, **{renamed.get(k, k): v for k, v in trainer.items()}}
    return saved


def resumable(out: Path, files: RunFiles) -> bool:
    """What a rerun of a drafter trainer resumes from (its checkpoint) or keeps (trained weights):
    once one is written, a failure keeps the folder."""
    return (out / files.checkpoint).exists() or any(out.rglob("*.safetensors"))


def open_folder(config: DrafterOptions, command: str, what: str, check: Callable[[Path, Path, DrafterOptions], None], *,
                files: RunFiles) -> tuple[Path, Path, bool]:
    """A drafter's folder: --out, by default the model's `command` subfolder, checked by `check`
    before anything is loaded; whether an unfinished run is there to resume (its options then
    must match but for the resume-free ones); the threads set. Writes nothing: `claim_run` does,
    once every input has been checked. Returns the model's folder, --out and whether it resumes."""
    model_dir = Path(resolve_model_path(config.model))
    if not model_dir.is_dir() and config.out is None:
        raise UserError(f"{config.model!r} is not a local checkpoint: give --out for {what}")
    out = Path(config.out) if config.out else model_dir / command
    config.out = str(out)
    check(out, model_dir, config)
    resuming = (config.resume and not config.force and (out / files.checkpoint).exists()
                and (out / files.train_config).exists())
    if resuming:
        runs.check_same_run(json.loads((out / files.train_config).read_text()), config, free=files.resume_free)
    if config.threads:
        torch.set_num_threads(config.threads)
    return model_dir, out, resuming


def _open_run(kind: Drafter, config: DrafterOptions, model_dir: Path, out: Path, resuming: bool) -> DrafterRun:
    """The frozen model with its tokenizer, the drafter's own checks, and the folder claimed once
    every input has been checked."""
    tokenizer = load_tokenizer(config.model)
    model = load_model(config.model, dtype=config.dtype, device=config.device).requires_grad_(False)
    run = DrafterRun(config, out, model_dir, resuming, model, tokenizer, kind)
    check_texts_source(config, out / kind.files.texts)
    kind.prepare(run)
    claim_run(config, kind.command, out, resuming, train_config=kind.files.train_config,
              run_files=kind.files.run_files)
    return run


def claim_run(config: DrafterOptions, command: str, out: Path, resuming: bool, *, train_config: str,
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


def holdout_warned(config: DrafterOptions) -> bool:
    """Whether a holdout larger than what is left to train on is worth a warning: not when
    --eval-prompts names a prompt set, as the evaluation then does not run on the held-out
    texts' prompts (they only give the held-out loss)."""
    return config.eval_prompts in (AUTO, HOLDOUT_SET)


def read_texts(run: DrafterRun) -> None:
    """The training text (decoded once; a resumed run reads it back), split into the texts
    trained on and the last --holdout ones."""
    config = run.config
    texts = training_texts(config, run.model, run.tokenizer, run.out / run.kind.files.texts, command=run.kind.command)
    run.train_texts, run.held_texts = split_holdout(texts, config.holdout, warn=holdout_warned(config))


def training_record(run: DrafterRun, trainer: DrafterTrainer, after: dict, **own) -> dict:
    """What trained a drafter, saved with it: its texts, positions and steps, the drafter's own
    settings (`own`), the time, and the held-out measures before and after."""
    return {"texts": len(run.train_texts), "holdout_texts": len(run.held_texts), "positions": trainer.positions,
            "steps": run.config.max_steps, **own, "seconds": round(trainer.elapsed, 1),
            "holdout_before": trainer.before, "holdout_after": after}


def base_model_meta(model: nn.Module, model_path: str | os.PathLike | None = None) -> dict[str, str]:
    """The fingerprints a drafter's loader checks: of the checkpoint folder when the model came
    from one, and of its float32 parameters (for a model given in memory)."""
    meta = {"parameters_fingerprint": fingerprint(model)}
    if model_path is not None:
        meta["model_fingerprint"] = fingerprint(model_path)
    return meta


def drafter_meta(run: DrafterRun, trainer: DrafterTrainer, after: dict, **own) -> dict:
    """What a drafter for the frozen model is saved with: the model and its fingerprints, the
    tokenizer's, the dtype and `training_record`."""
    config = run.config
    return {"model": config.model, **base_model_meta(run.model, run.model_dir if run.model_dir.is_dir() else None),
            "tokenizer_fingerprint": tokenizer_fingerprint(config.model), "dtype": config.dtype,
            "training": training_record(run, trainer, after, **own), "cllm_version": __version__}


# ---------------------------------------------------------------------------------------------
# The evaluation


def stdlib_domain(model: str) -> bool:
    """Whether `model` speaks the embedded target's language: it has its tokenizer (the shipped
    models and what is trained from them), so HumanEval and the stdlib sets are its domain."""
    target = SHIPPED[EMBEDDED_TARGET]
    return (target / "tokenizer.json").is_file() and tokenizer_fingerprint(model) == tokenizer_fingerprint(target)


def evaluation_prompts(run: DrafterRun, new: int, count: int | None = None) -> tuple[str, list[list[int]]]:
    """The evaluation's prompt set and its first --eval-count (or `count`) prompts (token ids, cut
    from the left to leave `new` positions): --eval-prompts, or with 'auto' HumanEval for a model
    of the stdlib domain, else the prompts of the held-out texts (never trained on)."""
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


def evaluate_drafter(run: DrafterRun, measure: Callable[[list[list[int]], int, Callable[[int], object]], dict],
                     **settings) -> dict | None:
    """`measure(prompts, new tokens, progress)` on the first --eval-count evaluation prompts (none:
    None), with the settings it ran under, written to evaluation.json."""
    config = run.config
    if not config.eval_count:
        return None
    new = evaluation_length(run)
    prompt_set, prompts = evaluation_prompts(run, new)
    with progress_bar(total=len(prompts), unit="prompt", desc=f"{run.kind.command}: evaluation") as bar:
        evaluation = measure(prompts, new, bar.update)
    evaluation.update(prompt_set=prompt_set, max_new_tokens=new, threads=torch.get_num_threads(),
                      device=config.device, dtype=config.dtype, **settings)
    (run.out / run.kind.files.evaluation).write_text(json.dumps(evaluation, indent=2) + "\n")
    return evaluation


def evaluation_length(run: DrafterRun) -> int:
    """New tokens per evaluation prompt: --eval-max-new-tokens, at most half the model's context."""
    limit, wanted = position_limit(run.model), run.config.eval_max_new_tokens
    return min(wanted, limit // 2) if limit else wanted


@torch.inference_mode()
def against_greedy(model: nn.Module, prompts: Sequence[Sequence[int]], decode: Callable[[torch.Tensor], object], *,
                   max_new_tokens: int, eos_token_id: int | Iterable[int] | None = None,
                   seen: Callable[[object], None] | None = None,
                   progress: Callable[[int], object] | None = None) -> dict:
    """Greedy and a drafter's decoding (`decode(ids)`, batch 1) of each prompt: whether the drafter
    wrote greedy's tokens, tokens per forward (all prompts pooled, docs/method.md#counting), the
    accepted histogram, and the seconds of both; `seen(output)` reads what else a drafter counts."""
    device = model_device(model)
    tokens = forwards = exact = greedy_tokens = 0
    seconds = {"greedy": 0.0, "drafter": 0.0}
    histogram: dict[int, int] = {}
    mismatches = []
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([list(prompt)], device=device)
        started = time.perf_counter()
        expected = greedy_decode(model, ids, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id).new_tokens[0]
        seconds["greedy"] += time.perf_counter() - started
        started = time.perf_counter()
        out = decode(ids)
        seconds["drafter"] += time.perf_counter() - started
        got = out.new_tokens[0]
        if got == expected:
            exact += 1
        else:
            first = next((j for j, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b),
                         min(len(got), len(expected)))
            mismatches.append({"prompt": i, "first_difference": first})
        tokens, forwards = tokens + len(got), forwards + out.forward_passes
        greedy_tokens += len(expected)
        for n, c in out.stats.accepted_histogram().items():
            histogram[n] = histogram.get(n, 0) + c
        if seen is not None:
            seen(out)
        if progress is not None:
            progress(1)
    return {"prompts": len(prompts), "exact": exact, "mismatches": mismatches, "new_tokens": tokens,
            "forward_passes": forwards, "tokens_per_forward": tokens / max(forwards, 1),
            "accepted_histogram": {str(k): v for k, v in sorted(histogram.items())},
            "seconds": seconds, "greedy_tokens": greedy_tokens}
