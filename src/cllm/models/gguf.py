"""Models on the llama.cpp runtime: a GGUF file, with what `cllm export` writes beside it, or a
checkpoint folder exported once into the user's cache.

`cllm export --gguf OUT.gguf` writes a *side folder* `OUT.cllm/` beside the file: the model's
tokenizer files, its draft table (`drafts/`) and the decode setting `cllm tune` measured on
this runtime, when there are any. `load_for_decoding("OUT.gguf")` reads them from there; a GGUF
without one decodes with llama.cpp's own tokenizer (`LlamaCppTokenizer`: the file's own chat
template and end-of-turn tokens) and no draft table. Either tokenizer's chat template is checked
when it loads (`cllm.models.chat`).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from cllm.core.errors import UserError, first_line
from cllm.models.chat import check_chat_template
from cllm.models.loading import TOKENIZER_FILES
from cllm.runtime.gguf import read_source, write_gguf
from cllm.runtime.llamacpp import LlamaCppRuntime
from cllm.runtime.llamacpp_files import LlamaCppTokenizer

SIDE = ".cllm"  # OUT.gguf's side folder: OUT.cllm/


def is_gguf(name_or_path: str | os.PathLike) -> bool:
    """Whether a model name is a GGUF file (by its name: `.gguf`)."""
    return str(name_or_path).lower().endswith(".gguf")


def side_folder(gguf: str | os.PathLike) -> Path:
    """Where `cllm export` puts what decodes with OUT.gguf: OUT.cllm/."""
    path = Path(gguf).expanduser()
    return path.with_name(path.name[: -len(".gguf")] + SIDE if is_gguf(path) else path.name + SIDE)


def cache_dir(folder: str | os.PathLike | None = None) -> Path:
    """`folder`, or the user's cache folder for GGUF exports (~/.cache/cllm/gguf)."""
    if folder:
        return Path(folder).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cllm" / "gguf"


def cached_gguf(model: torch.nn.Module, tokenizer, out_type: str, folder: str | os.PathLike | None = None,
                *, model_fingerprint: str, tokenizer_fingerprint: str) -> tuple[Path, bool]:
    """The model's GGUF export in `folder` (`cache_dir`), named by the model's and tokenizer's
    fingerprints and the weight type: reused when its recorded source matches them, else
    (re)written. Returns the file and whether it was written now."""
    source = {"fingerprint": model_fingerprint, "tokenizer": tokenizer_fingerprint}
    folder = cache_dir(folder)
    path = folder / f"{model_fingerprint}-{tokenizer_fingerprint}-{out_type}.gguf"
    recorded = read_source(path) if path.is_file() else None
    if recorded is not None and all(recorded.get(k) == v for k, v in source.items()):
        return path, False
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_gguf(model, tokenizer, path, out_type=out_type, name="cached", source=source)
    except OSError as exc:
        raise UserError(f"cannot write the GGUF export to {folder}: {exc.strerror or first_line(exc)}") from None
    return path, True


def open_gguf(path: str | os.PathLike, *, threads: int | None, why: str,
              sequences: int | None = None, streams: int = 0) -> LlamaCppRuntime:
    """A GGUF file on the llama.cpp runtime; a one-line UserError when it cannot be."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise UserError(f"no GGUF file at {file}")
    try:
        return LlamaCppRuntime(file, threads=threads or 0, why=why, streams=streams,
                               **({"sequences": sequences} if sequences else {}))
    except ValueError as exc:
        raise UserError(f"--runtime llamacpp: {first_line(exc)}") from None


def gguf_tokenizer(path: str | os.PathLike, runtime: LlamaCppRuntime, load_tokenizer):
    """The tokenizer of a GGUF file: the one its side folder holds (`load_tokenizer` of it, which
    checks its chat template), else llama.cpp's own, whose chat template (the file's
    `tokenizer.chat_template`) is checked here. A side folder whose tokenizer has more tokens than
    the file's vocabulary is refused in one line: its ids past the vocabulary would fail
    llama.cpp's decode at the first prompt that holds one."""
    side = side_folder(path)
    if side.is_dir() and any(any(side.glob(name)) for name in TOKENIZER_FILES):  # not only `cllm tune`'s settings
        tokenizer = load_tokenizer(side)
        if len(tokenizer) > runtime.vocab_size:
            raise UserError(f"the tokenizer in {side} has {len(tokenizer)} tokens, more than the {runtime.vocab_size} "
                            f"of {Path(path).expanduser()}'s vocabulary: that side folder is another model's")
        return tokenizer
    tokenizer = LlamaCppTokenizer(runtime)
    check_chat_template(tokenizer, f"the metadata of {Path(path).expanduser()} (tokenizer.chat_template)")
    return tokenizer
