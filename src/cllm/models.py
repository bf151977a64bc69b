"""The only place that loads models and tokenizers.

A model is named by a local directory (an ordinary Hugging Face checkpoint) or a hub id. The
hub is used only if the user's environment allows it; we never pass ``trust_remote_code``
unless asked. Errors a user can make (a path that does not exist, a directory without a
checkpoint, an unknown dtype) become one-line `UserError`s.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from cllm.config import UserError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}

# Shipped checkpoints, addressable by short name from anywhere.
REPO_ROOT = Path(__file__).resolve().parents[2]
SHIPPED = {
    "stdlib-coder": REPO_ROOT / "models" / "stdlib-coder",
    "stdlib-coder-cllm": REPO_ROOT / "models" / "stdlib-coder-cllm",
}
# A model's draft table (`cllm drafts`), relative to its checkpoint directory: a subfolder, so
# the checkpoint's own files (and `fingerprint`) do not change when a table is added.
DRAFT_TABLE = Path("drafts") / "ngram.safetensors"


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise UserError(f"unknown dtype {name!r}; choose one of {sorted(set(DTYPES))}") from None


def resolve_model_path(name_or_path: str | os.PathLike) -> str:
    """A shipped short name, a local directory, or (left as is) a hub id."""
    text = str(name_or_path)
    if text in SHIPPED:
        path = SHIPPED[text]
        if not (path / "config.json").is_file():
            raise UserError(f"shipped model {text!r} is not present at {path}")
        return str(path)
    path = Path(text).expanduser()
    looks_local = path.exists() or text.startswith((".", "/", "~")) or text.count("/") > 1
    if looks_local:
        if not path.is_dir():
            raise UserError(f"model directory not found: {path}")
        if not (path / "config.json").is_file():
            raise UserError(f"{path} is not a Hugging Face checkpoint (no config.json)")
        return str(path)
    return text


def load_tokenizer(name_or_path: str | os.PathLike, *, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    path = resolve_model_path(name_or_path)
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except OSError as exc:
        raise UserError(f"cannot load tokenizer {path!r}: {str(exc).splitlines()[0]}") from None


def load_model(
    name_or_path: str | os.PathLike,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
):
    """Load a causal LM in eval mode on `device` with `dtype`."""
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(name_or_path)
    torch_dtype = resolve_dtype(dtype)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch_dtype, trust_remote_code=trust_remote_code
        )
    except OSError as exc:
        raise UserError(f"cannot load model {path!r}: {str(exc).splitlines()[0]}") from None
    return model.to(device).eval()


def fingerprint(path_or_model) -> str:
    """A short content hash of a checkpoint directory (weights + config + tokenizer files) or,
    for an in-memory model, of its parameters. Used to tell artifacts of different models apart."""
    digest = hashlib.sha256()
    if isinstance(path_or_model, torch.nn.Module):
        for name, tensor in sorted(path_or_model.state_dict().items()):
            digest.update(name.encode())
            digest.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
        return digest.hexdigest()[:16]
    path = Path(resolve_model_path(path_or_model))
    if not path.is_dir():
        digest.update(str(path_or_model).encode())  # a hub id: identify by name
        return digest.hexdigest()[:16]
    for file in sorted(path.iterdir()):
        if file.suffix in (".safetensors", ".bin") or file.name == "config.json":
            digest.update(file.name.encode())
            with open(file, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    digest.update(chunk)
    return digest.hexdigest()[:16]


def tokenizer_fingerprint(path_or_tokenizer) -> str:
    """A short hash of a tokenizer's vocabulary, merges and special tokens."""
    if isinstance(path_or_tokenizer, (str, os.PathLike)):
        path = Path(resolve_model_path(path_or_tokenizer))
        file = path / "tokenizer.json"
        if file.is_file():
            return hashlib.sha256(file.read_bytes()).hexdigest()[:16]
        path_or_tokenizer = load_tokenizer(path)
    tok = path_or_tokenizer
    if getattr(tok, "backend_tokenizer", None) is not None:
        from cllm.data.tokenizer import tokenizer_fingerprint as full_fingerprint

        return full_fingerprint(tok)[:16]
    return hashlib.sha256(repr(sorted(tok.get_vocab().items())).encode()).hexdigest()[:16]


def pad_token_id(tokenizer) -> int:
    """The id to pad batches with: the tokenizer's pad token, else its EOS, else 0 (padding is
    masked, so only its being a valid id matters)."""
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    return tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0


def load_draft_table(model: str | os.PathLike, spec: str | None = "auto"):
    """The draft table to decode `model` with (`cllm drafts`), or None.

    `spec`: "auto" (the table saved beside the checkpoint, if there is one), "none", or a path.
    A table built for another tokenizer is refused: its token ids would mean other tokens.
    """
    from cllm.decoding.ngram import NgramTable

    if spec is None or spec.strip().lower() in ("none", "off", ""):
        return None
    if spec == "auto":
        path = Path(resolve_model_path(model))
        file = path / DRAFT_TABLE
        if not file.is_file():
            return None
    else:
        file = Path(spec).expanduser()
        if not file.is_file():
            raise UserError(f"draft table not found: {file}")
    try:
        table = NgramTable.load(file)
    except (ValueError, KeyError, OSError) as exc:
        raise UserError(f"cannot read draft table {file}: {str(exc).splitlines()[0]}") from None
    built_for = table.meta.get("tokenizer")
    if built_for and built_for != tokenizer_fingerprint(model):
        raise UserError(f"draft table {file} was built for another tokenizer ({table.meta.get('model', '?')})")
    return table
