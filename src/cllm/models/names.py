"""The names of a model's things on disk that configs, commands and loaders share: the shipped
checkpoints, the files beside a checkpoint. Plain constants, no torch,
so that a command's config can name them before anything heavy is imported."""

from __future__ import annotations

from pathlib import Path

# Shipped checkpoints, addressable by short name from anywhere.
REPO_ROOT = Path(__file__).resolve().parents[3]  # src/cllm/models/names.py
EMBEDDED_TARGET = "stdlib-coder"  # the shipped target; the other shipped models are made from it
SHIPPED = {
    "stdlib-coder": REPO_ROOT / "models" / "stdlib-coder",
    "stdlib-coder-cllm": REPO_ROOT / "models" / "stdlib-coder-cllm",
    # the target fine-tuned with its Medusa heads (`cllm medusa --joint`, Medusa-2); heads in medusa/
    "stdlib-coder-medusa2": REPO_ROOT / "models" / "stdlib-coder-medusa2",
    # the draft model of speculative decoding in `cllm bench` (not shipped yet: skipped with a note)
    "stdlib-coder-draft": REPO_ROOT / "models" / "stdlib-coder-draft",
}
# A model's draft table (`cllm drafts`), relative to its checkpoint directory: a subfolder, so
# the checkpoint's own files (and `fingerprint`) do not change when a table is added.
DRAFT_TABLE = Path("drafts") / "ngram.safetensors"
# Decode settings measured for a checkpoint on one type of device (`cllm tune`), beside it.
DECODE_DEFAULTS = "decode_defaults.json"
# ... and those measured on the llama.cpp runtime (`cllm tune --runtime llamacpp`), beside them
DECODE_DEFAULTS_LLAMACPP = "decode_defaults_llamacpp.json"
