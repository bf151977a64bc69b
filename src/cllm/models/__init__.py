"""The only place that loads models and tokenizers.

- `loading`: checkpoints (refusing damaged ones), tokenizers, draft tables, Medusa and EAGLE
  heads, fingerprints;
- `gguf`: GGUF files for the llama.cpp runtime, their side folders, the export cache;
- `fast`: `load_for_decoding`, the one call for the fast path, on any runtime.
"""

from cllm.models.fast import DecodingModel, load_for_decoding, tuned_defaults
from cllm.models.loading import (
    DECODE_DEFAULTS,
    DECODE_DEFAULTS_LLAMACPP,
    DRAFT_TABLE,
    DTYPES,
    EMBEDDED_TARGET,
    HUB_ID,
    MODEL_READS,
    REPO_ROOT,
    SHIPPED,
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

__all__ = ["DECODE_DEFAULTS", "DECODE_DEFAULTS_LLAMACPP", "DRAFT_TABLE", "DTYPES", "EMBEDDED_TARGET", "HUB_ID",
           "MODEL_READS", "REPO_ROOT", "SHIPPED", "TOKENIZER_FILES", "TOKENIZER_READS", "DecodingModel", "fingerprint",
           "load_draft_table", "load_eagle", "load_for_decoding", "load_heads", "load_model", "load_tokenizer",
           "looks_like_hub_id", "model_config", "pad_token_id", "resolve_dtype", "resolve_model_path", "save_tokenizer",
           "tokenizer_fingerprint", "tuned_defaults", "vocab_size"]
