"""The only place that loads models and tokenizers.

- `loading`: checkpoints (refusing damaged ones), tokenizers, draft tables, Medusa and EAGLE
  heads, fingerprints;
- `gguf`: GGUF files for the llama.cpp runtime, their side folders, the export cache;
- `fast`: `load_for_decoding`, the one call for the fast path, on any runtime.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cllm.core.lazy import lazy_exports

__all__ = ["DECODE_DEFAULTS", "DECODE_DEFAULTS_LLAMACPP", "DRAFT_TABLE", "DTYPES", "EMBEDDED_TARGET", "HUB_ID",
           "MODEL_READS", "REPO_ROOT", "SHIPPED", "TOKENIZER_FILES", "TOKENIZER_READS", "DecodingModel", "fingerprint",
           "load_draft_table", "load_eagle", "load_for_decoding", "load_heads", "load_model", "load_tokenizer",
           "looks_like_hub_id", "model_config", "pad_token_id", "resolve_dtype", "resolve_model_path", "save_tokenizer",
           "tokenizer_fingerprint", "tuned_defaults", "vocab_size"]

# module -> the public names it defines, imported on first use (`cllm.core.lazy`): the names of
# `names` need no torch, so a config that names a shipped model loads none
_MODULES = {
    "cllm.models.fast": ["DecodingModel", "load_for_decoding", "tuned_defaults"],
    "cllm.models.loading": ["DTYPES", "HUB_ID", "MODEL_READS", "TOKENIZER_FILES", "TOKENIZER_READS", "fingerprint",
                            "load_draft_table", "load_eagle", "load_heads", "load_model", "load_tokenizer",
                            "looks_like_hub_id", "model_config", "pad_token_id", "resolve_dtype",
                            "resolve_model_path", "save_tokenizer", "tokenizer_fingerprint", "vocab_size"],
    "cllm.models.names": ["DECODE_DEFAULTS", "DECODE_DEFAULTS_LLAMACPP", "DRAFT_TABLE", "EMBEDDED_TARGET", "REPO_ROOT",
                          "SHIPPED"],
}

if TYPE_CHECKING:
    from cllm.models.fast import DecodingModel, load_for_decoding, tuned_defaults
    from cllm.models.loading import (
        DTYPES,
        HUB_ID,
        MODEL_READS,
        TOKENIZER_FILES,
        TOKENIZER_READS,
        fingerprint,
        load_draft_table,
        load_eagle,
        load_heads,
        load_model,
        load_tokenizer,
        looks_like_hub_id,
        model_config,
        pad_token_id,
        resolve_dtype,
        resolve_model_path,
        save_tokenizer,
        tokenizer_fingerprint,
        vocab_size,
    )
    from cllm.models.names import (
        DECODE_DEFAULTS,
        DECODE_DEFAULTS_LLAMACPP,
        DRAFT_TABLE,
        EMBEDDED_TARGET,
        REPO_ROOT,
        SHIPPED,
    )

lazy_exports(__name__, {name: module for module, names in _MODULES.items() for name in names})
