"""`load_for_decoding`: a model ready for the fast path on its runtime, with its tokenizer, its
draft table and the decode setting of the CLI (tuned for that device and runtime, when
`cllm tune` measured one)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cllm.core.errors import UserError, first_line
from cllm.decoding import RECOMMENDED
from cllm.models import gguf
from cllm.models.loading import (
    DECODE_DEFAULTS,
    DECODE_DEFAULTS_LLAMACPP,
    fingerprint,
    load_draft_table,
    load_model,
    load_tokenizer,
    resolve_folder,
    resolve_model_path,
    tokenizer_fingerprint,
)
from cllm.runtime import Runtime, open_runtime
from cllm.runtime.gguf import OUT_TYPE_OF_DTYPE
from cllm.runtime.stepcost import cached_costs


@dataclass
class DecodingModel:
    """A model ready for the fast path: `jacobi_decode(m.model, ids, **m.settings)` decodes as
    `cllm generate` does by default (greedy: the same tokens as greedy decoding)."""

    model: Runtime  # what the decoders run on (`cllm.runtime`): `m.model.describe()` says which and why
    tokenizer: Any
    draft_table: Any  # its DraftTable (`cllm drafts`), or None when its folder has none
    settings: dict[str, Any]  # `jacobi_decode` keyword arguments: RECOMMENDED, tuned, + draft_table
    name: str
    module: torch.nn.Module | None = None  # the transformers model the runtime runs
    not_compiled: str | None = None  # why the runtime's forward was not compiled, when asked


def load_for_decoding(
    name_or_path: str | os.PathLike,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    draft_table: str | None = "auto",
    trust_remote_code: bool = False,
    compile: bool = False,
    runtime: str = "auto",
    threads: int | None = None,
    sequences: int | None = None,
    streams: int = 0,
) -> DecodingModel:
    """One call for the fast path: the model (a shipped name, a local folder or a hub id
    `owner/name`) on its runtime, its tokenizer, its draft table and the decode setting of the CLI.

    Args:
        draft_table: "auto" (the table saved beside the checkpoint, if any), "none", or a file.
        compile: compile the lean runtime's forward now (`cllm.runtime.lean.compiled`: float32
            on a CPU with a C++ compiler; minutes the first time for these weights, then loaded
            from the compile cache), for one prompt at a time (a batch of
            prompts decodes on the eager forward); `not_compiled` says why not.
        runtime: "auto" (a GGUF file: llama.cpp; else the lean runtime where it runs the
            model, else transformers'), "transformers", "lean" (`cllm.runtime.open_runtime`) or
            "llamacpp" (a GGUF file, or the checkpoint exported once into the user's cache:
            `cllm.models.gguf`); `model.describe()` says which and why.
        threads: the llama.cpp runtime's threads (None: llama.cpp's default); the torch
            runtimes use torch's.
        sequences: the llama.cpp runtime's sequences, a row's own and one per tree leaf past the
            first (None: its default, for a few rows at a time; a server wants more, 256 at most).
        streams: the llama.cpp runtime's layout (`cllm.runtime.llamacpp`): 0, unified (one
            row's recycled drafts verified as a tree); N, a KV stream per row for N rows at most
            (a row's attention over its own cells only: wide batches cost less; chains, no trees).

    Example:
        fast = load_for_decoding("stdlib-coder-cllm")
        ids = fast.tokenizer("def add(a, b):", return_tensors="pt").input_ids
        out = jacobi_decode(fast.model, ids, max_new_tokens=64,
                            eos_token_id=fast.tokenizer.eos_token_id, **fast.settings)
    """
    if gguf.is_gguf(name_or_path) or runtime == "llamacpp":
        return _load_for_llamacpp(name_or_path, dtype=dtype, draft_table=draft_table, runtime=runtime,
                                  threads=threads, sequences=sequences, streams=streams,
                                  trust_remote_code=trust_remote_code)
    tokenizer = load_tokenizer(name_or_path, trust_remote_code=trust_remote_code)
    table = load_draft_table(name_or_path, draft_table)
    module = load_model(name_or_path, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    try:
        decoding = open_runtime(module, runtime)
    except ValueError as exc:
        raise UserError(f"--runtime {runtime}: {first_line(exc)}") from None
    settings = {**RECOMMENDED, **tuned_defaults(name_or_path, device, runtime=decoding.name), "draft_table": table}
    not_compiled = decoding.compile(batches=False) if compile else None
    decoding.prepare()
    if settings.get("adaptive"):
        torch_step_costs(decoding, name_or_path, dtype=dtype, device=device, compiled=compile and not not_compiled)
    return DecodingModel(decoding, tokenizer, table, settings, str(name_or_path), module, not_compiled)


def tuned_defaults(name_or_path: str | os.PathLike, device: str | torch.device = "cpu", *,
                   runtime: str = "lean") -> dict[str, Any]:
    """The decode settings `cllm tune` wrote beside a local checkpoint for this type of device
    and runtime (block size, fed-token budget), or {} when there are none for it. Settings
    measured on a GPU are not used on a CPU, nor the other way round; those measured on llama.cpp
    (`decode_defaults_llamacpp.json`) only there."""
    name = DECODE_DEFAULTS_LLAMACPP if runtime == "llamacpp" else DECODE_DEFAULTS
    folder = gguf.side_folder(name_or_path) if gguf.is_gguf(name_or_path) else Path(resolve_folder(name_or_path))
    file = folder / name
    if not file.is_file():
        return {}
    try:
        record = json.loads(file.read_text(encoding="utf-8"))
        settings = record["settings"]
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"cannot read {file}: {first_line(exc)} (rerun cllm tune --force)") from None
    if record.get("device") != torch.device(device).type:
        return {}
    if gguf.is_gguf(name_or_path) and "file" in record and record["file"] != file_identity(name_or_path):
        return {}  # `cllm tune` measured another file of that name, or this one before it changed
    if (record.get("runtime") == "llamacpp") != (runtime == "llamacpp"):
        return {}
    return {k: v for k, v in settings.items() if k in RECOMMENDED}


def _load_for_llamacpp(name_or_path: str | os.PathLike, *, dtype: str | torch.dtype, draft_table: str | None,
                       runtime: str, threads: int | None, sequences: int | None, streams: int,
                       trust_remote_code: bool) -> DecodingModel:
    """`load_for_decoding` on the llama.cpp runtime: a GGUF file with its side folder (if any),
    or a checkpoint folder exported once into the user's cache (`cllm.models.gguf`)."""
    if gguf.is_gguf(name_or_path):
        if runtime not in ("auto", "llamacpp"):
            raise UserError(f"--runtime {runtime}: {name_or_path} is a GGUF file, which decodes on the llamacpp "
                            "runtime only")
        decoding = gguf.open_gguf(name_or_path, threads=threads, sequences=sequences, streams=streams,
                                  why="a GGUF file" if runtime == "auto" else "asked for")
        side = gguf.side_folder(name_or_path)
        tokenizer = gguf.gguf_tokenizer(name_or_path, decoding, load_tokenizer)
        if side.is_dir():
            table = load_draft_table(side, draft_table, vocab=decoding.vocab_size)
        else:
            table = None if draft_table == "auto" else load_draft_table(name_or_path, draft_table,
                                                                         vocab=decoding.vocab_size)
        tuned = tuned_defaults(name_or_path, "cpu", runtime="llamacpp")
    else:
        path = resolve_model_path(name_or_path)
        out_type = OUT_TYPE_OF_DTYPE.get(str(dtype).removeprefix("torch."))
        if out_type is None:
            raise UserError(f"--runtime llamacpp has no GGUF weights for --dtype {dtype}: float32, float16 or bfloat16")
        tokenizer = load_tokenizer(path, trust_remote_code=trust_remote_code)
        table = load_draft_table(path, draft_table)
        module = load_model(path, dtype="float32", trust_remote_code=trust_remote_code)
        file, written = gguf.cached_gguf(module, tokenizer, out_type, model_fingerprint=fingerprint(path),
                                         tokenizer_fingerprint=tokenizer_fingerprint(path))
        del module  # llama.cpp holds the weights from here on
        decoding = gguf.open_gguf(file, threads=threads, sequences=sequences, streams=streams,
                                  why=f"asked for; {Path(path).name} "
                                  f"{'exported now' if written else 'as exported before'} to {file}")
        tuned = tuned_defaults(path, "cpu", runtime="llamacpp")
    settings = {**RECOMMENDED, **tuned, "draft_table": table}
    # a quantized file decodes one token per forward (`exact`): its step costs are measured only where drafts run
    if settings.get("adaptive") and (decoding.batch_invariant or not settings.get("exact")):
        measure_step_costs(decoding, file_identity(decoding.path),
                           f"{decoding.threads} threads, {'f32' if decoding.f32_cache else 'f16'} KV cache")
    return DecodingModel(decoding, tokenizer, table, settings, str(name_or_path), None, None)


def file_identity(path: str | os.PathLike) -> str:
    """A file's path, size and modification time: what tells a changed file from the one a
    measurement was made on."""
    file = Path(path).expanduser().resolve()
    stat = file.stat()
    return f"{file} {stat.st_size} {stat.st_mtime_ns}"


def torch_step_costs(runtime: Runtime, name_or_path: str | os.PathLike, *, dtype, device, compiled: bool) -> None:
    """`measure_step_costs` for a checkpoint on a torch runtime (its fingerprint, dtype, device,
    torch's threads, the compiled or eager forward)."""
    measure_step_costs(runtime, f"{fingerprint(resolve_model_path(name_or_path))} {dtype} {device}",
                       f"{torch.get_num_threads()} threads, {'compiled' if compiled else 'eager'}")


def measure_step_costs(runtime: Runtime, model: str, setting: str) -> None:
    """Give the runtime its step costs (`Runtime.step_costs`), which the engine's `adaptive`
    width is chosen by: measured once per model, setting and machine, then read from the user's
    cache (`cllm.runtime.stepcost`)."""
    runtime.step_costs = cached_costs(runtime, model, setting)
