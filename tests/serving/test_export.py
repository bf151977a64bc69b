"""`cllm export`: the GGUF file and its side folder, quantized by llama.cpp when asked, the
draft table as llama.cpp's static n-gram cache, and the output-file rule (never an input, a
user's file replaced only with --force, unique temporary names). Marked `llamacpp` where a
file is written (`gguf`) or quantized (llama-cpp-python): `make test-llamacpp`.
"""

from __future__ import annotations

import hashlib
import struct

import pytest

from cllm.cli import main
from cllm.data.tokenizer import train_tokenizer
from cllm.decoding.draft_table import DraftTable
from cllm.runtime.gguf import import_gguf, read_source
from cllm.serving.lookup_cache import lookup_cache_bytes, read_lookup_cache, write_lookup_cache
from tests.runtime.test_gguf import VOCAB, tiny_llama
from tests.tiny import CODE_TEXTS


@pytest.fixture(scope="module")
def gguf():
    return import_gguf()


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(CODE_TEXTS * 3, vocab_size=VOCAB, min_frequency=1)


def test_the_lookup_cache_bytes_are_llama_cpps_layout(tmp_path):
    """Per record: 4 int32 ids (-1 where unused), int32 count of tokens, (int32 token, int32 count)s
    (llama.cpp's common/ngram-cache.cpp, common_ngram_cache_save)."""
    data = lookup_cache_bytes({(7, 9): {3: 2}, (1, 2, 3): {4: 1, 5: 6}})
    assert data == struct.pack("<4iiiiii", 1, 2, 3, -1, 2, 4, 1, 5, 6) + struct.pack("<4iiii", 7, 9, -1, -1, 1, 3, 2)
    with pytest.raises(ValueError):
        lookup_cache_bytes({(1, 2, 3, 4, 5): {1: 1}})
    table = DraftTable((4, 3, 2), {(1, 2, 3, 4): 5, (2, 3): 4, (8, 9): 1}, {"min_count": 3})
    assert write_lookup_cache(table, tmp_path / "c.bin") == 2  # llama.cpp's static cache: 2-token keys only
    assert read_lookup_cache(tmp_path / "c.bin") == {(2, 3): {4: 3}, (8, 9): {1: 3}}


@pytest.fixture(scope="module")
def checkpoint(tokenizer, tmp_path_factory):
    """A tiny Llama saved with its tokenizer and a draft table, as `cllm export` reads them."""
    folder = tmp_path_factory.mktemp("model")
    tiny_llama().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    table = DraftTable.build([[5, 6, 7, 8, 9] * 3, [5, 6, 7, 1, 2] * 2], min_count=2, meta={"min_count": 2})
    table.save(folder / "drafts" / "ngram.safetensors")
    return folder


