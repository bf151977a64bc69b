"""`cllm export`: a model as one GGUF file for llama.cpp, quantized when asked, with its side
folder, and its draft table as llama.cpp's static n-gram cache when asked
(`cllm.serving.export`)."""

from __future__ import annotations

from cllm.serving.export import ExportConfig, export_gguf

Config = ExportConfig


def run(config: Config) -> int:
    """Write the file(s) and say what went where."""
    print(export_gguf(config).line())
    return 0
