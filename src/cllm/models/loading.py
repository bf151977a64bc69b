"""Loading checkpoints, tokenizers, draft tables and heads.

A model is named by a local directory (an ordinary Hugging Face checkpoint) or a hub id. The
hub is used only if the user's environment allows it; we never pass ``trust_remote_code``
unless asked. Errors a user can make (a path that does not exist, a directory without a
checkpoint, an unknown dtype) become one-line `UserError`s.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
import logging
import os
import re
import shlex
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import huggingface_hub
import torch
import transformers
from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
from transformers.models.auto.tokenization_auto import tokenizer_class_from_name
from transformers.utils import logging as transformers_logging

from cllm.core.config import is_off
from cllm.core.errors import UserError, first_line
from cllm.core.options import check_dtype
from cllm.data.tokenizer import tokenizer_sha256
from cllm.decoding.draft_table import DraftTable
from cllm.modeling.eagle import CONFIG_FILE as EAGLE_CONFIG_FILE
from cllm.modeling.eagle import EAGLE_DIR, EagleHead
from cllm.modeling.eagle import WEIGHTS_FILE as EAGLE_WEIGHTS_FILE
from cllm.modeling.heads import CONFIG_FILE, HEADS_DIR, WEIGHTS_FILE, MedusaHeads
from cllm.models.chat import check_chat_template, template_source
from cllm.models.names import (  # noqa: F401 (re-exported: `cllm.models` and older imports)
    DECODE_DEFAULTS,
    DECODE_DEFAULTS_LLAMACPP,
    DRAFT_TABLE,
    EMBEDDED_TARGET,
    REPO_ROOT,
    SHIPPED,
)

log = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}

# What a tokenizer is saved as: the `tokenizers` file, a sentencepiece or tiktoken model, BPE or
# WordPiece vocabularies, or the config that names them. A folder with none of them has no tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "vocab.txt", "spiece.model", "sentencepiece.bpe.model", "*.tiktoken")
# The files each loader reads, in its order (glob patterns), for naming the one it failed on:
# transformers reads tokenizer_config.json to choose the tokenizer class, which then reads the rest.
MODEL_READS = ("config.json", "generation_config.json", "*.safetensors.index.json", "*.safetensors")
# what a tokenizer folder holds beside its vocabulary: copied with it (`save_tokenizer`)
TOKENIZER_SIDE_FILES = ("special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json")
TOKENIZER_READS = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.json",
                   "vocab.json", "config.json")


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    return DTYPES[check_dtype(name).lower()]


# A hub id is `owner/name` (letters, digits, '-', '_', '.'); anything else is a local path.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_]")


def looks_like_hub_id(text: str) -> bool:
    """`owner/name` whose owner is not a local directory (`runs/nothing` next to a `runs/`
    folder is a missing local checkpoint, not a hub id)."""
    return bool(HUB_ID.fullmatch(text)) and not Path(text.split("/")[0]).is_dir()


def _hub_offline() -> bool:
    return bool(huggingface_hub.constants.HF_HUB_OFFLINE)


@functools.lru_cache(maxsize=32)
def _hub_problem(repo_id: str) -> str | None:
    """Why `repo_id` cannot be loaded from the hub, or None (it is cached, or the hub has it).
    One request without retries: huggingface_hub's downloads retry a failed connection for
    ~25 s per file, so a typo'd path would cost a minute before its error."""
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
    such local path exists and its owner is not a local folder; checked with one request). A GGUF
    file is refused in one line naming `cllm import`, which makes a checkpoint folder of it (the
    llama.cpp paths, `load_for_decoding`, take a GGUF before they get here)."""
    text = str(name_or_path)
    if text in SHIPPED:
        path = SHIPPED[text]
        if not (path / "config.json").is_file():
            raise UserError(f"shipped model {text!r} is not present at {path}")
        return str(path)
    path = Path(text).expanduser()
    if _is_gguf_file(path):
        raise UserError(f"this command needs a checkpoint folder, and {text} is a GGUF file: make one with "
                        f"`cllm import {shlex.quote(text)} --out DIR`")
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


def _is_gguf_file(path: Path) -> bool:
    """Whether `path` is a GGUF file: by its name (`.gguf`) or its first bytes (GGUF's magic)."""
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with path.open("rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def resolve_folder(name_or_path: str | os.PathLike) -> str:
    """A local folder as it is, checkpoint or not (a GGUF file's side folder holds a tokenizer
    and a draft table but no model); anything else as `resolve_model_path` resolves it."""
    path = Path(name_or_path).expanduser()
    return str(path) if path.is_dir() else resolve_model_path(name_or_path)


def model_config(name_or_path: str | os.PathLike, *, trust_remote_code: bool = False):
    """The model's config (transformers' `AutoConfig`), read alone. A config.json transformers
    cannot use (an unknown dtype, a bad value) is a one-line `UserError` naming it: the
    tokenizer's loader reads it too and would report it as a tokenizer problem."""
    path = resolve_model_path(name_or_path)
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - whatever a bad config makes transformers raise
        where = Path(path) / "config.json" if Path(path).is_dir() else path
        raise UserError(f"cannot use the model's config {where}: {first_line(exc)}") from None


def vocab_size(name_or_path: str | os.PathLike) -> int | None:
    """How many token ids the model has embeddings for, from its config alone (`vocab_size`, or
    its text model's); None when the config does not say."""
    path = Path(resolve_model_path(name_or_path))
    if not (path / "config.json").is_file():  # a hub id
        return int(model_config(path).get_text_config().vocab_size)
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except ValueError as exc:
        raise UserError(f"cannot read {path / 'config.json'}: {first_line(exc)}") from None
    size = config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size")) \
        if isinstance(config, dict) else None
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def load_tokenizer(name_or_path: str | os.PathLike, *, trust_remote_code: bool = False):
    """The tokenizer saved with a model, encoding exactly as its folder's tokenizer.json does.

    A folder with a tokenizer.json is read as that file (`PreTrainedTokenizerFast`, with the
    special tokens and chat template of tokenizer_config.json): `AutoTokenizer` would build the
    class the model type maps to, and some (transformers 5's Qwen2Tokenizer) rebuild the
    pre-tokenizer and normalizer of their own, so the user's text would be split otherwise than
    the model was trained on. Other folders (sentencepiece or vocab files only, remote code) and
    hub ids go through `AutoTokenizer`.

    A folder without a tokenizer, or one without a vocabulary, is a one-line `UserError` naming
    the folder: transformers 5 would build an empty tokenizer, and every prompt would then encode
    to nothing far from the cause. A config.json transformers
    cannot use is said as such first (`model_config`). So is a chat template that the sandbox
    blocks or that cannot write a conversation (`cllm.models.chat.check_chat_template`), naming
    the file it came from."""
    path = resolve_folder(name_or_path)
    if (Path(path) / "config.json").is_file():
        model_config(path, trust_remote_code=trust_remote_code)
    if Path(path).is_dir() and not any(any(Path(path).glob(name)) for name in TOKENIZER_FILES):
        raise UserError(f"{path} has no tokenizer (no tokenizer.json, tokenizer.model or vocab files): save one "
                        f"there with tokenizer.save_pretrained({path!r})")
    try:
        if _own_pipeline(Path(path)):
            tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
        else:
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except OSError as exc:
        raise UserError(f"cannot load tokenizer {path!r}: {first_line(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - a damaged file (JSON, protobuf...): say which
        raise UserError(f"cannot load tokenizer {path!r}: {_damage(path, exc, TOKENIZER_READS)}") from None
    if len(tokenizer) <= len(set(tokenizer.all_special_tokens)):
        raise UserError(f"{path} has a tokenizer with an empty vocabulary (only its special tokens): save the "
                        f"model's tokenizer there with tokenizer.save_pretrained({path!r})")
    check_chat_template(tokenizer, template_source(path))
    return tokenizer


def _own_pipeline(folder: Path) -> bool:
    """Whether `folder` holds a tokenizer.json to read as it is: not when its tokenizer_config.json
    names remote code (`auto_map`: that class is what the model's authors chose)."""
    if not (folder / "tokenizer.json").is_file():
        return False
    config_file = folder / "tokenizer_config.json"
    try:
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    except ValueError:
        return True  # the loader names the damaged file
    return not (isinstance(config, dict) and "auto_map" in config)


def save_tokenizer(tokenizer, out: str | os.PathLike) -> None:
    """Write `tokenizer` into the model folder `out` as the same tokenizer it was loaded as: the
    tokenizer files of the folder it came from, copied byte for byte, when it still encodes as
    that folder's tokenizer.json (so the new model's tokenizer fingerprint is its source's);
    otherwise (a hub id, a tokenizer changed in memory) `save_pretrained`."""
    source = Path(str(getattr(tokenizer, "name_or_path", "") or "")).expanduser()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    out = Path(out)
    if source.is_dir() and source.resolve() == out.resolve():
        return
    if backend is not None and _own_pipeline(source):
        try:  # what loading the source gives now (transformers adds its post-processor to the file's)
            fresh = PreTrainedTokenizerFast.from_pretrained(str(source))
            same = (fresh.backend_tokenizer.to_str() == backend.to_str()
                    and fresh.special_tokens_map == tokenizer.special_tokens_map
                    and fresh.chat_template == tokenizer.chat_template)
        except Exception:  # noqa: BLE001 - a source that no longer loads: save from memory
            same = False
        if same:
            out.mkdir(parents=True, exist_ok=True)
            for pattern in (*TOKENIZER_FILES, *TOKENIZER_SIDE_FILES):
                for file in sorted(source.glob(pattern)):
                    if file.is_file():
                        shutil.copyfile(file, out / file.name)
            return
    tokenizer.save_pretrained(out)


def load_model(
    name_or_path: str | os.PathLike,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
    allow_missing: bool = False,
):
    """Load a causal LM in eval mode on `device` with `dtype`.

    A checkpoint that lacks a weight of its architecture, holds one it does not have, or one of
    another shape is refused in one line naming them: transformers would fill the gaps with
    random weights and the model would run, writing other text. `allow_missing=True` takes it
    anyway (for a checkpoint known to be partial)."""
    path = resolve_model_path(name_or_path)
    torch_dtype = resolve_dtype(dtype)
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()  # its load report of gaps: said below in one line
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch_dtype, trust_remote_code=trust_remote_code, output_loading_info=True,
            ignore_mismatched_sizes=True,  # reported below, with the other gaps
        )
    except OSError as exc:
        raise UserError(f"cannot load model {path!r}: {first_line(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - a damaged file (safetensors, JSON...): say which
        raise UserError(f"cannot load model {path!r}: {_damage(path, exc, MODEL_READS)}") from None
    finally:
        transformers_logging.set_verbosity(verbosity)
    if (gaps := _weight_gaps(info)) and not allow_missing:
        raise UserError(f"{path} is not a whole {type(model).__name__} checkpoint ({gaps}): loading it would "
                        "fill the gaps with random weights")
    return model.to(device).eval()


def _weight_gaps(info: dict) -> str:
    """What transformers' loading info says is missing, unexpected or of another shape, in words
    ('' when nothing is)."""
    parts = []
    for key, what in (("missing_keys", "missing"), ("unexpected_keys", "not in the architecture"),
                      ("mismatched_keys", "of another shape")):
        names = sorted(k if isinstance(k, str) else k[0] for k in info.get(key) or ())
        if names:
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            parts.append(f"{what}: {shown}")
    return "; ".join(parts)


def _damage(path: str, exc: Exception, reads: Sequence[str]) -> str:
    """Name the first checkpoint file that cannot be read, among those the failed loader reads
    (`reads`: glob patterns, in its order), each parsed as that loader reads it (a safetensors
    header, a JSON document, a `tokenizers` file, the class a tokenizer_config.json names); else
    say what failed."""
    folder = Path(path)
    if folder.is_dir():
        files = dict.fromkeys(file for pattern in reads for file in sorted(folder.glob(pattern)) if file.is_file())
        for file in files:
            problem = _unreadable(file)
            if problem:
                return f"{file} {problem}"
    return f"{type(exc).__name__}: {first_line(exc)}"


def _unreadable(file: Path) -> str | None:
    """Why `file` cannot be read as what its name says, or None."""
    try:
        if file.suffix == ".safetensors":
            with safe_open(str(file), framework="pt") as f:
                f.keys()
        elif file.name == "tokenizer.json":
            Tokenizer.from_file(str(file))
        elif file.suffix == ".json":
            data = json.loads(file.read_text(encoding="utf-8"))
            if file.name == "tokenizer_config.json":
                return _unknown_tokenizer_class(data)
    except Exception as exc:  # noqa: BLE001 - any failure to parse is the answer
        return f"is damaged or not what its name says ({first_line(exc)})"
    return None


def _unknown_tokenizer_class(config: Any) -> str | None:
    """Why this transformers cannot build the tokenizer class a tokenizer_config.json names (one
    a newer transformers wrote, like 5.x's TokenizersBackend read by 4.x), or None."""
    name = config.get("tokenizer_class") if isinstance(config, dict) else None
    if not isinstance(name, str) or "auto_map" in config:  # remote code names its own classes
        return None
    if tokenizer_class_from_name(name) is not None or tokenizer_class_from_name(f"{name}Fast") is not None:
        return None
    return (f"names the tokenizer class {name!r}, which transformers {transformers.__version__} does not have "
            '(written by a newer transformers? upgrade it, or set "tokenizer_class": "PreTrainedTokenizerFast")')


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
        path = Path(resolve_folder(path_or_tokenizer))
        file = path / "tokenizer.json"
        if file.is_file():
            return hashlib.sha256(file.read_bytes()).hexdigest()[:16]
        path_or_tokenizer = load_tokenizer(path)
    tok = path_or_tokenizer
    if getattr(tok, "backend_tokenizer", None) is not None:
        return tokenizer_sha256(tok)[:16]
    return hashlib.sha256(repr(sorted(tok.get_vocab().items())).encode()).hexdigest()[:16]


def pad_token_id(tokenizer) -> int:
    """The id to pad batches with: the tokenizer's pad token, else its EOS, else 0 (padding is
    masked, so only its being a valid id matters)."""
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    return tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0


def load_draft_table(model: str | os.PathLike, spec: str | None = "auto", *, vocab: int | None = None):
    """The draft table to decode `model` with (`cllm drafts`), or None.

    `spec`: "auto" (the table saved beside the checkpoint, if there is one), "none", or a path.
    A table built for another tokenizer is refused (its token ids would mean other tokens), as is
    one with ids outside the model's vocabulary or tensors other than a table's, in one line
    naming the file, before anything decodes. `vocab`: the vocabulary's size, where `model`'s
    config does not say it (a GGUF file's side folder).
    """
    if spec is None or is_off(spec, ("none", "off", "")):
        return None
    if spec == "auto":
        path = Path(resolve_folder(model))
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
    if (vocab := vocab or vocab_size(model)) is not None and table.max_token_id >= vocab:
        raise UserError(f"draft table {file} holds token id {table.max_token_id}, outside the model's vocabulary of "
                        f"{vocab}: it was built for another model")
    return table


# ---------------------------------------------------------------------------------- Medusa heads
# The loader of the heads `cllm medusa` saves (`cllm.training.medusa.save_heads`); their module
# and file names are `cllm.modeling.heads`'.


def _drafter_dir(source: str | os.PathLike, subfolder: str, config_file: str) -> Path | None:
    """`source` itself when it holds `config_file`, else its `subfolder` when that does (a
    checkpoint with a drafter inside); None otherwise."""
    path = Path(source).expanduser()
    for candidate in (path, path / subfolder):
        if (candidate / config_file).is_file():
            return candidate
    return None


def _drafter_record(source: str | os.PathLike, model_path: str | os.PathLike | None, kind: str, subfolder: str,
                    config_file: str) -> tuple[Path, str | os.PathLike | None, dict] | None:
    """A saved drafter's folder, the checkpoint whose fingerprint it is checked against (the one
    it sits in, unless `model_path` names one) and its config record; None when `source` is a
    folder without one. A missing `source` or an unreadable record is a one-line UserError."""
    path = Path(source).expanduser()
    if not path.exists():
        raise UserError(f"{kind} not found: {path}")
    found = _drafter_dir(path, subfolder, config_file)
    if found is None:
        return None
    if model_path is None and found != path and (path / "config.json").is_file():
        model_path = path  # a checkpoint with its drafter inside
    try:
        record = json.loads((found / config_file).read_text(encoding="utf-8"))
    except ValueError as exc:
        raise UserError(f"cannot read {found / config_file}: {first_line(exc)}") from None
    if not isinstance(record, dict):
        raise UserError(f"cannot read {found / config_file}: not a JSON object")
    return found, model_path, record


def _load_weights(found: Path, weights_file: str, load: Callable[[dict[str, torch.Tensor]], Any]) -> None:
    """`load` the tensors of `found / weights_file`; a missing, damaged or foreign file is a
    one-line UserError naming it."""
    try:
        with safe_open(str(found / weights_file), framework="pt") as file:
            load({name: file.get_tensor(name) for name in file.keys()})
    except Exception as exc:  # noqa: BLE001 - a missing, damaged or foreign file: one line naming it
        raise UserError(f"cannot load {found / weights_file}: {first_line(exc)}") from None


def load_heads(source: str | os.PathLike, model: torch.nn.Module, *,
               model_path: str | os.PathLike | None = None) -> MedusaHeads | None:
    """The heads saved in `source` (a heads folder, or a checkpoint whose `medusa/` holds them)
    for `model`, on its device and in its dtype; None when `source` is a folder without heads.

    The base model must be the one they were trained on: its fingerprint (`fingerprint`) is
    compared with the saved one, that of the checkpoint folder (`model_path`, or `source` itself
    when it is a checkpoint) when one is known, else that of `model`'s float32 parameters. A
    mismatch, other sizes or an unreadable file is a one-line UserError.
    """
    saved = _drafter_record(source, model_path, "Medusa heads", HEADS_DIR, CONFIG_FILE)
    if saved is None:
        return None
    found, model_path, record = saved
    try:
        num_heads, own = int(record["num_heads"]), bool(record["own_projection"])
        sizes = (int(record["vocab_size"]), int(record["hidden_size"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"cannot read {found / CONFIG_FILE}: {first_line(exc)}") from None
    lm_head = model.get_output_embeddings()
    if lm_head is None or tuple(lm_head.weight.shape) != sizes:
        have = None if lm_head is None else tuple(lm_head.weight.shape)
        raise UserError(f"Medusa heads in {found} are for a vocabulary x hidden size of {sizes}, the model has {have}")
    _check_heads_fingerprint(record, found, model, model_path)
    heads = MedusaHeads(lm_head, num_heads=num_heads, own_projection=own)
    _load_weights(found, WEIGHTS_FILE, heads.load_state_dict)
    heads.accuracies, heads.tree = record.get("accuracies"), record.get("tree")
    heads.meta = {k: v for k, v in record.items() if k not in ("accuracies", "tree")}
    return heads.to(device=lm_head.weight.device, dtype=lm_head.weight.dtype).eval()


def _check_heads_fingerprint(record: dict, found: Path, model: torch.nn.Module, model_path, *,
                             kind: str = "Medusa heads", command: str = "cllm medusa") -> None:
    if model_path is not None and record.get("model_fingerprint"):
        saved, have = record["model_fingerprint"], fingerprint(model_path)
    elif record.get("parameters_fingerprint"):
        if next(model.parameters()).dtype != torch.float32:  # a cast changes the parameters' hash
            log.warning("%s in %s: the base model's fingerprint is not checked for a model "
                        "in %s (pass model_path)", kind, found, next(model.parameters()).dtype)
            return
        saved, have = record["parameters_fingerprint"], fingerprint(model)
    else:
        return
    if saved != have:
        raise UserError(f"{kind} in {found} were trained on another model (fingerprint {saved}, "
                        f"this one is {have}); retrain with {command}")


def load_eagle(source: str | os.PathLike, model: torch.nn.Module, model_path: str | os.PathLike | None = None
               ) -> EagleHead | None:
    """The EAGLE head saved in `source` (a head folder, or a checkpoint whose `eagle/` holds one)
    for `model`, on its device and in its dtype, with its default tree; None when `source` is a
    folder without one. The base model's fingerprint is checked as `load_heads` checks it; a
    mismatch, other sizes or an unreadable file is a one-line UserError."""
    saved = _drafter_record(source, model_path, "EAGLE head", EAGLE_DIR, EAGLE_CONFIG_FILE)
    if saved is None:
        return None
    found, model_path, record = saved
    try:
        sizes = dict(record["sizes"])
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"cannot read {found / EAGLE_CONFIG_FILE}: {first_line(exc)}") from None
    lm_head = model.get_output_embeddings()
    have = None if lm_head is None else tuple(lm_head.weight.shape)
    if have != (sizes.get("vocab_size"), sizes.get("hidden_size")):
        raise UserError(f"the EAGLE head in {found} is for a vocabulary x hidden size of "
                        f"{(sizes.get('vocab_size'), sizes.get('hidden_size'))}, the model has {have}")
    _check_heads_fingerprint(record, found, model, model_path, kind="EAGLE head weights", command="cllm eagle")
    head = EagleHead(model.get_input_embeddings(), lm_head, sizes)
    _load_weights(found, EAGLE_WEIGHTS_FILE, head.load_saved_state)
    head.tree = record.get("tree")
    head.meta = {k: v for k, v in record.items() if k != "tree"}
    return head.to(device=lm_head.weight.device, dtype=lm_head.weight.dtype).eval()
