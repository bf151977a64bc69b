"""`cllm distill`: from a target model to a CLLM in one command: collect Jacobi trajectories,
consistency-train, evaluate target against CLLM.

    OUT/trajectories/     `cllm collect` output (resumes prompt by prompt)
    OUT/model/            `cllm train` output: the CLLM, an ordinary HF checkpoint + MODEL_CARD.md
                          (resumes from OUT/model/checkpoints/last.pt)
    OUT/evaluation.json   target vs CLLM on held-out prompts: Jacobi tokens per forward at each
                          block size, CLLM Jacobi == CLLM greedy, AR validation loss, agreement
    OUT/model/drafts/     the CLLM's draft table (`cllm drafts`: what it writes after each 4-, 3-
                          and 2-token context in its own greedy completions of the training prompts),
                          which generate / serve / bench use by default (speed only, exact)
    OUT/distill_config.json
    OUT/trajectories-round2/, OUT/model-round2/, ...   with --rounds k: round r re-collects the
                          trajectories with round r-1's CLLM (on-policy: the CLLM's own
                          trajectories and fixed points) and trains it further; the last
                          round's model is the result

Rerunning the same command skips every stage that is done (collection skips finished prompts,
training a finished run, evaluation an up-to-date evaluation.json) and continues an
interrupted one. Launched as several processes (`accelerate launch --multi_gpu --num_processes
2 -m cllm.cli distill ...`, with ``CUDA_VISIBLE_DEVICES=""`` on a CPU machine) collection and
training use them all; the evaluation runs on the main process.

The defaults are the recipe of `benchmarks/distill_ablations.md` that kept the target's text
best (row r7): 2,560 `stdlib-train` prompts x 128 tokens of trajectories (n = 16), argmax GC with
the frozen target as consistency teacher, 8 states per record sharing one prefix forward, no
target that a wrong state token just before it already shows (`--skip-copies`), and instead of
hard AR labels, distillation from the frozen target (KL x 10) on its fixed points, 4 windows of
real text and 6 greedy 128-token rollouts of the CLLM per step (on-policy); 450 steps, lr 2e-4.
The shipped `models/stdlib-coder-cllm` was trained with it (as `cllm collect` + `cllm train`
with these settings): 4,266 s of training on 2 CPU cores, one thread, with another job
beside it (its `train_summary.json`).
The reference's recipe (the model its own consistency teacher, 10 x hard AR on the ground
truth) is `--consistency-teacher model --ar-weight 10 --ar-target labels --kd-weight 0
--rollout-prompts 0 --skip-copies false`: faster by itself, and its text loops far more.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from cllm.core.config import config_to_dict, is_off, write_config
from cllm.core.errors import UserError
from cllm.modeling import losses
from cllm.training.train import ArTarget, Consistency, TrainConfig

log = logging.getLogger(__name__)

EVALUATION = "evaluation.json"


@dataclass
class DistillConfig:
    model: str = field(default="stdlib-coder", metadata={"help": "target model: shipped name, checkpoint dir or hub "
        "id"})
    prompts: str = field(default="stdlib-train", metadata={"help": "prompt set to collect trajectories on (name or "
        "JSONL/Parquet file)"})
    out: str = field(default="runs/distill", metadata={"help": "output directory (trajectories/, model/, "
        "evaluation.json); rerun to resume"})
    # collection
    max_prompts: int | None = field(default=2560, metadata={"help": "collect on the first N prompts (None: all)"})
    block_size: int = field(default=16, metadata={"help": "Jacobi block size n of the trajectories"})
    round_block_sizes: list[int] | None = field(default=None, metadata={"help": "block size of each round's "
        "trajectories, e.g. 16,32 (Jacobi Forcing: n = 16, then 32 collected with round 1's CLLM); the last one "
        "repeats for later rounds (default: --block-size every round); a round keeps only the earlier trajectories of "
        "its own block size"})
    max_new_tokens: int = field(default=128, metadata={"help": "new tokens per prompt in collection"})
    collect_batch_size: int = field(default=8, metadata={"help": "prompts per forward in collection"})
    guess: Literal["prompt", "repeat", "random", "lookup"] = field(default="prompt", metadata={"help": "initial guess "
        "of a block (collection)"})
    # training
    consistency: Consistency = field(default="gc", metadata={"help": "consistency loss: gc, lc or gc+lc"})
    distance: losses.Distance = field(default="argmax", metadata={"help": "consistency distance: fkl, rkl, jsd, "
        "argmax"})
    states_per_record: int = field(default=8, metadata={"help": "trajectory states per record and step (they share the "
        "prefix's forward)"})
    gc_window: int | None = field(default=None, metadata={"help": "GC counts only this many positions after the first "
        "wrong one"})
    state_schedule: Literal["uniform", "progressive"] = field(default="uniform", metadata={"help": "states drawn "
        "uniformly per record, or by Jacobi Forcing's progressive noise schedule"})
    layout: Literal["records", "packed"] = field(default="records", metadata={"help": "training forward: one row per "
        "record, or Jacobi Forcing's packing (one sequence per prompt; --batch-size then counts prompts)"})
    ar_weight: float = field(default=0.0, metadata={"help": "weight of the hard-label AR loss (the reference: 10; 0: "
        "the distillation term alone keeps the model close to the target)"})
    ar_target: ArTarget = field(default="fixed_points", metadata={"help": "AR rows: labels (ground truth), "
        "fixed_points, both, or auto (labels when the prompts have references, else fixed points)"})
    ar_text: str | None = field(default="stdlib-train", metadata={"help": "AR loss also on random windows of this "
        "text: 'stdlib-train' (the embedded Python corpus), a text file of your domain, or 'none'"})
    ar_text_windows: int = field(default=4, metadata={"help": "text windows per step"})
    ar_text_length: int = field(default=256, metadata={"help": "tokens per text window"})
    label_smoothing: float = field(default=0.0, metadata={"help": "label smoothing of the AR loss"})
    kd_weight: float = field(default=10.0, metadata={"help": "weight of distillation from the frozen target (soft "
        "labels) on the AR rows and the rollouts; 0: none"})
    kd_distance: losses.Distance = field(default="fkl", metadata={"help": "distance of the distillation term: fkl, "
        "rkl, jsd, or argmax (cross-entropy on the target's argmax)"})
    consistency_teacher: Literal["model", "target"] = field(default="target", metadata={"help": "the consistency "
        "targets: the model's own stop-gradient logits (the reference) or the frozen target's"})
    rollout_prompts: int = field(default=6, metadata={"help": "on-policy distillation: rollouts of the model being "
        "trained per step, scored by the frozen target (needs --kd-weight)"})
    rollout_tokens: int = field(default=128, metadata={"help": "new tokens per rollout"})
    rollout_temperature: float = field(default=0.0, metadata={"help": "0: greedy rollouts; > 0: sampled"})
    rollout_policy: Literal["model", "teacher"] = field(default="model", metadata={"help": "rollouts by the model "
        "being trained (on-policy) or by the frozen target"})
    lr: float = field(default=2e-4, metadata={"help": "peak learning rate"})
    warmup_ratio: float = field(default=0.03, metadata={"help": "warm-up fraction of the steps"})
    epochs: int = field(default=4, metadata={"help": "passes over the records (when max-steps is not set)"})
    max_steps: int | None = field(default=450, metadata={"help": "optimizer steps (overrides epochs)"})
    batch_size: int = field(default=16, metadata={"help": "records (--layout packed: prompts) per optimizer step"})
    micro_batch_size: int | None = field(default=None, metadata={"help": "records (--layout packed: prompts) per "
        "forward (gradient accumulation)"})
    lora: bool = field(default=False, metadata={"help": "train a LoRA adapter (merged on save) instead of all weights"})
    dtype: Literal["float32", "bfloat16"] = field(default="float32", metadata={"help": "training forwards in float32 "
        "or bfloat16 autocast"})
    train_eval_count: int = field(default=16, metadata={"help": "held-out prompts evaluated during training"})
    eval_interval: int = field(default=100, metadata={"help": "evaluate during training every N steps"})
    checkpoint_interval: int = field(default=100, metadata={"help": "save the trainer state every N steps"})
    select: Literal["last", "gated"] = field(default="last", metadata={"help": "the CLLM of a round: the last step's "
        "weights, or the fastest evaluation that passed the loop / degenerate gates (train --select gated)"})
    seed: int = field(default=0, metadata={"help": "seed of collection guesses and training"})
    rounds: int = field(default=1, metadata={"help": "collect + train rounds: round k >= 2 re-collects the "
        "trajectories with round k-1's CLLM (on-policy) and trains it further"})
    drop_loops: bool = field(default=True, metadata={"help": "rounds 2+ drop a prompt's blocks from the first one "
        "where the CLLM's output ends in a loop (collect --drop-loops), so none of its own loops is a consistency "
        "target"})
    skip_copies: bool = field(default=True, metadata={"help": "consistency counts no target that a wrong state token "
        "just before it already shows (train --skip-copies)"})
    cut_loops: bool = field(default=False, metadata={"help": "rounds 2+ keep every block but count no consistency "
        "target that continues a loop (train --cut-loops); use with --drop-loops false"})
    accumulate: bool = field(default=True, metadata={"help": "round k trains on the trajectories of rounds 1..k "
        "(earlier data kept, never replaced); false: round k's alone"})
    # evaluation
    eval_prompts: str = field(default="stdlib-val", metadata={"help": "held-out prompt set for the evaluations"})
    eval_count: int = field(default=32, metadata={"help": "held-out prompts in the final evaluation"})
    eval_block_sizes: list[int] = field(default_factory=lambda: [16, 32], metadata={"help": "Jacobi block sizes of the "
        "final evaluation"})
    eval_max_new_tokens: int = field(default=64, metadata={"help": "new tokens per prompt in the evaluations"})
    eval_batch_size: int = field(default=8, metadata={"help": "prompts per batch in the evaluations"})
    # draft table
    drafts_prompts: int = field(default=2400, metadata={"help": "the CLLM's draft table (cllm drafts) from its greedy "
        "completions of this many --prompts (0: no table)"})
    drafts_max_new_tokens: int = field(default=128, metadata={"help": "greedy tokens per prompt for the draft table"})

    def __post_init__(self) -> None:
        for name in ("block_size", "max_new_tokens", "collect_batch_size", "eval_count", "eval_max_new_tokens",
                     "eval_batch_size", "rounds",
                     "drafts_max_new_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise UserError(f"{name.replace('_', '-')} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("eval_block_sizes", "round_block_sizes"):
            sizes = getattr(self, name)
            if sizes is None and name == "round_block_sizes":  # --block-size every round
                continue
            if not sizes or any(not isinstance(n, int) or n < 1 for n in sizes):
                raise UserError(f"{name.replace('_', '-')} must be positive integers, got {sizes!r}")
        if not self.out:
            raise UserError("out must name a directory")
        if not isinstance(self.drafts_prompts, int) or self.drafts_prompts < 0:
            raise UserError(f"drafts-prompts must be an integer >= 0, got {self.drafts_prompts!r}")
        if is_off(self.ar_text):
            self.ar_text = None
        self.train_config()  # validates the training options

    def round_model(self, round_: int) -> str:
        """What round `round_` starts from: the target, then the previous round's CLLM."""
        return self.model if round_ == 1 else str(self.round_dir(round_ - 1, "model"))

    def round_block_size(self, round_: int) -> int:
        """The Jacobi block size of round `round_`'s trajectories."""
        sizes = self.round_block_sizes or [self.block_size]
        return sizes[min(round_, len(sizes)) - 1]

    def round_dir(self, round_: int, kind: str) -> Path:
        """OUT/trajectories and OUT/model for round 1, OUT/{kind}-round{k} after."""
        return Path(self.out) / (kind if round_ == 1 else f"{kind}-round{round_}")

    def collect_config(self, round_: int = 1):
        from cllm.training.collect import CollectConfig

        return CollectConfig(model=self.round_model(round_), prompts=self.prompts,
                             out=str(self.round_dir(round_, "trajectories")),
                             block_size=self.round_block_size(round_), max_new_tokens=self.max_new_tokens,
                             max_prompts=self.max_prompts, guess=self.guess, seed=self.seed,
                             batch_size=self.collect_batch_size, drop_loops=self.drop_loops and round_ >= 2)

    def train_config(self, round_: int = 1) -> TrainConfig:
        first = 1 if self.accumulate else round_
        n = self.round_block_size(round_)
        data = ",".join(str(self.round_dir(r, "trajectories")) for r in range(first, round_ + 1)
                        if self.round_block_size(r) == n)
        needs_teacher = self.kd_weight > 0 or self.consistency_teacher == "target"
        return TrainConfig(
            model=self.round_model(round_), data=data, out=str(self.round_dir(round_, "model")),
            teacher=self.model if round_ > 1 and (needs_teacher or self.accumulate) else None,
            kd_weight=self.kd_weight, kd_distance=self.kd_distance, consistency_teacher=self.consistency_teacher,
            rollout_prompts=self.rollout_prompts, rollout_tokens=self.rollout_tokens,
            rollout_temperature=self.rollout_temperature, rollout_policy=self.rollout_policy,
            cut_loops=self.cut_loops and round_ > 1,
            state_schedule=self.state_schedule, layout=self.layout, select=self.select, skip_copies=self.skip_copies,
            consistency=self.consistency, distance=self.distance, ar_weight=self.ar_weight,
            states_per_record=self.states_per_record, gc_window=self.gc_window, ar_text=self.ar_text,
            ar_text_windows=self.ar_text_windows, ar_text_length=self.ar_text_length,
            ar_target=self.ar_target, label_smoothing=self.label_smoothing, lr=self.lr,
            warmup_ratio=self.warmup_ratio, epochs=self.epochs, max_steps=self.max_steps,
            batch_size=self.batch_size, micro_batch_size=self.micro_batch_size, lora=self.lora,
            dtype=self.dtype, seed=self.seed, eval_prompts=self.eval_prompts,
            eval_count=self.train_eval_count, eval_max_new_tokens=self.eval_max_new_tokens,
            eval_block_size=max(self.eval_block_sizes),
            eval_batch_size=self.eval_batch_size, eval_interval=self.eval_interval,
            checkpoint_interval=self.checkpoint_interval,
        )

    def drafts_config(self, model_dir: Path):
        from cllm.training.drafts import DraftsConfig

        return DraftsConfig(model=str(model_dir), prompts=self.prompts, max_prompts=self.drafts_prompts,
                            max_new_tokens=self.drafts_max_new_tokens, batch_size=self.collect_batch_size)

    def eval_settings(self) -> dict:
        return {"prompts": self.eval_prompts, "count": self.eval_count, "block_sizes": list(self.eval_block_sizes),
                "max_new_tokens": self.eval_max_new_tokens, "seed": self.seed}


