"""Distillation (`cllm distill`): from a target model to a CLLM in one call: collect Jacobi
trajectories, consistency-train, evaluate target against CLLM, build the CLLM's draft table.

    OUT/trajectories/     `cllm collect` output (resumes prompt by prompt)
    OUT/model/            `cllm train` output: the CLLM, an ordinary HF checkpoint + MODEL_CARD.md
                          (resumes from OUT/model/checkpoints/last.pt)
    OUT/evaluation.json   target vs CLLM on held-out prompts: Jacobi tokens per forward at each
                          block size, CLLM Jacobi == CLLM greedy, AR validation loss, agreement
    OUT/model/drafts/     the CLLM's draft table (`cllm drafts`: what it writes after each 4-, 3-
                          and 2-token context in its own greedy completions of the training prompts),
                          which generate / serve / bench use by default (speed only, exact)
    OUT/distill_config.json
    OUT/heldout_prompts.jsonl  without --eval-prompts outside the stdlib domain: the last
                          --eval-count prompts of --prompts, kept out of collection and of the
                          draft table, which the evaluations use
    OUT/trajectories-round2/, OUT/model-round2/, ...   with --rounds k: round r re-collects the
                          trajectories with round r-1's CLLM (on-policy: the CLLM's own
                          trajectories and fixed points) and trains it further; the last
                          round's model is the result

Every input of every stage (model, prompt sets, --ar-text, teacher, output folders) is checked
before the first long one. Rerunning the same command skips every stage that is done
(collection skips finished prompts, training a finished run, evaluation an up-to-date
evaluation.json) and continues an interrupted one. Launched as several processes (`accelerate
launch --multi_gpu --num_processes 2 -m cllm.cli distill ...`, with ``CUDA_VISIBLE_DEVICES=""``
on a CPU machine) collection and training use them all; the evaluation runs on the main process.

The defaults (`DISTILL_RECIPE`) are the recipe of `benchmarks/distill_ablations.md` that kept
the target's text best (row r7): 2,560 `stdlib-train` prompts x 128 tokens of trajectories
(n = 16), argmax GC with the frozen target as consistency teacher, 8 states per record sharing one prefix forward, no
target that a wrong state token just before it already shows (`--skip-copies`), and instead of
hard AR labels, distillation from the frozen target (KL x 10) on its fixed points, 4 windows of
real text and 6 greedy 128-token rollouts of the CLLM per step (on-policy); lr 2e-4, one epoch
over the collected records unless --epochs or --max-steps says otherwise. The shipped
`models/stdlib-coder-cllm` was trained with it for 450 steps (`--max-steps 450`; its
`train_summary.json`).
The reference's recipe (the model its own consistency teacher, 10 x hard AR on the ground
truth) is `--consistency-teacher model --ar-weight 10 --ar-target labels --kd-weight 0
--rollout-prompts 0 --skip-copies false`: faster by itself, and its text loops far more.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from accelerate import PartialState

from cllm.core.config import config_to_dict, write_config
from cllm.core.errors import UserError
from cllm.core.outputs import check_folder, claim_folder
from cllm.data.prompts import PromptText, load_prompts
from cllm.decoding.inputs import position_limit
from cllm.evaluation.gates import QualitySettings, compare_models, gates
from cllm.evaluation.heldout import heldout_prompts, reference_loss
from cllm.models import fingerprint, load_model, load_tokenizer, pad_token_id, resolve_model_path
from cllm.training import collect as collect_stage
from cllm.training import run as train_run
from cllm.training.cards import cllm_card, evaluation_table
from cllm.training.collect import collect
from cllm.training.config import NO_EVAL_PROMPTS, TrainConfig, default_eval_set, one_length
from cllm.training.distill_config import DistillConfig
from cllm.training.drafts import DraftsConfig, build_draft_table, drafts_done
from cllm.training.train import train

log = logging.getLogger(__name__)

EVALUATION = "evaluation.json"
HELDOUT = "heldout_prompts.jsonl"


@dataclass(frozen=True)
class EvalPlan:
    """The held-out set of a distillation and where it comes from."""

    prompts: str  # the set the evaluations decode: --eval-prompts, stdlib-val, or OUT/heldout_prompts.jsonl
    held_out: list[PromptText]  # the last --eval-count prompts of --prompts, when they are the set
    limit: int | None  # the first prompts of --prompts collection and the draft table may use
    line: str  # which set, in a line of the log


@dataclass
class DistillSummary:
    out: str
    skipped: list[str]  # stages found done: "train", "evaluate", "drafts" (collection always checks)
    evaluation: dict
    model_dir: str = ""  # the CLLM (the last round's)


# ---------------------------------------------------------------------------------------------
# Before the first long stage: every input, and the held-out set


def plan_evaluation(config: DistillConfig) -> EvalPlan:
    """--eval-prompts when given; else stdlib-val in the stdlib domain (a shipped model or a named
    prompt set); else the last --eval-count prompts of --prompts, kept out of collection."""
    given = config.recipe.eval_prompts
    if given:
        return EvalPlan(given, [], None, f"held-out evaluation on --eval-prompts {given}")
    found = default_eval_set(config.model, config.prompts)
    if found is not None:
        return EvalPlan(found, [], None, f"held-out evaluation on {found} (no --eval-prompts; the stdlib domain)")
    prompts = load_prompts(config.prompts)
    kept = len(prompts) - config.eval_count
    if kept < 1:
        raise UserError(f"--prompts {config.prompts} holds {len(prompts)} prompts: holding out --eval-count "
                        f"{config.eval_count} of them for evaluation leaves none to train on; lower --eval-count or "
                        "pass --eval-prompts")
    return EvalPlan(str(Path(config.out) / HELDOUT), prompts[kept:], kept,
                    f"{NO_EVAL_PROMPTS}: held-out evaluation on the last {config.eval_count} of the {len(prompts)} "
                    f"prompts of {config.prompts}, kept out of collection and of the draft table "
                    f"(OUT/{HELDOUT})")


def check_inputs(config: DistillConfig) -> EvalPlan:
    """Every input of every stage, each problem one UserError before the first long stage: the
    output folder, the model, --prompts and the trajectories' folder (collection), --ar-text,
    the held-out prompts, the teacher and the CLLM's folder (training). Returns the plan of the
    evaluation."""
    check_folder(config.out, "distill", inputs=[("--model", resolve_model_path(config.model))])
    collect_stage.check_inputs(config.collect_config(1))
    plan = plan_evaluation(config)
    train_config = config.train_config(1, eval_prompts=plan.prompts)
    if plan.held_out:  # cut from --prompts, read above; written once every check has passed
        train_config = dataclasses.replace(train_config, eval_count=0)
    train_run.check_inputs(train_config)
    return plan


def _write_held_out(path: Path, prompts: list[PromptText]) -> None:
    """The held-out prompts as a JSONL prompt file (id, prompt, reference)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"id": p.id, "prompt": p.text, **({"reference": p.reference} if p.reference is not None else {})}
            for p in prompts]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


