"""The only place that loads models and tokenizers.

A model is named by a local directory (an ordinary Hugging Face checkpoint) or a hub id. The
hub is used only if the user's environment allows it; we never pass ``trust_remote_code``
unless asked. Errors a user can make (a path that does not exist, a directory without a
checkpoint, an unknown dtype) become one-line `UserError`s.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cllm.core.config import is_off
from cllm.core.errors import UserError, first_line

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
EMBEDDED_TARGET = "stdlib-coder"  # the shipped target; the other shipped models are made from it
SHIPPED = {
    "stdlib-coder": REPO_ROOT / "models" / "stdlib-coder",
    "stdlib-coder-cllm": REPO_ROOT / "models" / "stdlib-coder-cllm",
    # the draft model of speculative decoding in `cllm bench` (not shipped yet: skipped with a note)
    "stdlib-coder-draft": REPO_ROOT / "models" / "stdlib-coder-draft",
}
# A model's draft table (`cllm drafts`), relative to its checkpoint directory: a subfolder, so
# the checkpoint's own files (and `fingerprint`) do not change when a table is added.
DRAFT_TABLE = Path("drafts") / "ngram.safetensors"
# Decode settings measured for a checkpoint on one type of device (`cllm tune`), beside it.
DECODE_DEFAULTS = "decode_defaults.json"


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise UserError(f"unknown dtype {name!r}; choose one of {sorted(set(DTYPES))}") from None


# A hub id is `owner/name` (letters, digits, '-', '_', '.'); anything else is a local path.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_]")


def looks_like_hub_id(text: str) -> bool:
    """`owner/name` whose owner is not a local directory (`runs/nothing` next to a `runs/`
    folder is a missing local checkpoint, not a hub id)."""
    return bool(HUB_ID.fullmatch(text)) and not Path(text.split("/")[0]).is_dir()


def _hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


@functools.lru_cache(maxsize=32)
def _hub_problem(repo_id: str) -> str | None:
    """Why `repo_id` cannot be loaded from the hub, or None (it is cached, or the hub has it).
    One request without retries: huggingface_hub's downloads retry a failed connection for
    ~25 s per file, so a typo'd path would cost a minute before its error."""
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    if isinstance(huggingface_hub.try_to_load_from_cache(repo_id, "config.json"), str):
        return None
    if _hub_offline():
        return "nor a cached hub model (HF_HUB_OFFLINE is set)"
    try:
        huggingface_hub.model_info(repo_id)
    except RepositoryNotFoundError:
        return "nor a model on the hub"
    except HfHubHTTPError:  # the hub answered (gated, private...): transformers says what it needs
        return None
    except Exception as exc:  # noqa: BLE001 - no answer: name not resolved, refused, timed out
        return f"and the hub could not be reached to look for it ({type(exc).__name__})"
    return None


def resolve_model_path(name_or_path: str | os.PathLike) -> str:
    """A shipped short name, a local directory, or a hub id `owner/name` (tried only when no
    such local path exists and its owner is not a local folder; checked with one request)."""
    text = str(name_or_path)
    if text in SHIPPED:
        path = SHIPPED[text]
        if not (path / "config.json").is_file():
            raise UserError(f"shipped model {text!r} is not present at {path}")
        return str(path)
    path = Path(text).expanduser()
    if path.exists() or not looks_like_hub_id(text):
        if not path.is_dir():
            hint = difflib.get_close_matches(text, list(SHIPPED), n=1)
            raise UserError(f"model directory not found: {text}"
                            + (f" (did you mean the shipped model {hint[0]}?)" if hint else ""))
        if not (path / "config.json").is_file():
            raise UserError(f"{path} is not a Hugging Face checkpoint (no config.json)")
        return str(path)
    problem = _hub_problem(text)
    if problem:
        raise UserError(f"model directory not found: {text}, {problem}")
    return text


