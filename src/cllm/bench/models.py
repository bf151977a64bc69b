"""What a bench run decodes with: the target, and beside it the CLLM, the draft model, the
target's Medusa heads and EAGLE head, a Medusa-2 checkpoint (its own backbone and heads) and each
model's draft table, whichever are given and present.

The shipped CLLM, draft model and Medusa-2 checkpoint are made from the shipped target: a missing one, or one asked
for beside another target, is skipped with a note (the methods that need it then do not run).
Loading is `cllm.models`'; this module only decides what to load and records what it did.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cllm.bench.config import DRAFT_METHODS, BenchConfig
from cllm.core.errors import UserError
from cllm.decoding.draft_table import DraftTable
from cllm.models import (
    EMBEDDED_TARGET,
    SHIPPED,
    fingerprint,
    load_draft_table,
    load_eagle,
    load_heads,
    load_model,
    load_tokenizer,
    resolve_model_path,
)

ROLES = ("target", "cllm", "draft", "medusa2")  # the models a run may load (each counted and fingerprinted)


@dataclass
class BenchModels:
    """What a bench run decodes with (loaded by `load_models`, or built in memory by a test)."""

    target: torch.nn.Module
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
    EAGLE head; each model's draft table."""
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
    """role -> a hash of its weights; and of its draft table and heads, which change what it measures."""
    out = {role: fingerprint(getattr(models, role)) for role in ROLES if getattr(models, role) is not None}
    for name in ("heads", "medusa2_heads", "eagle"):  # the drafters beside the models
        if getattr(models, name) is not None:
            out[name] = fingerprint(getattr(models, name))
    for role, table in models.tables.items():
        out[f"{role}_table"] = f"{len(table)}:{json.dumps(table.meta, sort_keys=True, default=str)}"
    return out


def check_vocabularies(models: BenchModels) -> None:
    """The CLLM and the draft model must share the target's tokenizer (their vocabularies match)."""
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
            if role in models.tables:  # what its recycling method drafted from
                info[role]["draft_table"] = {"contexts": len(models.tables[role]), **models.tables[role].meta}
    if models.draft is not None:  # None = transformers' default (20 tokens, constant schedule, 0.4)
        info["draft"]["assistant_generation_config"] = {
            key: getattr(models.draft.generation_config, key, None)
            for key in ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")}
    return info
