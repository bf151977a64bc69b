"""`cllm import FILE.gguf --out DIR`: a GGUF file as a checkpoint folder the torch side loads,
trains and decodes (`cllm.models.from_gguf`)."""

from __future__ import annotations

import sys

from cllm.models.from_gguf import check_import, import_checkpoint
from cllm.models.import_config import ImportConfig

Config = ImportConfig


def run(config: Config) -> int:
    """Check, read the GGUF (transformers dequantizes it, with its own progress bar), write the
    folder, and say what went where."""
    job = check_import(config)
    print(f"cllm import: reading {job.gguf} with transformers (every tensor dequantized to float32)",
          file=sys.stderr, flush=True)
    print(import_checkpoint(job).line())
    return 0
