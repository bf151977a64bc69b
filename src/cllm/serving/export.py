"""`cllm export`: a checkpoint as one GGUF file for llama.cpp (`cllm.runtime.gguf` writes it),
quantized by llama.cpp's own quantizer when asked (`--quantize`), with its side folder
(`OUT.cllm/`: the tokenizer files, the draft table, the decode setting tuned on the llama.cpp
runtime) where `load_for_decoding("OUT.gguf")` finds them, and the draft table as llama.cpp's
static n-gram cache when asked (`--lookup-cache`)."""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

from cllm.core.errors import UserError, first_line
from cllm.core.outputs import (
    Input,
    check_distinct,
    check_folder,
    check_new_file,
    claim_folder,
    replacing,
    write_failures,
)
from cllm.models import (
    DECODE_DEFAULTS_LLAMACPP,
    DRAFT_TABLE,
    TOKENIZER_FILES,
    TOKENIZER_READS,
    fingerprint,
    load_draft_table,
    load_model,
    load_tokenizer,
    resolve_model_path,
    tokenizer_fingerprint,
)
from cllm.models.gguf import side_folder
from cllm.runtime.gguf import GgufSummary, import_gguf, write_gguf
from cllm.runtime.llamacpp import unavailable
from cllm.runtime.llamacpp_files import quantize
from cllm.serving.config import ExportConfig
from cllm.serving.lookup_cache import write_lookup_cache


def export_gguf(config: ExportConfig) -> GgufSummary:
    """Check the outputs and the inputs, then write the GGUF, its side folder and the lookup
    cache when asked."""
    import_gguf()  # before anything loads: a missing package is the first thing said
    if config.quantize and (reason := unavailable()) is not None:
        raise UserError(f"--quantize uses llama.cpp's quantizer: {reason}")
    path = resolve_model_path(config.model)
    model_input = [Input("--model", path)]
    side = side_folder(config.gguf)
    check_distinct([("--gguf", config.gguf), ("--lookup-cache", config.lookup_cache), ("the side folder", side)])
    out = check_new_file(config.gguf, force=config.force, flag="--gguf", what="GGUF file", inputs=model_input)
    check_folder(side, "export", force=config.force, flag=f"--gguf's side folder ({side.name})",
                 inputs=model_input)
    table = load_draft_table(path, "auto")
    if config.lookup_cache:
        check_new_file(config.lookup_cache, force=config.force, flag="--lookup-cache", what="lookup cache",
                       inputs=[*model_input, Input("the side folder", side)])
        if table is None:
            raise UserError(f"--lookup-cache: {config.model} has no draft table (cllm drafts --model "
                            f"{config.model} builds one)")
    model, tokenizer = load_model(path), load_tokenizer(path)
    source = {"model": str(config.model), "fingerprint": fingerprint(path),
              "tokenizer": tokenizer_fingerprint(path), **({"quantize": config.quantize} if config.quantize else {})}
    with write_failures(out):
        out.parent.mkdir(parents=True, exist_ok=True)
        if config.quantize:
            summary = _write_quantized(model, tokenizer, out, config, name=Path(path).name, source=source)
        else:
            summary = write_gguf(model, tokenizer, out, out_type=config.out_type, name=Path(path).name,
                                 source=source)
    summary = replace(summary, side=_write_side_folder(Path(path), side, has_table=table is not None))
    if table is not None and config.lookup_cache:
        with write_failures(Path(config.lookup_cache)):
            Path(config.lookup_cache).parent.mkdir(parents=True, exist_ok=True)
            kept = write_lookup_cache(table, config.lookup_cache)
        summary = replace(summary, lookup_cache=(
            f"wrote {config.lookup_cache}: the draft table's {kept:,} two-token contexts of {len(table):,} as "
            "llama.cpp's static n-gram cache (llama-lookup --lookup-cache-static)"))
    return summary


def _write_quantized(model, tokenizer, out: Path, config: ExportConfig, *, name: str, source: dict) -> GgufSummary:
    """The GGUF in --out-type into a temporary folder beside `out`, quantized from there to `out`."""
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as scratch:
        plain = Path(scratch) / "source.gguf"
        summary = write_gguf(model, tokenizer, plain, out_type=config.out_type, name=name, source=source)
        with replacing(out) as tmp:
            try:
                quantize(plain, tmp, config.quantize, threads=config.threads)
            except ValueError as exc:
                raise UserError(f"--quantize {config.quantize}: {first_line(exc)}") from None
    return replace(summary, path=out, out_type=config.quantize, bytes=out.stat().st_size)


def _write_side_folder(model: Path, side: Path, *, has_table: bool) -> str:
    """Copy what decodes with the GGUF (tokenizer files as they are, the draft table, the decode
    setting tuned on llama.cpp) into `side`; returns what it wrote, in words."""
    with write_failures(side):
        claim_folder(side, "export")
        copied = []
        for pattern in (*TOKENIZER_FILES, *TOKENIZER_READS, "chat_template.jinja", "generation_config.json"):
            for file in model.glob(pattern):
                if file.name != "config.json" and file.is_file():
                    shutil.copyfile(file, side / file.name)
                    copied.append(file.name)
        what = ["the tokenizer"]
        if has_table:
            (side / DRAFT_TABLE).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(model / DRAFT_TABLE, side / DRAFT_TABLE)
            what.append("the draft table")
        defaults = model / DECODE_DEFAULTS_LLAMACPP
        if defaults.is_file():
            shutil.copyfile(defaults, side / DECODE_DEFAULTS_LLAMACPP)
            what.append("the decode setting tuned on llama.cpp")
    return f"wrote {side}/: {', '.join(what)} (load_for_decoding of the GGUF reads them there)"

