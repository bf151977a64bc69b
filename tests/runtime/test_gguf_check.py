"""A GGUF whose header llama.cpp asserts on (an assert aborts the whole process: SIGABRT) is
refused in one line before llama.cpp reads it, by the runtime and by `cllm generate`; llama.cpp's
own refusals carry its reason. Each load of a bad file runs in a subprocess, so that a
regression fails the test instead of killing pytest. Marked `llamacpp`: the files are written
with `gguf` and loaded by llama.cpp.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from cllm.runtime.gguf import write_gguf
from tests.runtime.test_gguf import tiny_llama, tokenizer  # noqa: F401 - a fixture

pytestmark = pytest.mark.llamacpp
WAIT = 120  # seconds: a bound against hangs, never a speed requirement

OPEN = """
import sys
from cllm.runtime.llamacpp import LlamaCppRuntime
try:
    LlamaCppRuntime(sys.argv[1], threads=1, context=256)
except ValueError as exc:
    print(exc)
    sys.exit(2)
print("loaded")
"""


def run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=WAIT, env=env)


@pytest.fixture(scope="module")
def good(tokenizer, tmp_path_factory):  # noqa: F811
    return write_gguf(tiny_llama(), tokenizer, tmp_path_factory.mktemp("gguf") / "good.gguf").path


def with_value(good, folder, key: str, value, kind=None):
    """A copy of `good` with the header field `key` set to `value` (added as `kind` when absent)."""
    import gguf

    path = folder / "bad.gguf"
    reader = gguf.GGUFReader(str(good))
    if key in reader.fields:
        shutil.copyfile(good, path)
        field = gguf.GGUFReader(str(path), "r+").fields[key]
        field.parts[field.data[0]][0] = value
        return path
    writer = gguf.GGUFWriter(str(path), reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_array(name, field.contents())
        else:
            writer.add_key_value(name, field.contents(), field.types[0])
    writer.add_key_value(key, value, kind)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_shape=list(reversed(t.shape.tolist())), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def asserted_on():
    import gguf

    uint, text = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.STRING
    return [("llama.block_count", 0, None, "block_count"), ("llama.block_count", 1000, None, "block_count"),
            ("llama.block_count", 513, None, "block_count"),
            ("llama.rope.scaling.type", "bogus", text, "rope.scaling.type"),
            ("llama.expert_used_count", 2, uint, "expert"), ("llama.nextn_predict_layers", 5, uint, "nextn"),
            ("llama.expert_group_count", 2, uint, "expert_group_count")]


def test_a_good_file_passes_the_check_and_loads(good):
    from cllm.runtime.gguf_check import check_gguf

    check_gguf(good)
    result = run("-c", OPEN, str(good))
    assert result.returncode == 0 and result.stdout.strip() == "loaded", result.stderr[-2000:]


CASE_IDS = ["block_count-0", "block_count-1000", "block_count-513", "rope_scaling-bogus", "expert_used-2",
            "nextn-5", "expert_group-2"]  # asserted_on()'s cases, named without importing gguf at collection


@pytest.mark.parametrize("case", range(7), ids=CASE_IDS)
def test_header_values_llama_cpp_asserts_on_are_refused_in_one_line(good, tmp_path, case):
    key, value, kind, named = asserted_on()[case]
    bad = with_value(good, tmp_path, key, value, kind)
    result = run("-c", OPEN, str(bad))
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert len(result.stdout.strip().splitlines()) == 1 and named in result.stdout
    assert "GGML_ASSERT" not in result.stderr


@pytest.mark.parametrize("key,value,named", [("llama.block_count", 3, "blk.0..blk.1"),
                                             ("llama.context_length", 0, "context_length"),
                                             ("llama.attention.head_count_kv", 3, "head_count_kv")])
def test_header_values_that_contradict_the_model_are_refused_in_one_line(good, tmp_path, key, value, named):
    result = run("-c", OPEN, str(with_value(good, tmp_path, key, value)))
    assert result.returncode == 2 and len(result.stdout.strip().splitlines()) == 1
    assert named in result.stdout


def test_cllm_generate_on_a_file_llama_cpp_asserts_on_exits_2_with_one_line(good, tmp_path):
    bad = with_value(good, tmp_path, "llama.block_count", 1000)
    result = run("-m", "cllm.cli", "generate", "--model", str(bad), "--prompt", "def f():", "--max-new-tokens", "4")
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert len(result.stderr.strip().splitlines()) == 1 and "block_count" in result.stderr


def test_a_load_llama_cpp_refuses_says_llama_cpps_reason(good, tmp_path):
    result = run("-c", OPEN, str(with_value(good, tmp_path, "llama.feed_forward_length", 65)))
    assert result.returncode == 2 and len(result.stdout.strip().splitlines()) == 1
    assert "blk.0.ffn_gate.weight" in result.stdout and "wrong shape" in result.stdout
    (tmp_path / "magic.gguf").write_bytes(b"XXXX" + good.read_bytes()[4:])
    result = run("-c", OPEN, str(tmp_path / "magic.gguf"))
    assert result.returncode == 2 and "magic" in result.stdout