def load_tokenizer(name_or_path: str | os.PathLike, *, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    path = resolve_model_path(name_or_path)
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except OSError as exc:
        raise UserError(f"cannot load tokenizer {path!r}: {first_line(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - a damaged file (JSON, protobuf...): say which
        raise UserError(f"cannot load tokenizer {path!r}: {_damage(path, exc, 'tokenizer.json')}") from None


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
        raise UserError(f"cannot load model {path!r}: {first_line(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - a damaged file (safetensors, JSON...): say which
        raise UserError(f"cannot load model {path!r}: {_damage(path, exc)}") from None
    return model.to(device).eval()


def _damage(path: str, exc: Exception, suspect: str | None = None) -> str:
    """Name the checkpoint file that cannot be read (weights, config or tokenizer files), else
    the `suspect` file when there is one, else say what failed. The files are only opened: a
    safetensors header, a JSON document."""
    folder = Path(path)
    failure = f"{type(exc).__name__}: {first_line(exc)}"
    if folder.is_dir():
        for file in sorted(folder.iterdir()):
            problem = _unreadable(file)
            if problem:
                return f"{file} is damaged or not what its name says ({problem})"
        if suspect and (folder / suspect).is_file():
            return f"{folder / suspect} could not be read ({failure})"
    return failure


def _unreadable(file: Path) -> str | None:
    """Why `file` cannot be read as what its suffix says, or None."""
    import json

    try:
        if file.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(file), framework="pt") as f:
                f.keys()
        elif file.suffix == ".json":
            json.loads(file.read_text(encoding="utf-8"))
    except Exception as exc:  # noqa: BLE001 - any failure to parse is the answer
        return first_line(exc)
    return None


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
        from cllm.data.tokenizer import tokenizer_sha256

        return tokenizer_sha256(tok)[:16]
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
    from cllm.decoding.draft_table import DraftTable

    if spec is None or is_off(spec, ("none", "off", "")):
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
        table = DraftTable.load(file)
    except Exception as exc:  # noqa: BLE001 - a damaged or foreign file: one line naming it
        raise UserError(f"cannot read draft table {file}: {first_line(exc)}") from None
    built_for = table.meta.get("tokenizer")
    if built_for and built_for != tokenizer_fingerprint(model):
        raise UserError(f"draft table {file} was built for another tokenizer ({table.meta.get('model', '?')})")
    return table


@dataclass
class DecodingModel:
    """A model ready for the fast path: `jacobi_decode(m.model, ids, **m.settings)` decodes as
    `cllm generate` does by default (greedy: the same tokens as greedy decoding)."""

    model: torch.nn.Module
    tokenizer: Any
    draft_table: Any  # its DraftTable (`cllm drafts`), or None when its folder has none
    settings: dict[str, Any]  # `jacobi_decode` keyword arguments: RECOMMENDED, tuned, + draft_table
    name: str


def load_for_decoding(
    name_or_path: str | os.PathLike,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    draft_table: str | None = "auto",
    trust_remote_code: bool = False,
) -> DecodingModel:
    """One call for the fast path: the model (a shipped name, a local folder or a hub id
    `owner/name`), its tokenizer, its draft table and the decode setting of the CLI.

    Args:
        draft_table: "auto" (the table saved beside the checkpoint, if any), "none", or a file.

    Example:
        fast = load_for_decoding("stdlib-coder-cllm")
        ids = fast.tokenizer("def add(a, b):", return_tensors="pt").input_ids
        out = jacobi_decode(fast.model, ids, max_new_tokens=64,
                            eos_token_id=fast.tokenizer.eos_token_id, **fast.settings)
    """
    from cllm.decoding import RECOMMENDED

    tokenizer = load_tokenizer(name_or_path, trust_remote_code=trust_remote_code)
    table = load_draft_table(name_or_path, draft_table)
    model = load_model(name_or_path, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    settings = {**RECOMMENDED, **tuned_defaults(name_or_path, device), "draft_table": table}
    return DecodingModel(model, tokenizer, table, settings, str(name_or_path))


def tuned_defaults(name_or_path: str | os.PathLike, device: str | torch.device = "cpu") -> dict[str, Any]:
    """The decode settings `cllm tune` wrote beside a local checkpoint for this type of device
    (block size, fed-token budget), or {} when there are none for it. Settings measured on a GPU
    are not used on a CPU, nor the other way round."""
    import json

    from cllm.decoding import RECOMMENDED

    file = Path(resolve_model_path(name_or_path)) / DECODE_DEFAULTS
    if not file.is_file():
        return {}
    try:
        record = json.loads(file.read_text(encoding="utf-8"))
        settings = record["settings"]
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"cannot read {file}: {first_line(exc)} (rerun cllm tune --force)") from None
    if record.get("device") != torch.device(device).type:
        return {}
    return {k: v for k, v in settings.items() if k in RECOMMENDED}
