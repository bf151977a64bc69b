"""`cllm export`: a model as one GGUF file for llama.cpp (`cllm.serving.gguf`), and its draft
table as llama.cpp's static n-gram cache when asked (`cllm.serving.lookup_cache`)."""

from __future__ import annotations

from cllm.serving.gguf import ExportConfig, export_gguf

Config = ExportConfig


def run(config: Config) -> int:
    """Write the file(s) and say what went where."""
    print(export_gguf(config).line())
    return 0