@dataclass
class DistillSummary:
    out: str
    skipped: list[str]  # stages found done: "train", "evaluate", "drafts" (collection always checks)
    evaluation: dict


def evaluate_distilled(target_name: str, cllm_dir: str | Path, config: DistillConfig) -> dict:
    """Target vs CLLM on held-out prompts, both loaded in float32 from disk, greedy.

    quality: `cllm.evaluation.quality.compare_models` on the held-out prompts (parse / degenerate / looping
    rates of the greedy completions, the target's NLL of them, first divergence from the
    target's text, plain-Jacobi tokens per forward over all and over non-looping completions);
    gates: its pass/fail lines. The keys kept from before, read off it: tokens_per_forward[model][n],
    cllm_jacobi_equals_greedy[n], greedy_agreement / token_agreement (CLLM greedy vs target
    greedy, per prompt / per token), degenerate[model] / looping[model]; and ar_loss[model]:
    nats/token on the prompts' references.
    """
    from cllm.decoding.inputs import position_limit
    from cllm.evaluation.gates import QualitySettings, compare_models, gates
    from cllm.evaluation.heldout import heldout_prompts, reference_loss
    from cllm.models import fingerprint, load_model, load_tokenizer, pad_token_id

    tokenizer = load_tokenizer(cllm_dir)
    models = {"target": load_model(target_name), "cllm": load_model(str(cllm_dir))}
    pad = pad_token_id(tokenizer)
    settings = QualitySettings(prompt_sets={config.eval_prompts: config.eval_count},
                               block_sizes=list(config.eval_block_sizes), max_new_tokens=config.eval_max_new_tokens,
                               batch_size=config.eval_batch_size, seed=config.seed, val_loss=False, spread=[])
    quality = compare_models(models, tokenizer, settings, pad_id=pad)
    per_model = quality["sets"][config.eval_prompts]
    prompts = heldout_prompts(config.eval_prompts, tokenizer, count=config.eval_count,
                                max_new_tokens=config.eval_max_new_tokens, context=position_limit(models["cllm"]))
    cllm = per_model["cllm"]
    return {
        "settings": config.eval_settings(), "prompts_evaluated": cllm["prompts"],
        "cllm_fingerprint": fingerprint(cllm_dir), "target_fingerprint": fingerprint(target_name),
        "tokens_per_forward": {name: dict(q["tpf"]) for name, q in per_model.items()},
        "cllm_jacobi_equals_greedy": dict(cllm["jacobi_exact"]),
        "ar_loss": {name: reference_loss(m, prompts, batch_size=config.eval_batch_size, pad_id=pad)
                    for name, m in models.items()},
        "greedy_agreement": cllm["same_as_target"], "token_agreement": cllm["token_agreement"],
        "degenerate": {name: q["degenerate_rate"] for name, q in per_model.items()},
        "looping": {name: q["looping_rate"] for name, q in per_model.items()},
        "quality": quality,
        "gates": [g.__dict__ for g in gates(quality, "cllm")],
    }


