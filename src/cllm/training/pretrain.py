"""cllm pretrain: train the embedded target model from scratch on the stdlib corpus.

A small `LlamaForCausalLM` (tied embeddings) learns next-token prediction on the Python standard
library (`cllm.data.corpus`, train split) with its own byte-level BPE tokenizer
(`cllm.data.tokenizer`). Documents are joined with `<|endoftext|>` into one token stream and
each step reads `batch_size` random windows of `context + 1` tokens from it, drawn by a seeded
generator whose state is checkpointed: rerunning the same command continues from the last
checkpoint and reproduces the loss curve of an uninterrupted run exactly.

Everything lands in `--out`: the HF checkpoint (safetensors, config, generation config), the
tokenizer, `pretrain_config.json` (resolved config), `pretrain_log.jsonl` (one record per step,
validation records at each eval), `pretrain_summary.json` (corpus hash, time, losses) and the
trainer state in `checkpoints/last.pt` (not meant to be shipped).

`pretrain` runs as named steps (`_open_run`, then `Pretrainer` on the training skeleton
(`cllm.training.skeleton`), `_finish`). `evaluate_target`
measures a finished model (`cllm.evaluation`: greedy completions, text measures, validation
loss) and `write_model_card` writes its MODEL_CARD.md (`cllm.training.cards.target_card`).
"""

from __future__ import annotations

import json
import logging
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from cllm.core.config import config_to_dict, write_config
from cllm.core.errors import UserError
from cllm.core.machine import resolve_device
from cllm.core.outputs import check_folder, claim_folder, share_like_siblings
from cllm.core.progress import progress_bar
from cllm.core.runs import check_same_run, load_checkpoint
from cllm.data.corpus import Corpus, load_corpus
from cllm.data.tokenizer import (
    EOT,
    save_tokenizer,
    token_stream,
    tokenizer_sha256,
    train_tokenizer,
)
from cllm.decoding.inputs import position_limit
from cllm.evaluation.heldout import decode_prompts, heldout_prompts
from cllm.evaluation.lm_loss import text_loss, validation_loss
from cllm.evaluation.text import cut_at_function_end, ends_in_loop, function_parses, is_degenerate, strip_eos
from cllm.modeling.forwards import window_loss
from cllm.models import load_model, load_tokenizer
from cllm.training.cards import target_card
from cllm.training.config import PretrainConfig
from cllm.training.schedule import warmup_cosine
from cllm.training.skeleton import Plan, Trainer, descend

logger = logging.getLogger(__name__)

CHECKPOINT = "checkpoints/last.pt"
LOG = "pretrain_log.jsonl"
SUMMARY = "pretrain_summary.json"
CONFIG = "pretrain_config.json"
# Fields that may change between a run and its resumption without changing the result.
_RESUME_FREE = {"resume", "threads", "device", "eval_interval", "eval_batches", "checkpoint_interval"}


# ---------------------------------------------------------------------------------- data


def sample_windows(stream: torch.Tensor, batch_size: int, context: int, generator: torch.Generator) -> torch.Tensor:
    """(B, context + 1) random windows; the generator's state is the whole sampler state."""
    starts = torch.randint(0, len(stream) - context, (batch_size,), generator=generator)
    return stream[starts[:, None] + torch.arange(context + 1)]


def eval_windows(stream: torch.Tensor, n: int, context: int) -> torch.Tensor:
    """(n, context + 1) evenly spaced windows: the same validation set at every eval."""
    starts = torch.linspace(0, len(stream) - context - 1, n).long()
    return stream[starts[:, None] + torch.arange(context + 1)]


# ---------------------------------------------------------------------------------- model


def build_model(config: PretrainConfig, eot_id: int):
    model_config = LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.width,
        intermediate_size=config.mlp_width,
        num_hidden_layers=config.layers,
        num_attention_heads=config.heads,
        num_key_value_heads=config.heads,
        max_position_embeddings=config.context,
        tie_word_embeddings=True,
        bos_token_id=eot_id,
        eos_token_id=eot_id,
        pad_token_id=eot_id,
    )
    torch.manual_seed(config.seed)
    model = LlamaForCausalLM(model_config)
    model.generation_config = GenerationConfig(
        bos_token_id=eot_id, eos_token_id=eot_id, pad_token_id=eot_id, do_sample=False
    )
    return model


