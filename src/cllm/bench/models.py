"""What a bench run decodes with: the target, and beside it the CLLM, the draft model, the
target's Medusa heads and EAGLE head, a Medusa-2 checkpoint (its own backbone and heads) and each
model's draft table, whichever are given and present.

The shipped CLLM, draft model and Medusa-2 checkpoint are made from the shipped target: a missing one, or one asked
for beside another target, is skipped with a note (the methods that need it then do not run).
A GGUF target (and CLLM) is no torch model: each file opens on the llama.cpp runtime as given
(`load_gguf_models`), and only the methods that run there are measured (`GGUF_METHODS`).
Loading is `cllm.models`'; this module only decides what to load and records what it did.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cllm.bench.config import DRAFT_METHODS, GGUF_METHODS, METHODS, BenchConfig
from cllm.bench.llamacpp import unavailable
from cllm.core.errors import UserError
from cllm.decoding.draft_table import DraftTable
from cllm.models import (
    EMBEDDED_TARGET,
    SHIPPED,
    DecodingModel,
    fingerprint,
    load_draft_table,
    load_eagle,
    load_for_decoding,
    load_heads,
    load_model,
    load_tokenizer,
    resolve_model_path,
)
from cllm.models.gguf import is_gguf
from cllm.runtime.gguf import import_gguf
from cllm.runtime.llamacpp import LlamaCppRuntime
from cllm.runtime.llamacpp_files import LlamaCppTokenizer

ROLES = ("target", "cllm", "draft", "medusa2")  # the models a run may load (each counted and fingerprinted)


@dataclass
class BenchModels:
    """What a bench run decodes with (loaded by `load_models`, or built in memory by a test)."""

    target: torch.nn.Module | None  # None: a GGUF target (`gguf`)
    tokenizer: Any
    cllm: torch.nn.Module | None = None
    draft: torch.nn.Module | None = None
    heads: torch.nn.Module | None = None  # the target's Medusa heads (`cllm.modeling.heads`)
    eagle: torch.nn.Module | None = None  # the target's EAGLE head (`cllm.modeling.eagle`)
    medusa2: torch.nn.Module | None = None  # a Medusa-2 backbone (`cllm medusa --joint`) ...
    medusa2_heads: torch.nn.Module | None = None  # ... and its heads
    names: dict[str, str] = field(default_factory=dict)  # role -> what was loaded
    tables: dict[str, DraftTable] = field(default_factory=dict)  # role -> its draft table (`cllm drafts`)
    notes: list[str] = field(default_factory=list)  # what was skipped, and why
    # role -> its GGUF file on the llama.cpp runtime, with the tokenizer, draft table and decode
    # setting `load_for_decoding` gives it (a GGUF target and CLLM: no torch weights)
    gguf: dict[str, DecodingModel] = field(default_factory=dict)

    def verifier(self, role: str) -> torch.nn.Module | LlamaCppRuntime | None:
        """What decodes as `role`: its torch model, or its GGUF file's runtime; None if not given."""
        return self.gguf[role].model if role in self.gguf else getattr(self, role)


def model_path(name: str) -> Path:
    """Where a shipped name or a local folder points (a hub id points nowhere that exists)."""
    return Path(SHIPPED.get(name, Path(name).expanduser()))


def is_shipped_family(name: str) -> bool:
    """Whether `name` is one of the shipped models (by name or by their folder): the stdlib domain."""
    path = model_path(name).resolve()
    return any(path == shipped.resolve() for shipped in SHIPPED.values())


def load_models(config: BenchConfig) -> BenchModels:
    """The target and tokenizer; the CLLM, the draft model and the Medusa-2 checkpoint unless
    off, absent or made for another target (a note says which); the target's Medusa heads and
    EAGLE head; each model's draft table. A GGUF target or CLLM: `load_gguf_models`."""
    if is_gguf(config.target) or (config.cllm is not None and is_gguf(config.cllm)):
        return load_gguf_models(config)
    kw = dict(dtype=config.dtype, device=config.device)
    models = BenchModels(load_model(config.target, **kw), load_tokenizer(config.target),
                         names={"target": config.target})
    if config.cllm is not None and not _companion_skipped(models, config, config.cllm, "CLLM",
                                                          "cllm_* methods (target-only run)"):
        models.cllm, models.names["cllm"] = load_model(config.cllm, **kw), config.cllm
    if config.draft_model is not None and not _companion_skipped(models, config, config.draft_model, "draft model",
                                                                 ", ".join(DRAFT_METHODS)):
        models.draft, models.names["draft"] = load_model(config.draft_model, **kw), config.draft_model
    if config.medusa2 is not None and not _companion_skipped(models, config, config.medusa2, "Medusa-2 checkpoint",
                                                             "medusa2 or medusa2_ar"):
        _load_medusa2(models, config, kw)
    if config.medusa is not None:
        _load_drafter(models, config, "medusa", load_heads, "Medusa heads", "cllm medusa")
    if config.eagle is not None:
        _load_drafter(models, config, "eagle", load_eagle, "EAGLE head", "cllm eagle")
    for role in ("target", "cllm"):
        table = load_draft_table(models.names[role], config.draft_tables) if role in models.names else None
        if table is not None:
            models.tables[role] = table
    return models