REPETITION_MARGIN = 0.2  # warn when the CLLM's greedy completions loop this much more often


def repetition_warning(ev: dict) -> str | None:
    """A one-line warning when the CLLM's greedy completions end in loops far more often than
    the target's: its speed would partly be the speed of decoding repetition."""
    looping = ev.get("looping")
    if looping is None or looping["cllm"] < looping["target"] + REPETITION_MARGIN:
        return None
    return (f"warning: {looping['cllm']:.0%} of the CLLM's greedy completions end in a loop "
            f"(target: {looping['target']:.0%}); check its outputs before using it")


def _train_done(config: TrainConfig) -> bool:
    from cllm.training.train import CONFIG, SUMMARY

    out = Path(config.out)
    if not (out / SUMMARY).is_file() or not (out / CONFIG).is_file():
        return False
    saved, wanted = json.loads((out / CONFIG).read_text()), config_to_dict(config)
    if wanted["ar_target"] == "auto" and saved.get("ar_target") in ("labels", "fixed_points"):
        saved["ar_target"] = "auto"  # train wrote what auto resolved to
    return saved == wanted


def _evaluation_done(path: Path, config: DistillConfig, cllm_dir: Path) -> dict | None:
    from cllm.models import fingerprint

    if not path.is_file():
        return None
    ev = json.loads(path.read_text())
    if ev.get("settings") != config.eval_settings() or ev.get("cllm_fingerprint") != fingerprint(cllm_dir):
        return None
    if "quality" not in ev:  # written before the quality measures existed
        return None
    return ev


