"""A model loaded for decoding text, the one way `cllm generate`, `cllm chat` and `cllm serve`
load it: on its runtime (`cllm.runtime`), with its tokenizer (as a `TextCodec`), its draft
table and, when asked, its Medusa heads or its EAGLE head.

The loading itself is `cllm.models`' (checkpoints, tokenizers, draft tables) and
`cllm.models.load_heads`' / `load_eagle`'s (the drafters); this module only puts them together.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers.utils import logging as hf_logging

from cllm.core.config import is_off
from cllm.core.errors import UserError, first_line
from cllm.core.machine import load_average_1min, threads_for_load
from cllm.decoding.draft_table import DraftTable
from cllm.modeling.eagle import EagleHead
from cllm.modeling.heads import MedusaHeads
from cllm.models import (
    load_draft_table,
    load_eagle,
    load_for_decoding,
    load_heads,
    load_model,
    load_tokenizer,
    resolve_model_path,
)
from cllm.models.fast import torch_step_costs
from cllm.models.gguf import is_gguf
from cllm.runtime import Runtime, open_runtime
from cllm.runtime.lean import compiled
from cllm.serving.completion import TextCodec

if TYPE_CHECKING:
    from cllm.serving.options import DecodeOptions

SERVER_STREAMS = 16  # llama.cpp: a KV stream per row, 16 rows at once at most (llama-server's -np 16)


@dataclass
class ServedModel:
    """What decoding text needs: `complete(m.model, m.codec, ids, params, draft_table=m.draft_table,
    heads=m.heads, eagle=m.eagle)`."""

    model: Runtime  # what the decoders run on
    codec: TextCodec  # its tokenizer, behind a lock
    draft_table: DraftTable | None  # `cllm drafts`: faster Jacobi, same output
    heads: MedusaHeads | None  # `cllm medusa`: greedy Medusa decoding instead of the method asked
    not_compiled: str | None = None  # why the runner's forward was not compiled, when asked (`--compile`)
    eagle: EagleHead | None = None  # `cllm eagle`: greedy EAGLE decoding instead of the method asked


def load_served(model: str, *, dtype: str = "float32", device: str = "cpu", threads: int = 0,
                draft_table: str = "auto", medusa: str = "none", eagle: str = "none", compile: bool = False,
                batches: bool = True, runtime: str = "auto", max_rows: int = SERVER_STREAMS) -> ServedModel:
    """Load `model` (a shipped name, a folder or a hub id) for decoding.

    Args:
        threads: torch CPU threads to set (0: leave torch's setting).
        draft_table: "auto" (the one saved beside the checkpoint, if any), "none", or a file.
        medusa: "auto" (the heads in MODEL/medusa, if any), "none", or a heads folder.
        eagle: "auto" (the head in MODEL/eagle, if any), "none", or a head folder.
        compile: compile the lean runtime's forward now (`cllm.runtime.lean.compiled`); where it
            cannot be, `not_compiled` says why and the eager forward decodes.
        batches: with `compile`, compile the graph for batches of two rows or more too (a
            server's); one prompt at a time needs only the one-row graph (less than half the
            time, the first time for a model: later processes load both from the compile cache).
        runtime: "auto", "transformers", "lean" (`cllm.runtime.open_runtime`) or "llamacpp"
            (a GGUF file, or the checkpoint exported once: `cllm.models.load_for_decoding`,
            whose `threads` are llama.cpp's; with `batches`, a KV stream per row for `max_rows`
            rows, `SERVER_STREAMS` at most).
    """
    hf_logging.disable_progress_bar()  # stderr is for our own one-line summaries
    if threads:
        torch.set_num_threads(threads)
    if is_gguf(model) or runtime == "llamacpp":
        if not is_off(medusa) and medusa != "auto":
            raise UserError("--medusa: Medusa heads read hidden states, which the llamacpp runtime does not give")
        if not is_off(eagle) and eagle != "auto":
            raise UserError("--eagle: an EAGLE head reads hidden states, which the llamacpp runtime does not give")
        fast = load_for_decoding(model, dtype=dtype, draft_table=draft_table, runtime=runtime, threads=threads or None,
                                 streams=max(1, min(max_rows, SERVER_STREAMS)) if batches else 0)
        return ServedModel(fast.model, TextCodec(fast.tokenizer), fast.draft_table, None,
                           fast.model.compile() if compile else None)
    tokenizer = load_tokenizer(model)
    table = load_draft_table(model, draft_table)
    loaded = load_model(model, dtype=dtype, device=device)
    heads = load_medusa_heads(model, loaded, medusa)
    head = load_eagle_head(model, loaded, eagle)
    try:
        decoding = open_runtime(loaded, runtime)
    except ValueError as exc:
        raise UserError(f"--runtime {runtime}: {first_line(exc)}") from None
    not_compiled = decoding.compile(batches=batches) if compile else None
    decoding.prepare()
    if not batches:  # one prompt at a time (generate, chat): the adaptive width, as `load_for_decoding` decodes
        torch_step_costs(decoding, model, dtype=dtype, device=device, compiled=bool(compile and not not_compiled))
    return ServedModel(decoding, TextCodec(tokenizer), table, heads, not_compiled, eagle=head)


def load_options(options: DecodeOptions) -> ServedModel:
    """What `cllm generate` / `cllm chat`'s options name, loaded to decode one prompt at a time:
    the model, its tokenizer (as a TextCodec), its draft table, its Medusa heads and its EAGLE
    head (each None when not used)."""
    if options.compile:
        print(f"cllm: --compile: {compiled.where_note()}", file=sys.stderr, flush=True)
    served = load_served(options.model, dtype=options.dtype, device=options.device, threads=options.threads,
                         draft_table=options.draft_table, medusa=options.medusa, eagle=options.eagle,
                         compile=options.compile, batches=False, runtime=options.runtime)  # one prompt at a time
    if served.not_compiled:
        print(f"cllm: note: --compile: {served.not_compiled}; the eager forward decodes", file=sys.stderr)
    return served


def load_medusa_heads(name: str, model: torch.nn.Module, spec: str) -> MedusaHeads | None:
    """The Medusa heads `spec` names for `model` (loaded from `name`), or None: "none"; "auto"
    (those saved in the checkpoint's `medusa/`, if any); or a heads folder, which must hold them."""
    return _load_drafting(name, model, spec, load_heads, "no Medusa heads in {} (cllm medusa writes them)")


def load_eagle_head(name: str, model: torch.nn.Module, spec: str) -> EagleHead | None:
    """The EAGLE head `spec` names for `model` (loaded from `name`), or None: "none"; "auto"
    (the one saved in the checkpoint's `eagle/`, if any); or a head folder, which must hold one."""
    return _load_drafting(name, model, spec, load_eagle, "no EAGLE head in {} (cllm eagle writes it)")


def _load_drafting(name: str, model: torch.nn.Module, spec: str, load, missing: str):
    """What `load(folder, model, model_path=...)` finds as `spec` says ("none", "auto": the
    checkpoint's own if any, or a folder that must hold it: else `missing`, a UserError)."""
    if is_off(spec):
        return None
    path = Path(resolve_model_path(name))
    if spec == "auto":
        return load(path, model) if path.is_dir() else None
    found = load(spec, model, model_path=path if path.is_dir() else None)
    if found is None:
        raise UserError(missing.format(spec))
    return found


def free_cores() -> int:
    """Torch threads for a shared CPU: the cores the 1-minute load average leaves free, at
    least one (the same rule as `cllm bench` and `cllm demo`)."""
    cores = os.cpu_count() or 1
    return threads_for_load(load_average_1min(), cores, wanted=cores)