def load_gguf_models(config: BenchConfig) -> BenchModels:
    """A GGUF target, and a GGUF CLLM unless off, absent or made for another target: each file
    on the llama.cpp runtime as given (`load_for_decoding`: the tokenizer, draft table and
    default decode setting of the side folder `cllm export` writes, else llama.cpp's tokenizer),
    at the bench's threads. Without torch weights there is no draft model, heads or Medusa-2
    checkpoint: a note names the methods left out."""
    if not is_gguf(config.target):
        raise UserError(f"--cllm {config.cllm} is a GGUF file: the target must be one too (`cllm export --gguf` "
                        "writes one), or give the CLLM's checkpoint folder")
    torch_only = [m for m in config.methods if m not in GGUF_METHODS]
    if torch_only:
        raise UserError(f"method(s) {', '.join(torch_only)} need torch weights, and --target {config.target} is a "
                        f"GGUF file (`cllm import` makes a checkpoint folder of it); on a GGUF: "
                        f"{', '.join(GGUF_METHODS)}")
    reason = unavailable()
    if reason is not None:
        raise UserError(f"--target {config.target} is a GGUF file, which only llama.cpp decodes: "
                        f"{reason.removeprefix('no llamacpp_* methods: ')}")
    kw = dict(threads=config.threads, draft_table=config.draft_tables, runtime=config.runtime)
    target = load_for_decoding(config.target, **kw)
    if config.forward_shapes and isinstance(target.tokenizer, LlamaCppTokenizer):
        raise UserError(f"--forward-shapes exports random models with the target's tokenizer files, and "
                        f"{config.target} has none beside it (the side folder `cllm export` writes)")
    models = BenchModels(None, target.tokenizer, names={"target": config.target}, gguf={"target": target})
    if config.cllm is not None and not _companion_skipped(models, config, config.cllm, "CLLM",
                                                          "cllm_* methods (target-only run)"):
        if not is_gguf(config.cllm):
            raise UserError(f"--cllm {config.cllm}: beside a GGUF target the CLLM must be a GGUF file too "
                            "(`cllm export --gguf` writes one)")
        models.gguf["cllm"], models.names["cllm"] = load_for_decoding(config.cllm, **kw), config.cllm
    for role, fast in models.gguf.items():
        if fast.draft_table is not None:
            models.tables[role] = fast.draft_table
    left_out = [m for m in METHODS if m not in GGUF_METHODS and not m.startswith("vllm_")
                and ("cllm" in models.gguf or not m.startswith("cllm_"))]
    models.notes.append(f"--target {config.target} is a GGUF file, without torch weights: left out "
                        f"{', '.join(left_out)} (they decode the transformers model: `cllm import` makes a checkpoint "
                        "folder of the file), each model's validation loss, the block-size sweep and the trajectory "
                        "picture")
    settings = {k: v for k, v in target.settings.items() if k != "draft_table"}
    models.notes.append("on a GGUF file llama.cpp's own greedy decoding (llamacpp_ar) is the reference: every speedup "
                        "and exact match is measured against it; our engine (llamacpp_jacobi) decodes at the "
                        f"setting it takes by default for the file ({_setting_text(settings)}), not --block-size "
                        "and the other engine options")
    return models


def _setting_text(settings: dict[str, Any]) -> str:
    return ", ".join(f"{k.replace('_', '-')} {v}" for k, v in settings.items())


def _companion_skipped(models: BenchModels, config: BenchConfig, name: str, what: str, skipped: str) -> bool:
    """A shipped companion (CLLM, draft model) that is absent, or that goes with the shipped target
    while another one is measured: noted, and not loaded."""
    if name in SHIPPED and not (SHIPPED[name] / "config.json").is_file():
        models.notes.append(f"shipped {what} {name!r} not present: no {skipped}")
        return True
    foreign = model_path(config.target).resolve() != SHIPPED[EMBEDDED_TARGET].resolve()
    if name in SHIPPED and foreign:
        models.notes.append(f"the shipped {what} {name!r} goes with the shipped target {EMBEDDED_TARGET!r}, "
                            f"not {config.target!r}: no {skipped}")
        return True
    return False