def _drafts_done(config, model_dir: Path) -> bool:
    """The table beside the CLLM was built from this very CLLM with these settings."""
    from cllm.core.config import config_to_dict
    from cllm.decoding.draft_table import DraftTable
    from cllm.models import DRAFT_TABLE, fingerprint

    table, settings = model_dir / DRAFT_TABLE, (model_dir / DRAFT_TABLE).with_suffix(".config.json")
    if not table.is_file() or not settings.is_file():
        return False
    same = json.loads(settings.read_text()) == config_to_dict(config)
    return same and DraftTable.read_meta(table).get("model_fingerprint") == fingerprint(model_dir)


def distill(config: DistillConfig) -> DistillSummary:
    """Collect, train and evaluate (each stage resumable); returns what the run did.

    Args:
        config: a validated `DistillConfig`.
    """
    from accelerate import PartialState

    from cllm.models import resolve_model_path
    from cllm.training.cards import cllm_card, evaluation_table
    from cllm.training.collect import collect
    from cllm.training.drafts import drafts
    from cllm.training.train import CARD, SUMMARY, train

    out = Path(config.out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a directory")
    resolve_model_path(config.model)  # a missing model fails before the prompt set is read
    state = PartialState()
    skipped: list[str] = []
    for round_ in range(1, config.rounds + 1):
        collect_config, train_config = config.collect_config(round_), config.train_config(round_)
        # 1. trajectories (collect skips the prompts it already finished)
        collect(collect_config)
        if state.is_main_process:
            write_config(config, out / "distill_config.json")
        # 2. the CLLM (train resumes from its checkpoint; a finished run with this config is kept)
        if _train_done(train_config):
            skipped.append("train" if config.rounds == 1 else f"train round {round_}")
        else:
            train(train_config)
    model_dir = Path(train_config.out)

    # 3. target vs CLLM, on the main process
    evaluation: dict = {}
    if state.is_main_process:
        path = out / EVALUATION
        evaluation = _evaluation_done(path, config, model_dir)
        if evaluation is not None:
            skipped.append("evaluate")
        else:
            evaluation = evaluate_distilled(config.model, model_dir, config)
            path.write_text(json.dumps(evaluation, indent=2) + "\n")
        info = json.loads((model_dir / SUMMARY).read_text())
        section = (f"\n## Distillation evaluation\n\n`cllm distill`, {evaluation['prompts_evaluated']} held-out "
                   f"prompts of `{config.eval_prompts}`, {config.eval_max_new_tokens} new tokens, greedy, "
                   f"both models in float32.\n\n{evaluation_table(evaluation)}\n")
        (model_dir / CARD).write_text(cllm_card(info, section))
        print(f"distilled {config.model} -> {model_dir}" + (f" (skipped: {', '.join(skipped)})" if skipped else ""))
        print(evaluation_table(evaluation))
        if (warning := repetition_warning(evaluation)) is not None:
            print(warning)
        # 4. the CLLM's draft table (its own greedy completions of the training prompts)
        if config.drafts_prompts:
            drafts_config = config.drafts_config(model_dir)
            if _drafts_done(drafts_config, model_dir):
                skipped.append("drafts")
            else:
                drafts(drafts_config)
    state.wait_for_everyone()
    return DistillSummary(out=str(out), skipped=skipped, evaluation=evaluation)

