"""Shared test set-up: offline, deterministic, one torch thread (tests must not fight the
machine's two cores with each other or with a background job), and a compile cache of the
session's own (the user's is never read or written)."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the compiled forwards of this session (`cllm.runtime.lean.compiled.cache_dir`), subprocesses included
os.environ["CLLM_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="cllm-test-compiled-")
atexit.register(shutil.rmtree, os.environ["CLLM_COMPILE_CACHE"], ignore_errors=True)
# the step costs measured by subprocesses' loads (`cllm.runtime.stepcost.cache_dir`): not the user's cache
os.environ["CLLM_COSTS_DIR"] = tempfile.mkdtemp(prefix="cllm-test-costs-")
atexit.register(shutil.rmtree, os.environ["CLLM_COSTS_DIR"], ignore_errors=True)

import json  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def fixed_width(monkeypatch):
    """`load_for_decoding` (and `cllm generate`'s load) measures no step costs in a test: a timed
    curve would make the engine's width (and so its forward counts) depend on the machine's load.
    The adaptive width's tests give a runtime its `step_costs` themselves (tests/decoding/test_width.py)."""
    import cllm.models.fast

    monkeypatch.setattr(cllm.models.fast, "cached_costs", lambda *args, **kwargs: None)


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    """Eight short code openings as a JSONL prompt file (the CLI commands' tiny runs)."""
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    texts = ["def g(y):", "class B:", "import os", "while x:", "return", "if a:", "x = [", "for i in"]
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": t}) + "\n" for i, t in enumerate(texts)))
    return path