# ---------------------------------------------------------------------------------------------
# The stages


def distill(config: DistillConfig) -> DistillSummary:
    """Collect, train, evaluate and build the draft table (each stage resumable); returns what
    the run did. Each stage's summary goes to the log.

    Args:
        config: a validated `DistillConfig`.
    """
    plan = check_inputs(config)  # 1. every input, before the first long stage
    log.info("distill: %s", plan.line)
    if plan.held_out and plan.limit < len(plan.held_out):
        log.warning("holding out %d of the %d prompts of %s for evaluation leaves %d to train on",
                    len(plan.held_out), plan.limit + len(plan.held_out), config.prompts, plan.limit)
    out, state = Path(config.out), PartialState()
    if state.is_main_process:
        claim_folder(out, "distill")
    if plan.held_out and state.is_main_process:
        _write_held_out(Path(plan.prompts), plan.held_out)
    state.wait_for_everyone()
    skipped: list[str] = []
    for round_ in range(1, config.rounds + 1):  # 2. trajectories, then the CLLM, per round
        model_dir = _round(config, plan, round_, skipped, write_config_file=state.is_main_process)
    evaluation: dict = {}
    if state.is_main_process:
        evaluation = _evaluation_stage(config, plan, model_dir, skipped)  # 3. target vs CLLM
        if config.drafts_prompts:  # 4. the CLLM's draft table (its own greedy completions)
            _drafts_stage(config.drafts_config(model_dir, limit=plan.limit), skipped)
    state.wait_for_everyone()
    return DistillSummary(out=str(out), skipped=skipped, evaluation=evaluation, model_dir=str(model_dir))


