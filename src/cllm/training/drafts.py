"""A model's draft table (`cllm drafts`, and `cllm distill` for its CLLM), from its own greedy
completions.

Decodes a prompt set greedily (batched, left-padded) and counts which token the model wrote
after each context of 4, 3 and 2 tokens (`cllm.decoding.draft_table`). The table is saved beside the
checkpoint, in `drafts/ngram.safetensors` (a subfolder, so the checkpoint's own files and
fingerprint do not change), where `generate`, `chat`, `serve` and `bench` find it
(`--draft-table auto`). Jacobi decoding then starts blocks from the table's guesses and
verifies its continuation as one more recycled draft: faster, and exactly as greedy as before.

Build it from prompts like the ones you will serve (never from the benchmark's own prompts).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from cllm.core import __version__
from cllm.core.config import config_to_dict, write_config
from cllm.core.errors import UserError
from cllm.core.outputs import Input, check_distinct, check_new_file, check_not_input
from cllm.core.progress import progress_bar
from cllm.data.prompts import encode_prompts, load_prompts
from cllm.decoding.autoregressive import greedy_completions
from cllm.decoding.draft_table import ORDERS, DraftTable
from cllm.decoding.inputs import position_limit
from cllm.models import (
    DRAFT_TABLE,
    fingerprint,
    load_model,
    load_tokenizer,
    pad_token_id,
    resolve_model_path,
    tokenizer_fingerprint,
)
from cllm.training.config import DraftsConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftsSummary:
    """What `build_draft_table` built."""

    path: Path  # the table file
    contexts: int
    new_tokens: int  # greedy tokens it was counted from
    prompts: int
    seconds: float

    def line(self) -> str:
        return (f"cllm drafts: {self.contexts:,} contexts from {self.new_tokens:,} greedy tokens of {self.prompts} "
                f"prompts ({self.seconds:.0f} s) -> {self.path}")


def table_path(config: DraftsConfig) -> Path:
    """Where the table goes: --out, or beside the model's checkpoint (a local one)."""
    path = Path(resolve_model_path(config.model))
    if not path.is_dir() and config.out is None:
        raise UserError(f"{config.model!r} is not a local checkpoint: give --out for the table")
    return Path(config.out) if config.out else path / DRAFT_TABLE


def check_inputs(config: DraftsConfig) -> None:
    """The model (a local checkpoint, or --out given), the prompt set and where the table goes,
    before any model loads: an existing table is replaced only with --force, and never a file
    that is not a draft table, nor any input (`cllm.core.outputs.check_not_input`)."""
    out = table_path(config)
    load_prompts(config.prompts, limit=config.max_prompts)
    inputs = [Input("--model", resolve_model_path(config.model), owned=(DRAFT_TABLE.parent,)),
              Input("--prompts", config.prompts)]
    sidecar = out.with_suffix(".config.json")
    check_distinct([("--out", out), ("the table's config", sidecar)])
    check_new_file(out, force=config.force, what="draft table", inputs=inputs)
    if out.exists() and not _is_draft_table(out):
        raise UserError(f"--out {out} is not a draft table: refusing to replace it, even with --force")
    check_not_input(sidecar, inputs, flag="the table's config")
    if sidecar.is_dir() or (sidecar.exists() and not out.exists()):
        raise UserError(f"{sidecar} exists where the table's config goes: move it, or choose another --out")


def _is_draft_table(path: Path) -> bool:
    try:
        DraftTable.read_meta(path)
    except Exception:  # noqa: BLE001 - any file the table reader refuses is not a table
        return False
    return True


def build_draft_table(config: DraftsConfig) -> DraftsSummary:
    """Decode `config.prompts` greedily with `config.model` (batched, left-padded), count what it
    wrote after each context of 4, 3 and 2 tokens, and save the table (with its config beside
    it, `<table>.config.json`)."""
    check_inputs(config)
    out = table_path(config)
    if config.threads:
        torch.set_num_threads(config.threads)
    tokenizer = load_tokenizer(config.model)
    model = load_model(config.model, dtype=config.dtype, device=config.device)
    limit, new = position_limit(model), config.max_new_tokens
    if limit and new > limit // 2:  # leave half the context to the prompt
        new = limit // 2
        log.warning("cllm drafts: %d new tokens per prompt instead of %d (the model's context is %d tokens)",
                    new, config.max_new_tokens, limit)
    prompts = encode_prompts(config.prompts, tokenizer, limit=config.max_prompts, keep=limit - new if limit else None)
    started = time.perf_counter()
    with progress_bar(total=len(prompts), unit="prompt", desc="drafts: greedy completions") as bar:
        outputs = greedy_completions(model, [p.ids for p in prompts], max_new_tokens=new,
                                     batch_size=config.batch_size, eos_token_id=tokenizer.eos_token_id,
                                     pad_id=pad_token_id(tokenizer), progress=bar.update)
    seconds = time.perf_counter() - started
    # each completion with the prompt's last tokens before it: what the model writes after them
    context = max(ORDERS)
    sequences = [p.ids[-context:] + o for p, o in zip(prompts, outputs, strict=True)]
    meta = {"model": config.model, "model_fingerprint": fingerprint(config.model),
            "tokenizer": tokenizer_fingerprint(config.model), "prompts": config.prompts,
            "num_prompts": len(prompts), "max_new_tokens": new,
            "new_tokens": sum(len(o) for o in outputs), "cllm_version": __version__}
    table = DraftTable.build(sequences, min_count=config.min_count, min_share=config.min_share, meta=meta)
    table.save(out)
    write_config(config, out.with_suffix(".config.json"))
    return DraftsSummary(out, len(table), meta["new_tokens"], len(prompts), seconds)


def drafts_done(config: DraftsConfig) -> bool:
    """The table `config` asks for exists, built from this very model with these settings."""
    table = table_path(config)
    settings = table.with_suffix(".config.json")
    if not table.is_file() or not settings.is_file():
        return False
    same = json.loads(settings.read_text()) == config_to_dict(config)
    return same and DraftTable.read_meta(table).get("model_fingerprint") == fingerprint(config.model)