def build_optimizer(model, config: PretrainConfig):
    # Decay matrices only: norms (1-D) are left alone, as in nanoGPT.
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), eps=1e-8)
    scheduler = warmup_cosine(optimizer, config.steps, config.warmup_steps, floor=config.min_lr / config.lr)
    return optimizer, scheduler


# ---------------------------------------------------------------------------------- main


class Pretrainer(Trainer):
    """A pretraining run on the skeleton: next-token loss on random windows of the corpus, the
    validation loss as its evaluation; the checkpoint holds model, optimizer, schedule, the
    window sampler's state and torch's RNG."""

    def __init__(self, config: PretrainConfig, out: Path, train_corpus: Corpus, val_corpus: Corpus,
                 tokenizer: PreTrainedTokenizerBase, train_ids: torch.Tensor, val_ids: torch.Tensor) -> None:
        self.config, self.out = config, out
        self.train_corpus, self.val_corpus, self.tokenizer = train_corpus, val_corpus, tokenizer
        self.train_ids, self.val_ids = train_ids, val_ids  # the token streams
        self.plan = Plan(log=out / LOG, checkpoint=out / CHECKPOINT, total=config.steps,
                         eval_every=config.eval_interval, checkpoint_every=config.checkpoint_interval, desc="pretrain")
        self.model = build_model(config, tokenizer.convert_tokens_to_ids(EOT)).to(resolve_device(config.device))
        self.optimizer, self.scheduler = build_optimizer(self.model, config)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.val_windows = eval_windows(val_ids, config.eval_batches * config.batch_size, config.context)
        self.val_loss: float | None = None

    def train_step(self) -> dict:
        config = self.config
        started = time.perf_counter()
        self.model.train()
        windows = sample_windows(self.train_ids, config.batch_size, config.context, self.generator)
        lr = self.scheduler.get_last_lr()[0]
        loss = window_loss(self.model, windows.to(self.model.device), config.bf16)
        descend(loss, self.optimizer, self.scheduler, clip=config.grad_clip, params=self.model.parameters())
        tokens = config.batch_size * config.context
        return {"loss": loss.item(), "lr": lr, "tokens_per_s": round(tokens / (time.perf_counter() - started), 1)}

    def evaluate(self) -> dict:
        if self.step == 0:  # no step 0: a random model's validation loss is about log(vocabulary)
            return {}
        config = self.config
        self.val_loss = text_loss(self.model, self.val_windows, batch_size=config.batch_size, bf16=config.bf16)
        return {"val_loss": self.val_loss}

    def postfix(self, record: dict) -> dict[str, str]:
        return {"loss": f"{record['loss']:.3f}", "val": f"{self.val_loss:.3f}" if self.val_loss else "-",
                "tok_s": f"{record['tokens_per_s']:.0f}"}

    def state_dict(self) -> dict:
        return {"val_loss": self.val_loss, "config": config_to_dict(self.config), "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "sampler": self.generator.get_state(), "torch_rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.generator.set_state(state["sampler"])
        torch.set_rng_state(state["torch_rng"])
        self.val_loss = state.get("val_loss")


def pretrain(config: PretrainConfig) -> Path:
    """Train (or resume) and export; returns the output directory.

    Args:
        config: a validated `PretrainConfig`. Rerunning with the same config resumes from the
            last checkpoint; Ctrl-C saves one before stopping (KeyboardInterrupt).
    """
    run, saved = _open_run(config)  # 1. the checkpoint to resume, corpus, tokenizer, token streams, model
    run.begin(saved)  # 2. restored when resuming
    if saved is not None:
        logger.info("resuming %s from step %d", run.out, run.step)
    if not run.fit():  # 3. the steps, logged; evaluations and checkpoints on their intervals
        raise KeyboardInterrupt(f"stopped at step {run.step}; run the same command again to resume")
    return _finish(run)  # 4. the HF checkpoint and the record of how it was made


def _open_run(config: PretrainConfig) -> tuple[Pretrainer, dict | None]:
    """The checkpoint to resume (checked against the config), or a clean start; then the data,
    the model, AdamW and its schedule, the window sampler."""
    out = check_folder(config.out, "pretrain")
    resolve_device(config.device)  # a --device this machine lacks is refused before anything is written
    ckpt_path, log_path = out / CHECKPOINT, out / LOG
    torch.set_num_threads(config.threads)
    saved = None
    if config.resume and ckpt_path.exists():
        saved = load_checkpoint(ckpt_path)
        check_same_run(saved["config"], config, free=_RESUME_FREE)
    elif ckpt_path.exists():
        ckpt_path.unlink()
    if saved is None:
        log_path.unlink(missing_ok=True)
    claim_folder(out, "pretrain")
    run = Pretrainer(config, out, *_prepare(config, out, saved is not None))
    write_config(config, out / CONFIG)
    return run, saved


def _prepare(config: PretrainConfig, out: Path, resuming: bool):
    """Corpus, tokenizer (trained once, then reloaded), token streams."""
    train_corpus = load_corpus("train", max_files=config.max_files)
    val_corpus = load_corpus("validation", max_files=config.max_files)
    if resuming:
        tokenizer = AutoTokenizer.from_pretrained(out)
    elif config.tokenizer is not None:
        tokenizer = load_tokenizer(config.tokenizer)
        if len(tokenizer) != config.vocab_size or tokenizer.convert_tokens_to_ids(EOT) is None:
            raise UserError(f"{config.tokenizer}: its tokenizer has {len(tokenizer)} tokens, not --vocab-size "
                            f"{config.vocab_size} with {EOT}")
        save_tokenizer(tokenizer, out)
    else:
        tokenizer = train_tokenizer((d.text for d in train_corpus.documents), vocab_size=config.vocab_size)
        save_tokenizer(tokenizer, out)
    train_ids = token_stream(train_corpus, tokenizer)
    val_ids = token_stream(val_corpus, tokenizer)
    if min(len(train_ids), len(val_ids)) <= config.context + 1:
        raise UserError(f"corpus too small for context {config.context}: use more files or a shorter context")
    return train_corpus, val_corpus, tokenizer, train_ids, val_ids


def _finish(run: Pretrainer) -> Path:
    """Export the HF checkpoint and write pretrain_summary.json."""
    config, out = run.config, run.out
    export(run.model, run.tokenizer, config, out)
    summary = {
        "corpus": {"train": run.train_corpus.describe(), "validation": run.val_corpus.describe()},
        "tokenizer_sha256": tokenizer_sha256(run.tokenizer),
        "parameters": sum(p.numel() for p in run.model.parameters()),
        "steps": run.step,
        "tokens_seen": run.step * config.batch_size * config.context,
        "train_tokens": len(run.train_ids),
        "validation_tokens": len(run.val_ids),
        "train_time_s": round(run.elapsed, 1),
        "final_train_loss": _last_train_loss(run.plan.log),
        "final_val_loss": run.val_loss,
        "val_loss_definition": f"mean nats/token over {len(run.val_windows)} evenly spaced validation windows",
        "machine": {"platform": platform.platform(), "threads": config.threads, "torch": torch.__version__},
    }
    (out / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
    return out


def _last_train_loss(log_path: Path) -> float | None:
    lines = log_path.read_text().splitlines() if log_path.exists() else []
    return json.loads(lines[-1])["loss"] if lines else None


def export(model, tokenizer, config: PretrainConfig, out: Path) -> None:
    dtype = torch.bfloat16 if config.save_dtype == "bfloat16" else torch.float32
    model.to(dtype).save_pretrained(out, safe_serialization=True)
    model.to(torch.float32)
    save_tokenizer(tokenizer, out)
    share_like_siblings(out)


# ---------------------------------------------------------------------------------- model card


@dataclass
class TargetEvaluation:
    """What MODEL_CARD.md reports about a pretrained target."""

    val_loss: float  # nats/token over the whole stdlib validation split
    val_tokens: int
    n_prompts: int  # stdlib-val prompts completed greedily
    max_new_tokens: int
    parse_rate: float  # completions whose function parses with `ast` once cut at its end
    degenerate_rate: float  # completions repeating one token DEGENERATE_RUN+ times in a row
    looping_rate: float  # completions ending in a loop: a pattern of <= 8 tokens repeated over 24+ tokens
    corpus_sha256: str  # of the validation split
    parameters: int
    samples: list[dict]  # {"id", "prompt", "completion"}: completion cut at the function end


def evaluate_target(
    model_dir: str | Path,
    *,
    n_prompts: int = 100,
    max_new_tokens: int = 128,
    n_samples: int = 4,
    threads: int | None = None,
) -> TargetEvaluation:
    """Validation loss and greedy-completion quality of a pretrained target, float32.

    Args:
        model_dir: an HF checkpoint directory with its tokenizer.
        n_prompts: stdlib-val prompts, evenly spaced over the set, completed greedily
            (`cllm.evaluation.heldout.decode_prompts`, one prompt at a time).
        max_new_tokens: completion budget per prompt.
        n_samples: how many completions to keep as samples.
        threads: torch CPU threads (default: leave as is).
    """
    if threads:
        torch.set_num_threads(threads)
    model = load_model(model_dir, dtype=torch.float32)  # eval mode, CPU
    tokenizer = load_tokenizer(model_dir)
    eot = tokenizer.convert_tokens_to_ids(EOT)

    # 1. validation loss over the whole split, in windows of the model's context
    val_loss, val_tokens = validation_loss(model, tokenizer)

    # 2. greedy completions of evenly spaced stdlib-val prompts, one at a time (no padding)
    prompts = heldout_prompts("stdlib-val", tokenizer, count=n_prompts, max_new_tokens=max_new_tokens,
                              context=position_limit(model), spread=True)
    parsed = degenerate = looping = 0
    samples = []
    for prompt in progress_bar(iterable=prompts, desc="completions", unit="prompt"):
        decoded = decode_prompts(model, [prompt], method="greedy", max_new_tokens=max_new_tokens, eos_token_id=eot,
                                 pad_id=eot)
        new, finished = strip_eos(decoded.new_tokens[0], eot)
        completion = tokenizer.decode(new)
        parsed += function_parses(prompt.text, completion, finished=finished)
        degenerate += is_degenerate(new)
        looping += ends_in_loop(new)
        if len(samples) < n_samples:  # shown whole, unfinished last line included
            cut = cut_at_function_end(prompt.text, completion, finished=True)
            samples.append({"id": prompt.id, "prompt": prompt.text, "completion": cut[len(prompt.text):]})
    return TargetEvaluation(
        val_loss=val_loss, val_tokens=val_tokens, n_prompts=len(prompts), max_new_tokens=max_new_tokens,
        parse_rate=parsed / len(prompts), degenerate_rate=degenerate / len(prompts),
        looping_rate=looping / len(prompts),
        corpus_sha256=load_corpus("validation").fingerprint, samples=samples,
        parameters=sum(p.numel() for p in model.parameters()),
    )


TARGET_ROLE = ("It is the embedded *target* of the cllm toolkit: small enough to Jacobi-decode and "
               "consistency-train on a CPU.")


def write_model_card(model_dir: str | Path, evaluation: TargetEvaluation | None = None, *, name: str = "stdlib-coder",
                     role: str = TARGET_ROLE, **evaluate_kwargs) -> Path:
    """Write MODEL_CARD.md (`cllm.training.cards.target_card`) and evaluation.json into a
    pretrained model directory. `role`: the sentence that says what the model is for (the
    embedded target, a draft model, ...)."""
    model_dir = Path(model_dir)
    evaluation = evaluation or evaluate_target(model_dir, **evaluate_kwargs)
    record = asdict(evaluation)
    (model_dir / "evaluation.json").write_text(json.dumps(record, indent=2) + "\n")
    card = target_card(name=name, role=role, evaluation=record,
                       architecture=json.loads((model_dir / "config.json").read_text()),
                       config=_read_json(model_dir / CONFIG), summary=_read_json(model_dir / SUMMARY),
                       reproduce=f"cllm pretrain --config {model_dir / CONFIG} --out runs/{name}")
    path = model_dir / "MODEL_CARD.md"
    path.write_text(card)
    return path


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}
