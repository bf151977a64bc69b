"""Named model shapes (Llama architecture), as transformers `LlamaConfig` keywords: one table for
`cllm profile` (step cost, `cllm.profiling.steptime`) and the memory plan (`cllm.training.memory`). Pure data.

small = the embedded target `models/stdlib-coder`; 1b / 3b ~ Llama-3.2-1B / 3B (grouped-query
attention, 128k vocabulary, tied embeddings); 7b / 13b = Llama-2-7B / 13B.
"""

from __future__ import annotations

from typing import Any

LLAMA_SHAPES: dict[str, dict[str, Any]] = {
    "small": dict(vocab_size=8192, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True, rope_theta=500000.0),
    "3b": dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
               num_attention_heads=24, num_key_value_heads=8, tie_word_embeddings=True, rope_theta=500000.0),
    "7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=32, tie_word_embeddings=False),
    "13b": dict(vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                num_attention_heads=40, num_key_value_heads=40, tie_word_embeddings=False),
}  # fmt: skip