def _load_drafter(models: BenchModels, config: BenchConfig, option: str, loader, what: str, trainer: str) -> None:
    """The target's Medusa heads or EAGLE head (`option`: medusa, eagle): its own (auto, when it
    has them) or the folder named, where they must be."""
    target_dir = resolve_model_path(config.target)
    named = getattr(config, option)
    source = target_dir if named == "auto" else named
    drafter = loader(source, models.target, model_path=target_dir)
    setattr(models, "heads" if option == "medusa" else option, drafter)
    if drafter is not None:
        models.names[option] = str(source)
    elif named != "auto":
        raise UserError(f"--{option} {named}: no {what} there (`{trainer}` trains them)")


def _load_medusa2(models: BenchModels, config: BenchConfig, kw: dict[str, Any]) -> None:
    """A Medusa-2 checkpoint: its backbone, and the heads saved inside it (checked against it)."""
    path = resolve_model_path(config.medusa2)
    model = load_model(config.medusa2, **kw)
    heads = load_heads(path, model, model_path=path)
    if heads is None:
        raise UserError(f"--medusa2 {config.medusa2}: no Medusa heads in it (`cllm medusa --joint --out DIR` "
                        "makes a Medusa-2 checkpoint)")
    models.medusa2, models.medusa2_heads, models.names["medusa2"] = model, heads, config.medusa2


def fingerprints(models: BenchModels) -> dict[str, str]:
    """role -> a hash of its weights (a GGUF: of its file); and of its draft table and heads,
    which change what it measures."""
    out = {role: fingerprint(getattr(models, role)) for role in ROLES if getattr(models, role) is not None}
    out |= {role: file_fingerprint(fast.model.path) for role, fast in models.gguf.items()}
    for name in ("heads", "medusa2_heads", "eagle"):  # the drafters beside the models
        if getattr(models, name) is not None:
            out[name] = fingerprint(getattr(models, name))
    for role, table in models.tables.items():
        out[f"{role}_table"] = f"{len(table)}:{json.dumps(table.meta, sort_keys=True, default=str)}"
    return out


def file_fingerprint(path: Path) -> str:
    """A short content hash of a file (a GGUF's weights and metadata)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def check_vocabularies(models: BenchModels) -> None:
    """The CLLM and the draft model must share the target's tokenizer (their vocabularies match)."""
    if models.target is None:  # GGUF files: the vocabularies llama.cpp reads
        if "cllm" in models.gguf and models.gguf["cllm"].model.vocab_size != models.gguf["target"].model.vocab_size:
            raise UserError("the CLLM's vocabulary differs from the target's: it must share the tokenizer")
        return
    vocab = models.target.get_output_embeddings().weight.shape[0]
    names = {"cllm": "CLLM", "draft": "draft model", "medusa2": "Medusa-2 checkpoint"}
    for role, name in names.items():
        model = getattr(models, role)
        if model is not None and model.get_output_embeddings().weight.shape[0] != vocab:
            raise UserError(f"the {name}'s vocabulary differs from the target's: it must share the tokenizer")


def model_info(models: BenchModels, prints: dict[str, str], val: dict[str, float | None]) -> dict[str, dict]:
    """The JSON's `models`: per role its name, fingerprint, size, validation loss, draft table."""
    info = {}
    for role in ROLES:
        model = getattr(models, role)
        if model is not None:
            info[role] = {"name": models.names.get(role, "<in memory>"), "fingerprint": prints[role],
                          "parameters": sum(t.numel() for t in model.parameters()), "val_loss": val.get(role)}
        elif role in models.gguf:
            runtime = models.gguf[role].model
            info[role] = {"name": models.names[role], "fingerprint": prints[role],
                          "parameters": gguf_parameters(runtime.path), "val_loss": None, "weights": runtime.ftype}
        if role in info and role in models.tables:  # what its recycling method drafted from
            info[role]["draft_table"] = {"contexts": len(models.tables[role]), **models.tables[role].meta}
    if models.draft is not None:  # None = transformers' default (20 tokens, constant schedule, 0.4)
        info["draft"]["assistant_generation_config"] = {
            key: getattr(models.draft.generation_config, key, None)
            for key in ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")}
    return info


def gguf_parameters(path: Path) -> int:
    """The parameters of a GGUF file's tensors (quantized or not), from its header."""
    return sum(int(t.n_elements) for t in import_gguf().GGUFReader(str(path)).tensors)