def _round(config: DistillConfig, plan: EvalPlan, round_: int, skipped: list[str], *,
           write_config_file: bool) -> Path:
    """Collect round `round_`'s trajectories (collect skips the prompts it already finished) and
    train its CLLM (train resumes from its checkpoint; a finished run with this config is kept)."""
    rounds = f" (round {round_} of {config.rounds})" if config.rounds > 1 else ""
    log.info("distill: collect%s: its progress bar's time left is collection's alone; %s", rounds,
             later_stages(config, round_, "collect"))
    summary = collect(config.collect_config(round_, limit=plan.limit))
    for line in summary.lines():
        log.info("%s", line)
    if write_config_file:
        write_config(config, Path(config.out) / "distill_config.json")
    train_config = config.train_config(round_, eval_prompts=plan.prompts)
    if _train_done(train_config):
        skipped.append("train" if config.rounds == 1 else f"train round {round_}")
    else:
        rate = summary.tokens_per_second if summary.new_tokens else None
        then = later_stages(config, round_, "train", tokens_per_second=rate)
        log.info("distill: train%s: the time left it gives is training's alone; %s", rounds, then)
        for line in train(train_config, then=then).lines():  # its time left line ends with `then`
            log.info("%s", line)
    return Path(train_config.out)


STAGES = ("collect", "train", "evaluate", "drafts")


def later_stages(config: DistillConfig, round_: int, stage: str, *, tokens_per_second: float | None = None) -> str:
    """What comes after `stage` of round `round_`, in words, and (given the collection's
    decoding speed) roughly how long the decoding stages take at that speed: the evaluation
    decodes both models' greedy and Jacobi completions of the held-out prompts, the draft table
    the CLLM's greedy completions of --drafts-prompts prompts."""
    later = [s for s in STAGES[STAGES.index(stage) + 1:] if s != "drafts" or config.drafts_prompts]
    rounds_left = config.rounds - round_
    names = ([f"{rounds_left} more collect + train round{'s' if rounds_left > 1 else ''}"] if rounds_left else []) \
        + [{"train": "train", "evaluate": "evaluate", "drafts": "the draft table"}[s] for s in later
           if s != "train" or stage == "collect"]
    text = "then: " + ", ".join(names)
    if tokens_per_second:
        decoded = 2 * config.eval_count * config.recipe.eval_max_new_tokens * (1 + len(config.eval_block_sizes)) \
            + config.drafts_prompts * config.drafts_max_new_tokens
        seconds = decoded / tokens_per_second
        took = f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"
        text += f" (evaluation and draft table: roughly {took} more at collection's {tokens_per_second:.0f} tokens/s)"
    return text


def _train_done(config: TrainConfig) -> bool:
    """OUT/model holds a finished run of this very config."""
    out = Path(config.out)
    if not (out / train_run.SUMMARY).is_file() or not (out / train_run.CONFIG).is_file():
        return False
    saved, wanted = json.loads((out / train_run.CONFIG).read_text()), config_to_dict(config)
    if wanted["ar_target"] == "auto" and saved.get("ar_target") in ("labels", "fixed_points"):
        saved["ar_target"] = "auto"  # train wrote what auto resolved to
    if saved.get("batch_size", 0) < wanted["batch_size"]:  # train fitted the batch to fewer records
        saved["batch_size"], saved["micro_batch_size"] = wanted["batch_size"], wanted["micro_batch_size"]
    return one_length(saved) == one_length(wanted)