@pytest.mark.llamacpp
def test_cllm_export_writes_the_file_and_replaces_one_only_with_force(gguf, checkpoint, tmp_path, capsys):
    out = tmp_path / "m.gguf"
    assert main(["export", "--model", str(checkpoint), "--gguf", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out and read_source(out)["fingerprint"]
    before = out.stat().st_mtime_ns
    assert main(["export", "--model", str(checkpoint), "--gguf", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "exists" in err and "--force" in err and len(err.splitlines()) == 1
    assert out.stat().st_mtime_ns == before
    assert main(["export", "--model", str(checkpoint), "--gguf", str(out), "--force"]) == 0
    mine = tmp_path / "notes.txt"
    mine.write_text("my own file")
    assert main(["export", "--model", str(checkpoint), "--gguf", str(mine)]) == 2
    assert mine.read_text() == "my own file"


@pytest.mark.llamacpp
def test_the_draft_tables_two_token_contexts_become_llama_cpps_static_cache(gguf, checkpoint, tmp_path, capsys):
    out, cache = tmp_path / "m.gguf", tmp_path / "m.lookup"
    assert main(["export", "--model", str(checkpoint), "--gguf", str(out), "--lookup-cache", str(cache)]) == 0
    assert "static n-gram cache" in capsys.readouterr().out
    table = DraftTable.load(checkpoint / "drafts" / "ngram.safetensors")
    pairs = {ctx: token for ctx, token in table.next_token.items() if len(ctx) == 2}
    assert pairs and read_lookup_cache(cache) == {ctx: {token: 2} for ctx, token in pairs.items()}


@pytest.mark.llamacpp
def test_export_never_writes_over_the_model_it_reads_even_with_force(gguf, checkpoint, tmp_path, capsys):
    def digests() -> dict[str, str]:
        return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in checkpoint.iterdir() if f.is_file()}

    before = digests()
    link = tmp_path / "link.gguf"
    link.symlink_to(checkpoint / "model.safetensors")
    for out in (checkpoint / "model.safetensors", checkpoint / "tokenizer.json", checkpoint / "config.json",
                checkpoint / "model.gguf", link):
        assert main(["export", "--model", str(checkpoint), "--gguf", str(out), "--force"]) == 2
        err = capsys.readouterr().err.strip()
        assert "--model" in err and len(err.splitlines()) == 1, err
    assert digests() == before and not (checkpoint / "model.gguf").exists()
    both = tmp_path / "both"
    assert main(["export", "--model", str(checkpoint), "--gguf", str(both), "--lookup-cache", str(both)]) == 2
    assert "same path" in capsys.readouterr().err and not both.exists()


@pytest.mark.llamacpp
def test_export_keeps_a_users_files_of_temporary_names_and_names_the_file_a_full_disk_stopped(
        gguf, checkpoint, tmp_path, capsys, monkeypatch):
    out, cache = tmp_path / "m.gguf", tmp_path / "m.lookup"
    mine = [tmp_path / "m.gguf.tmp", tmp_path / "m.lookup.tmp", tmp_path / "m.tmp"]
    for file in mine:
        file.write_text("mine")
    assert main(["export", "--model", str(checkpoint), "--gguf", str(out), "--lookup-cache", str(cache)]) == 0
    assert all(f.read_text() == "mine" for f in mine) and read_source(out) and cache.stat().st_size
    capsys.readouterr()

    def full_disk(table, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("cllm.serving.export.write_lookup_cache", full_disk)
    assert main(["export", "--model", str(checkpoint), "--gguf", str(tmp_path / "n.gguf"), "--lookup-cache",
                 str(tmp_path / "n.lookup")]) == 2
    err = capsys.readouterr().err
    assert f"cannot write {tmp_path / 'n.lookup'}: No space left on device" in err and "n.gguf:" not in err


@pytest.mark.llamacpp
def test_the_side_folder_holds_the_tokenizer_and_the_draft_table_and_a_foreign_one_is_kept(
        gguf, checkpoint, tmp_path, capsys):
    out = tmp_path / "m.gguf"
    assert main(["export", "--model", str(checkpoint), "--gguf", str(out)]) == 0
    side = tmp_path / "m.cllm"
    assert "m.cllm" in capsys.readouterr().out
    for name in ("tokenizer.json", "tokenizer_config.json", "drafts/ngram.safetensors"):
        assert (side / name).read_bytes() == (checkpoint / name).read_bytes(), name
    assert not (side / "config.json").exists() and not (side / "model.safetensors").exists()
    other = tmp_path / "o.gguf"
    (tmp_path / "o.cllm").mkdir()
    (tmp_path / "o.cllm" / "notes.txt").write_text("mine")
    assert main(["export", "--model", str(checkpoint), "--gguf", str(other)]) == 2
    err = capsys.readouterr().err.strip()
    assert "side folder" in err and len(err.splitlines()) == 1 and not other.exists()
    assert (tmp_path / "o.cllm" / "notes.txt").read_text() == "mine"


@pytest.mark.llamacpp
def test_quantize_writes_llama_cpps_q8_0_and_refuses_an_unknown_type(gguf, checkpoint, tmp_path, capsys):
    out = tmp_path / "q.gguf"
    assert main(["export", "--model", str(checkpoint), "--gguf", str(out), "--quantize", "q8_0"]) == 0
    assert "q8_0" in capsys.readouterr().out
    reader = gguf.GGUFReader(str(out))
    types = {t.tensor_type.name for t in reader.tensors}
    assert "Q8_0" in types and read_source(out)["quantize"] == "q8_0"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.cllm", "q.gguf"]  # no temporary file left
    assert main(["export", "--model", str(checkpoint), "--gguf", str(tmp_path / "r.gguf"), "--quantize", "q9"]) == 2
    assert "--quantize must be one of" in capsys.readouterr().err
