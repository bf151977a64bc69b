"""`cllm bench --model FILE.gguf`: a GGUF target (and CLLM) is benched as given, no export, on the
methods that run without torch weights: llama.cpp's greedy decoding (`llamacpp_ar`, the reference
of every speedup and exact match) and prompt lookup, our greedy decoder and our engine at its
default setting on the llama.cpp runtime; the methods that need the torch model are named in a
note as left out, and refused in one line when asked for. Tiny GGUF files are written here
(`write_gguf`); llama.cpp runs them, so the tests that decode are marked `llamacpp`.
"""

from __future__ import annotations

import json

import pytest

from cllm.bench.config import GGUF_METHODS, LLAMACPP_METHODS
from cllm.cli import main
from cllm.data.tokenizer import train_tokenizer
from cllm.decoding.settings import RECOMMENDED
from cllm.runtime.gguf import write_gguf
from tests.runtime.test_gguf import VOCAB, tiny_llama
from tests.tiny import CODE_TEXTS

SMALL = ["--prompts", "humaneval", "--max-prompts", "2", "--max-new-tokens", "12", "--repeats", "1", "--warmup", "0",
         "--threads", "1", "--forward-tokens", "1", "--forward-batches", "1"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny target and a tiny 'CLLM' (another seed) as f32 GGUF files, no side folders: each
    decodes with llama.cpp's own tokenizer."""
    tokenizer = train_tokenizer(CODE_TEXTS * 3, vocab_size=VOCAB, min_frequency=1)
    folder = tmp_path_factory.mktemp("gguf")
    return {role: write_gguf(tiny_llama(seed), tokenizer, folder / f"{role}.gguf").path
            for role, seed in (("target", 0), ("cllm", 1))}


@pytest.mark.llamacpp
def test_a_gguf_target_and_cllm_are_benched_as_given_against_llama_cpps_greedy_decoding(files, tmp_path):
    out = tmp_path / "bench"
    assert main(["bench", "--model", str(files["target"]), "--cllm", str(files["cllm"]), *SMALL,
                 "--gguf-dir", str(tmp_path / "exports"), "--out", str(out)]) == 0
    data = json.loads((out / "bench.json").read_text())
    assert {"config", "machine", "methods", "exactness", "notes"} <= data.keys()
    assert set(data["methods"]) == {"target_ar", "cllm_ar", *LLAMACPP_METHODS} == set(GGUF_METHODS)
    assert data["reference"] == "llamacpp_ar" and data["methods"]["llamacpp_ar"]["speedup_vs_ar"] == 1.0
    for name, m in data["methods"].items():  # f32 weights and cache: every method is llama.cpp's greedy output
        assert {"tokens_per_second", "tokens_per_forward", "speedup_vs_ar"} <= m.keys(), name
        assert m["exact_match_own_ar"] == 1.0 and m["n_prompts"] == 2, name
    against = {name: e["against"] for name, e in data["exactness"].items()}
    assert against == {"target_ar": "llamacpp_ar", "llamacpp_lookup": "llamacpp_ar", "llamacpp_jacobi": "llamacpp_ar",
                       "cllm_ar": "cllm_llamacpp_ar", "cllm_llamacpp_lookup": "cllm_llamacpp_ar",
                       "cllm_llamacpp_jacobi": "cllm_llamacpp_ar"}
    assert data["exactness_enforced"] and all(e["ok"] for e in data["exactness"].values())
    ar = data["methods"]["target_ar"]
    assert ar["forward_passes"] == ar["new_tokens"] == data["methods"]["llamacpp_ar"]["new_tokens"]
    engine = data["methods"]["llamacpp_jacobi"]
    assert engine["engine_settings"] == dict(RECOMMENDED) and "target.gguf" in engine["engine"]
    assert data["models"]["target"]["parameters"] == sum(p.numel() for p in tiny_llama().parameters())
    assert data["machine"]["dtype"] == "GGUF all F32" and not data["sweep"]
    assert not (tmp_path / "exports").exists()  # decoded as given: nothing exported
    left_out = next(n for n in data["notes"] if "left out" in n)
    assert all(m in left_out for m in ("hf_generate", "target_lookahead", "medusa", "eagle", "assisted"))
    assert "hf_generate" in (out / "report.md").read_text()


@pytest.mark.llamacpp
def test_a_gguf_bench_adds_its_reference_and_refuses_torch_methods_in_one_line(files, tmp_path, capsys):
    out = tmp_path / "bench"
    assert main(["bench", "--target", str(files["target"]), "--cllm", "none", *SMALL, "--methods", "llamacpp_jacobi",
                 "--out", str(out)]) == 0
    data = json.loads((out / "bench.json").read_text())
    assert list(data["methods"]) == ["llamacpp_ar", "llamacpp_jacobi"]
    assert any(n.startswith("added llamacpp_ar") for n in data["notes"])
    capsys.readouterr()
    assert main(["bench", "--model", str(files["target"]), "--cllm", "none", *SMALL, "--methods", "hf_generate",
                 "--out", str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "hf_generate" in err and "GGUF" in err and "Traceback" not in err


def test_a_gguf_cllm_beside_a_checkpoint_target_is_refused_in_one_line(tmp_path, capsys):
    cllm = tmp_path / "cllm.gguf"
    cllm.write_bytes(b"GGUF")  # never read: refused before anything loads
    assert main(["bench", "--target", "stdlib-coder", "--cllm", str(cllm), "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--cllm" in err and "GGUF" in err
