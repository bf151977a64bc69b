"""`cllm medusa`: train Medusa heads for a model (Medusa-1: the model frozen) and evaluate them.

1. the model's own greedy continuations of a prompt set (or the fixed points of `cllm collect`
   trajectories of this model) are the training text; the last `--holdout` texts are held out;
2. the frozen model's last hidden states on them are computed once;
3. AdamW trains the heads alone on the self-distillation loss (`cllm.modeling.losses.medusa_loss`),
   logging every step to `medusa_log.jsonl` and the held-out loss every `--eval-every` steps;
   a checkpoint is kept there too, and a rerun resumes from it;
4. each head's top-k accuracy on the held-out texts shapes the default candidate tree; heads,
   accuracies and tree are saved (`cllm.modeling.heads`), by default in `MODEL/medusa/`;
5. greedy and Medusa decoding of a few held-out prompts (`--eval-prompts`): exactness, tokens
   per forward, speed, in `evaluation.json`.

An existing heads folder is never overwritten without `--force`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from cllm.core.config import write_config
from cllm.core.errors import UserError
from cllm.decoding.rivals.medusa import DEFAULT_NODES, DEFAULT_TOP_K
from cllm.modeling.heads import CONFIG_FILE, WEIGHTS_FILE

TRAIN_CONFIG = "medusa_train_config.json"
LOG = "medusa_log.jsonl"
CHECKPOINT = "checkpoint.pt"
TEXTS = "texts.jsonl"  # the training texts while a run is unfinished (a resume reuses them)
EVALUATION = "evaluation.json"
OURS = {CONFIG_FILE, WEIGHTS_FILE, TRAIN_CONFIG, LOG, CHECKPOINT, TEXTS, EVALUATION}
# options that may change between a checkpoint and its resumption
RESUME_FREE = {"eval_prompts", "eval_count", "eval_max_new_tokens", "tree_nodes", "top_k", "threads", "device",
               "force", "resume", "out", "decode_batch_size"}


@dataclass
class MedusaConfig:
    model: str = field(default="stdlib-coder", metadata={"help": "the model the heads are for (shipped name or local "
        "checkpoint dir); it stays frozen"})
    heads: int = field(default=4, metadata={"help": "number of heads K: head k guesses the token k + 1 positions "
        "ahead"})
    own_projection: bool = field(default=False, metadata={"help": "give each head its own vocabulary projection (a "
        "trained copy of the LM head, V x H parameters each) instead of sharing the model's frozen LM head"})
    prompts: str = field(default="stdlib-train", metadata={"help": "prompts whose greedy continuations are the "
        "training text: stdlib-train, stdlib-val, humaneval, or a JSONL/Parquet file (not the prompts you benchmark "
        "on)"})
    max_prompts: int | None = field(default=512, metadata={"help": "use the first N prompts of the set"})
    data: str | None = field(default=None, metadata={"help": "train on the fixed points of this `cllm collect` "
        "directory (collected with this model) instead of decoding --prompts"})
    max_new_tokens: int = field(default=128, metadata={"help": "greedy tokens decoded per training prompt"})
    decode_batch_size: int = field(default=16, metadata={"help": "prompts per forward when decoding the training text"})
    holdout: int = field(default=16, metadata={"help": "the last N texts are not trained on: held-out loss and the "
        "accuracies that shape the tree"})
    steps: int = field(default=300, metadata={"help": "optimizer steps"})
    batch_size: int = field(default=8, metadata={"help": "texts per step (every position of each counts)"})
    lr: float = field(default=3e-3, metadata={"help": "peak learning rate (AdamW), linear warm-up then cosine decay to "
        "0 (3e-3 beat 1e-3 on stdlib-coder: held-out head-1 agreement 0.48 vs 0.38 after 300 steps)"})
    warmup: int = field(default=20, metadata={"help": "warm-up steps"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    loss: Literal["soft", "hard"] = field(default="soft", metadata={"help": "soft: KL to the model's own distribution "
        "k positions on (Medusa's self-distillation); hard: cross-entropy on its greedy token there"})
    head_decay: float = field(default=0.8, metadata={"help": "head k's loss weight is this to the power k - 1 (Medusa: "
        "0.8)"})
    top_k: int = field(default=DEFAULT_TOP_K, metadata={"help": "ranks per head measured and considered for the "
        "candidate tree"})
    tree_nodes: int = field(default=DEFAULT_NODES, metadata={"help": "candidate tree nodes verified per forward "
        "besides the root: the saved default tree (each fed token costs on a CPU; a GPU affords 60+)"})
    eval_prompts: str = field(default="humaneval", metadata={"help": "held-out prompts of the final evaluation (greedy "
        "vs Medusa, batch 1)"})
    eval_count: int = field(default=8, metadata={"help": "evaluate on the first N of them (0: no evaluation)"})
    eval_max_new_tokens: int = field(default=128, metadata={"help": "new tokens per evaluation prompt"})
    eval_every: int = field(default=50, metadata={"help": "held-out loss and a checkpoint every N steps"})
    out: str | None = field(default=None, metadata={"help": "heads folder (default: MODEL/medusa, found there by "
        "load_heads)"})
    force: bool = field(default=False, metadata={"help": "replace heads already in --out (a finished run); an "
        "unfinished run resumes without it"})
    resume: bool = field(default=True, metadata={"help": "continue an unfinished run in --out from its checkpoint; "
        "false starts over"})
    seed: int = field(default=0, metadata={"help": "seed of the batch order"})
    dtype: str = field(default="float32", metadata={"help": "model (and heads) dtype"})
    device: str = field(default="cpu", metadata={"help": "torch device"})
    threads: int = field(default=0, metadata={"help": "torch CPU threads (0: torch's default)"})

    def __post_init__(self) -> None:
        for name in ("heads", "max_new_tokens", "decode_batch_size", "holdout", "steps", "batch_size", "top_k",
                     "eval_max_new_tokens", "eval_every"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be an int >= 1, got {getattr(self, name)!r}")
        for name in ("warmup", "tree_nodes", "eval_count", "threads"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise UserError(f"--{name.replace('_', '-')} must be an int >= 0, got {getattr(self, name)!r}")
        if self.max_prompts is not None and self.max_prompts < 1:
            raise UserError(f"--max-prompts must be >= 1, got {self.max_prompts}")
        if self.max_prompts is not None and self.max_prompts <= self.holdout:
            raise UserError(f"--holdout {self.holdout} leaves no prompt of --max-prompts {self.max_prompts} "
                            "to train on")
        if not self.lr > 0:
            raise UserError(f"--lr must be > 0, got {self.lr}")
        if not 0 < self.head_decay <= 1:
            raise UserError(f"--head-decay must be in (0, 1], got {self.head_decay}")
        if self.weight_decay < 0:
            raise UserError(f"--weight-decay must be >= 0, got {self.weight_decay}")


def check_out_dir(out: Path, model_dir: Path, config: MedusaConfig) -> None:
    """Refuse (touching nothing) a file, the model's own folder, a folder holding anything this
    command did not write, and finished heads without --force."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a directory")
    if model_dir.is_dir() and out.exists() and out.resolve() == model_dir.resolve():
        raise UserError(f"--out {out} is the --model directory; the heads go in a folder of their own")
    if not out.is_dir():
        return
    foreign = sorted(p.name for p in out.iterdir() if p.name not in OURS and not p.name.startswith("."))
    if foreign:
        raise UserError(f"--out {out} holds files cllm medusa did not write ({', '.join(foreign[:3])}); use another "
                        "folder")
    if (out / WEIGHTS_FILE).exists() and not config.force:
        raise UserError(f"{out} already holds Medusa heads; --force replaces them")


