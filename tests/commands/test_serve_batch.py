"""`cllm serve` says how many requests it batches as the runtime holds them: on llama.cpp, whose
server runtime holds a stream per row (`max_rows`), the smaller of that and --max-batch-size.
Marked `llamacpp`: the model is exported to GGUF and served on llama.cpp."""

from __future__ import annotations

import re

import pytest

from cllm.cli import main
from tests.serving.test_export import checkpoint, gguf, tokenizer  # noqa: F401 - fixtures

pytestmark = pytest.mark.llamacpp


def test_serve_on_llama_cpp_says_the_rows_its_runtime_batches(checkpoint, tmp_path, capsys, monkeypatch):  # noqa: F811
    out = tmp_path / "m.gguf"
    assert main(["export", "--model", str(checkpoint), "--gguf", str(out)]) == 0
    held = {}

    def serve_app(bound, config):  # instead of serving: what the runtime holds, then close
        held["rows"] = bound.served.model.max_rows
        bound.app.state.service.scheduler.stop(5.0)
        bound.sock.close()

    monkeypatch.setattr("cllm.commands.serve.serve_app", serve_app)
    capsys.readouterr()
    assert main(["serve", "--model", str(out), "--port", "0", "--max-batch-size", "64", "--threads", "1"]) == 0
    said = re.search(r"batches up to (\d+) requests", capsys.readouterr().err)
    assert said and held["rows"] < 64 and int(said.group(1)) == held["rows"]