def _evaluation_stage(config: DistillConfig, plan: EvalPlan, model_dir: Path, skipped: list[str]) -> dict:
    """OUT/evaluation.json (kept when up to date) and its section of the CLLM's model card."""
    path = Path(config.out) / EVALUATION
    evaluation = _evaluation_done(path, config, plan.prompts, model_dir)
    if evaluation is not None:
        skipped.append("evaluate")
    else:
        evaluation = evaluate_distilled(config.model, model_dir, config, plan.prompts)
        path.write_text(json.dumps(evaluation, indent=2) + "\n")
    info = json.loads((model_dir / train_run.SUMMARY).read_text())
    section = (f"\n## Distillation evaluation\n\n`cllm distill`, {evaluation['prompts_evaluated']} held-out "
               f"prompts of `{plan.prompts}`, {config.recipe.eval_max_new_tokens} new tokens, greedy, "
               f"both models in float32.\n\n{evaluation_table(evaluation)}\n")
    (model_dir / train_run.CARD).write_text(cllm_card(info, section))
    return evaluation


def _evaluation_done(path: Path, config: DistillConfig, prompts: str, cllm_dir: Path) -> dict | None:
    if not path.is_file():
        return None
    ev = json.loads(path.read_text())
    if ev.get("settings") != config.eval_settings(prompts) or ev.get("cllm_fingerprint") != fingerprint(cllm_dir):
        return None
    if "quality" not in ev:  # written before the quality measures existed
        return None
    return ev


def _drafts_stage(drafts_config: DraftsConfig, skipped: list[str]) -> None:
    """The CLLM's draft table, unless the one beside it was built from this CLLM with these settings."""
    if drafts_done(drafts_config):
        skipped.append("drafts")
    else:
        log.info("%s", build_draft_table(drafts_config).line())


def evaluate_distilled(target_name: str, cllm_dir: str | Path, config: DistillConfig, prompts: str) -> dict:
    """Target vs CLLM on the held-out `prompts`, both loaded in float32 from disk on the main
    process's device (accelerate's: the GPU the run trained on, else the CPU), greedy.

    quality: `cllm.evaluation.gates.compare_models` on the held-out prompts (parse rates on Python
    sets only, degenerate / looping rates of the greedy completions, the target's NLL of them,
    first divergence from the target's text, plain-Jacobi tokens per forward over all and over
    non-looping completions); gates: its pass/fail lines. The keys kept from before, read off
    it: tokens_per_forward[model][n], cllm_jacobi_equals_greedy[n], greedy_agreement /
    token_agreement (CLLM greedy vs target greedy, per prompt / per token), degenerate[model] /
    looping[model]; and ar_loss[model]: nats/token on the prompts' references.
    """
    recipe = config.recipe
    tokenizer = load_tokenizer(cllm_dir)
    device = PartialState().device
    models = {"target": load_model(target_name, device=device), "cllm": load_model(str(cllm_dir), device=device)}
    pad = pad_token_id(tokenizer)
    settings = QualitySettings(prompt_sets={prompts: config.eval_count}, block_sizes=list(config.eval_block_sizes),
                               max_new_tokens=recipe.eval_max_new_tokens, batch_size=recipe.eval_batch_size,
                               seed=recipe.seed, val_loss=False, spread=[])
    quality = compare_models(models, tokenizer, settings, pad_id=pad)
    per_model = quality["sets"][prompts]
    encoded = heldout_prompts(prompts, tokenizer, count=config.eval_count, max_new_tokens=recipe.eval_max_new_tokens,
                              context=position_limit(models["cllm"]))
    cllm = per_model["cllm"]
    return {
        "settings": config.eval_settings(prompts), "prompts_evaluated": cllm["prompts"],
        "cllm_fingerprint": fingerprint(cllm_dir), "target_fingerprint": fingerprint(target_name),
        "tokens_per_forward": {name: dict(q["tpf"]) for name, q in per_model.items()},
        "cllm_jacobi_equals_greedy": dict(cllm["jacobi_exact"]),
        "ar_loss": {name: reference_loss(m, encoded, batch_size=recipe.eval_batch_size, pad_id=pad)
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