def medusa(config: MedusaConfig) -> int:
    from tqdm.auto import tqdm

    from cllm.core import __version__
    from cllm.core.runs import append_jsonl, check_same_run, save_checkpoint, sigint_flag, truncate_log
    from cllm.data.prompts import encode_prompts
    from cllm.decoding.inputs import position_limit
    from cllm.decoding.rivals.medusa import build_tree
    from cllm.modeling.heads import MedusaHeads, base_model_meta, save_heads
    from cllm.models import (
        load_model,
        load_tokenizer,
        pad_token_id,
        resolve_model_path,
        tokenizer_fingerprint,
    )
    from cllm.training.heads import HeadsTrainer, evaluate_heads, hidden_states, measure_accuracies

    started = time.perf_counter()
    # 1. where the heads go, and whether an unfinished run is there to resume
    model_dir = Path(resolve_model_path(config.model))
    if not model_dir.is_dir() and config.out is None:
        raise UserError(f"{config.model!r} is not a local checkpoint: give --out for the heads")
    out = Path(config.out) if config.out else model_dir / "medusa"
    config.out = str(out)
    check_out_dir(out, model_dir, config)
    saved = out / CHECKPOINT
    resuming = config.resume and not config.force and saved.exists() and (out / TRAIN_CONFIG).exists()
    if resuming:
        check_same_run(json.loads((out / TRAIN_CONFIG).read_text()), config, free=RESUME_FREE)
    else:
        for name in OURS:
            (out / name).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    write_config(config, out / TRAIN_CONFIG)
    if config.threads:
        torch.set_num_threads(config.threads)
    tokenizer = load_tokenizer(config.model)
    model = load_model(config.model, dtype=config.dtype, device=config.device).requires_grad_(False)
    eos, pad = tokenizer.eos_token_id, pad_token_id(tokenizer)
    limit = position_limit(model)

    # 2. the model's own greedy text (decoded once; a resumed run reads it back)
    texts = _texts(config, model, tokenizer, out / TEXTS)
    if len(texts) <= config.holdout:
        raise UserError(f"{len(texts)} texts leave none to train on after --holdout {config.holdout}")
    train_texts, held_texts = texts[: -config.holdout], texts[-config.holdout :]
    with tqdm(total=len(texts), unit="text", desc="medusa: hidden states") as bar:
        train_states = hidden_states(model, train_texts, pad_id=pad, eos_token_id=eos, progress=bar.update)
        held_states = hidden_states(model, held_texts, pad_id=pad, eos_token_id=eos, progress=bar.update)

    # 3. train the heads alone; log, hold-out loss and checkpoint every --eval-every steps
    heads = MedusaHeads.for_model(model, num_heads=config.heads, own_projection=config.own_projection)
    trainer = HeadsTrainer(heads, train_states, steps=config.steps, batch_size=config.batch_size, lr=config.lr,
                           weight_decay=config.weight_decay, warmup=config.warmup,
                           distance="fkl" if config.loss == "soft" else "argmax", head_decay=config.head_decay,
                           seed=config.seed)
    log_path = out / LOG
    before = None
    if resuming:
        state = torch.load(saved, map_location="cpu", weights_only=False)
        trainer.load_state_dict(state["trainer"])
        before, elapsed = state["before"], state["elapsed_s"]
        truncate_log(log_path, trainer.step_index)
        print(f"cllm medusa: resuming {out} at step {trainer.step_index} of {config.steps}")
    else:
        before, elapsed = trainer.evaluate(held_states), 0.0
        append_jsonl(log_path, {"step": 0, "holdout": before})

    def checkpoint() -> None:
        save_checkpoint(saved, {"trainer": trainer.state_dict(), "before": before,
                                "elapsed_s": elapsed + time.perf_counter() - began})

    began = time.perf_counter()
    with sigint_flag() as interrupted, tqdm(total=config.steps, initial=trainer.step_index, unit="step",
                                            desc="medusa: training") as bar:
        while trainer.step_index < config.steps:
            record = trainer.step()
            if trainer.step_index % config.eval_every == 0 or trainer.step_index == config.steps:
                record["holdout"] = trainer.evaluate(held_states)
                checkpoint()
            append_jsonl(log_path, record)
            bar.set_postfix(loss=f"{record['loss']:.3f}", head1=f"{record['agreement'][0]:.2f}")
            bar.update(1)
            if interrupted["set"]:
                checkpoint()
                print(f"\ncllm medusa: stopped at step {trainer.step_index}; rerun the same command to resume")
                return 130
    train_seconds = elapsed + time.perf_counter() - began
    after = trainer.evaluate(held_states)

    # 4. accuracies on the held-out texts shape the default tree; save heads + record
    heads.eval()
    heads.accuracies = measure_accuracies(heads, held_states, top_k=config.top_k)
    heads.tree = [list(p) for p in build_tree(heads.accuracies, config.tree_nodes, config.top_k)]
    heads.meta = {"model": config.model, **base_model_meta(model, model_dir if model_dir.is_dir() else None),
                  "tokenizer_fingerprint": tokenizer_fingerprint(config.model), "dtype": config.dtype,
                  "training": {"texts": len(train_texts), "holdout_texts": len(held_texts),
                               "positions": sum(s.shape[0] for s in train_states), "steps": config.steps,
                               "loss": config.loss, "seconds": round(train_seconds, 1),
                               "holdout_before": before, "holdout_after": after},
                  "cllm_version": __version__}
    save_heads(heads, out)
    for name in (CHECKPOINT, TEXTS):
        (out / name).unlink(missing_ok=True)

    # 5. greedy vs Medusa on held-out prompts
    evaluation = None
    if config.eval_count:
        new = min(config.eval_max_new_tokens, limit // 2) if limit else config.eval_max_new_tokens
        prompts = encode_prompts(config.eval_prompts, tokenizer, limit=config.eval_count,
                                 keep=limit - new if limit else None)
        with tqdm(total=len(prompts), unit="prompt", desc="medusa: evaluation") as bar:
            evaluation = evaluate_heads(model, heads, [p.ids for p in prompts], max_new_tokens=new,
                                        eos_token_id=eos, progress=bar.update)
        evaluation.update(prompt_set=config.eval_prompts, max_new_tokens=new, threads=torch.get_num_threads(),
                          device=config.device,
                          dtype=config.dtype, tree_nodes=len(heads.tree))
        (out / EVALUATION).write_text(json.dumps(evaluation, indent=2) + "\n")
    _print_summary(heads, before, after, evaluation, out, time.perf_counter() - started)
    return 0 if evaluation is None or not evaluation["mismatches"] else 1


def _texts(config: MedusaConfig, model, tokenizer, path: Path):
    """The training texts: read back from an unfinished run, else decoded (or read from the
    trajectories) and written to `path` until the run finishes."""
    from tqdm.auto import tqdm

    from cllm.data.prompts import encode_prompts
    from cllm.decoding.inputs import position_limit
    from cllm.models import pad_token_id
    from cllm.training.heads import Text, greedy_texts

    if path.exists():
        return [Text(**json.loads(line)) for line in path.read_text().splitlines() if line]
    if config.data:
        texts = _trajectory_texts(config)
    else:
        limit, new = position_limit(model), config.max_new_tokens
        if limit:
            new = min(new, limit // 2)  # leave half the context to the prompt
        prompts = encode_prompts(config.prompts, tokenizer, limit=config.max_prompts,
                                 keep=limit - new if limit else None)
        with tqdm(total=len(prompts), unit="prompt", desc="medusa: greedy text") as bar:
            texts = greedy_texts(model, [p.ids for p in prompts], max_new_tokens=new,
                                 batch_size=config.decode_batch_size,
                                 eos_token_id=tokenizer.eos_token_id, pad_id=pad_token_id(tokenizer),
                                 progress=bar.update)
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_text("".join(json.dumps({"prompt": t.prompt, "completion": t.completion}) + "\n" for t in texts))
    tmp.replace(path)
    return texts


def _trajectory_texts(config: MedusaConfig):
    from cllm.data.trajectories import read_meta, read_records
    from cllm.models import fingerprint
    from cllm.training.heads import texts_from_trajectories

    meta = read_meta(config.data)
    if meta.model_fingerprint != fingerprint(config.model):
        raise UserError(f"the trajectories in {config.data} were collected with another model ({meta.model}): "
                        "their fixed points are not this model's greedy text")
    texts = texts_from_trajectories(read_records(config.data))
    return texts[: config.max_prompts] if config.max_prompts else texts


def _print_summary(heads, before: dict, after: dict, evaluation: dict | None, out: Path, seconds: float) -> None:
    agree = " ".join(f"{a:.2f}" for a in after["agreement"])
    was = " ".join(f"{a:.2f}" for a in before["agreement"])
    print(f"cllm medusa: {heads.num_heads} heads, {heads.parameters_added():,} parameters added"
          f"{' (own projections)' if heads.own_projection else ' (sharing the LM head)'}")
    print(f"  held-out loss {before['loss']:.3f} -> {after['loss']:.3f}; top-1 agreement per head {was} -> {agree}")
    if evaluation:
        speed = evaluation["speedup_vs_greedy"]
        print(f"  {evaluation['prompt_set']} x {evaluation['prompts']}: "
              f"{evaluation['tokens_per_forward']:.2f} tokens per "
              f"forward with a {evaluation['tree_nodes']}-node tree, {speed:.2f}x greedy's speed at "
              f"{evaluation['threads']} threads; exact {evaluation['exact']}/{evaluation['prompts']}")
        if evaluation["mismatches"]:
            print(f"  NOT EXACT: {evaluation['mismatches']}")
    print(f"  -> {out} ({seconds:.0f} s)")
