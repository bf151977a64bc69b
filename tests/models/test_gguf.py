"""Models on the llama.cpp runtime (`cllm.models.gguf`, `load_for_decoding`): a `cllm export`
file loads with its side folder (the model's own tokenizer, draft table) and decodes as
`jacobi_decode(fast.model, ids, **fast.settings)` exactly as llama.cpp's greedy; a GGUF without
one decodes with llama.cpp's own tokenizer; a model folder is exported once into the cache; the
refusals are one line. Marked `llamacpp` where llama.cpp runs (`make test-llamacpp`).
"""

from __future__ import annotations

import pytest
import torch

from cllm.cli import main
from cllm.core.errors import UserError
from cllm.decoding import greedy_decode, jacobi_decode
from cllm.models import load_for_decoding, load_tokenizer, tuned_defaults
from cllm.models.gguf import is_gguf, side_folder

TEXT = "def add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"\n"


def test_a_gguf_is_named_by_its_suffix_and_its_side_folder_sits_beside_it(tmp_path):
    assert is_gguf("m.gguf") and is_gguf(tmp_path / "M.GGUF") and not is_gguf("stdlib-coder")
    assert side_folder(tmp_path / "m.gguf") == tmp_path / "m.cllm"
    assert side_folder("out/model.q8.gguf").name == "model.q8.cllm"


def test_settings_tuned_on_llama_cpp_apply_there_only(tmp_path):
    (tmp_path / "decode_defaults_llamacpp.json").write_text(
        '{"settings": {"block_size": 3, "recycle_budget": 9}, "device": "cpu", "runtime": "llamacpp"}')
    assert tuned_defaults(tmp_path, "cpu", runtime="llamacpp") == {"block_size": 3, "recycle_budget": 9}
    assert tuned_defaults(tmp_path, "cpu", runtime="lean") == {}
    (tmp_path / "decode_defaults_llamacpp.json").unlink()
    (tmp_path / "decode_defaults.json").write_text('{"settings": {"block_size": 5}, "device": "cpu"}')
    assert tuned_defaults(tmp_path, "cpu") == {"block_size": 5} and tuned_defaults(tmp_path, runtime="llamacpp") == {}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    folder = tmp_path_factory.mktemp("export")
    assert main(["export", "--model", "stdlib-coder", "--gguf", str(folder / "coder.gguf")]) == 0
    return folder / "coder.gguf"


@pytest.mark.llamacpp
def test_an_exported_file_loads_with_its_side_folder_and_decodes_as_llama_cpps_greedy(exported):
    fast = load_for_decoding(exported, threads=2)
    assert fast.model.name == "llamacpp" and "a GGUF file" in fast.model.describe()
    assert fast.draft_table is not None and fast.settings["draft_table"] is fast.draft_table
    want = load_tokenizer("stdlib-coder")
    assert fast.tokenizer(TEXT).input_ids == want(TEXT).input_ids
    assert fast.tokenizer.eos_token_id == want.eos_token_id
    ids = fast.tokenizer(TEXT, return_tensors="pt").input_ids
    eos = fast.tokenizer.eos_token_id
    greedy = greedy_decode(fast.model, ids, max_new_tokens=48, eos_token_id=eos).new_tokens
    out = jacobi_decode(fast.model, ids, max_new_tokens=48, eos_token_id=eos, **fast.settings)
    assert out.new_tokens == greedy and out.forward_passes < len(greedy[0])
    assert fast.tokenizer.decode(greedy[0]) == want.decode(greedy[0])


@pytest.mark.llamacpp
def test_a_gguf_without_its_side_folder_uses_llama_cpps_tokenizer(exported, tmp_path):
    alone = tmp_path / "alone.gguf"
    alone.write_bytes(exported.read_bytes())
    fast = load_for_decoding(alone, threads=2)
    want = load_tokenizer("stdlib-coder")
    assert fast.draft_table is None
    assert fast.tokenizer(TEXT).input_ids == want(TEXT).input_ids
    ids = want(TEXT).input_ids + [304, 14]
    assert fast.tokenizer.decode(ids) == want.decode(ids)
    assert fast.tokenizer(TEXT, return_tensors="pt").input_ids.shape == (1, len(want(TEXT).input_ids))


@pytest.mark.llamacpp
def test_a_model_folder_is_exported_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = load_for_decoding("stdlib-coder", runtime="llamacpp", threads=2)
    assert "exported now to" in first.model.describe() and str(tmp_path) in first.model.describe()
    again = load_for_decoding("stdlib-coder", runtime="llamacpp", threads=2)
    assert "as exported before" in again.model.describe()
    ids = torch.tensor([load_tokenizer("stdlib-coder")(TEXT).input_ids])
    assert jacobi_decode(again.model, ids, max_new_tokens=32, **again.settings).new_tokens == \
        greedy_decode(first.model, ids, max_new_tokens=32).new_tokens


@pytest.mark.llamacpp
def test_a_gguf_on_another_runtime_or_a_missing_one_is_one_line(exported, tmp_path):
    with pytest.raises(UserError, match="decodes on the llamacpp runtime only"):
        load_for_decoding(exported, runtime="lean")
    with pytest.raises(UserError, match="no GGUF file"):
        load_for_decoding(tmp_path / "none.gguf")
    with pytest.raises(UserError, match="no GGUF weights for --dtype"):
        load_for_decoding("stdlib-coder", runtime="llamacpp", dtype="int8")
