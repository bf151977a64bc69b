"""The bench's llama.cpp methods: on the shipped target and CLLM, exact against their greedy
decoding on every prompt, several requests one after another and repeated, counted per llama.cpp
call, the GGUF exports reused while they match (marked `llamacpp`: `make test-llamacpp`); and,
without llama-cpp-python, skipped with a note, or one line when asked for by name (`make test`).
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import cllm.bench.llamacpp as llamacpp_module
from cllm.bench.config import LLAMACPP_METHODS, BenchConfig
from cllm.bench.methods import ForwardCounter, build_methods
from cllm.bench.models import BenchModels, load_models
from cllm.bench.run import run_bench
from cllm.cli import main
from cllm.core.errors import UserError
from cllm.data.tokenizer import train_tokenizer
from tests.tiny import CODE_TEXTS

SHIPPED_RUN = dict(target="stdlib-coder", cllm="stdlib-coder-cllm", draft_model="none", medusa="none",
                   prompts="humaneval", max_prompts=6, max_new_tokens=64, repeats=2, warmup=1, threads=1,
                   sweep_block_sizes=[], val_prompts=0)


@pytest.mark.llamacpp
def test_llamacpp_methods_reproduce_greedy_on_every_prompt_and_count_llama_cpp_calls(tmp_path):
    config = BenchConfig(**SHIPPED_RUN, methods=list(LLAMACPP_METHODS), gguf_dir=str(tmp_path / "gguf"),
                         out=str(tmp_path / "bench"))
    result = run_bench(config, load_models(config))
    data = result.data
    assert set(data["methods"]) == {"target_ar", "cllm_ar", *LLAMACPP_METHODS}
    for name in LLAMACPP_METHODS:
        assert data["exactness"][name]["ok"] and not data["exactness"][name]["mismatches"], name
        m = data["methods"][name]
        assert m["exact_match_own_ar"] == 1.0 and m["n_prompts"] == 6 and "llama-cpp-python" in m["engine"]
        assert sum(int(k) * v for k, v in m["accepted_histogram"].items()) == m["new_tokens"]
    for role in ("", "cllm_"):
        ar, lookup = data["methods"][f"{role}llamacpp_ar"], data["methods"][f"{role}llamacpp_lookup"]
        assert ar["forward_passes"] == ar["new_tokens"] and ar["accepted_histogram"] == {"1": ar["new_tokens"]}
        assert lookup["forward_passes"] < lookup["new_tokens"] and max(map(int, lookup["accepted_histogram"])) <= 9
        assert result.outputs[f"{role}llamacpp_ar"] == result.outputs[f"{role or 'target_'}ar"]
    files = sorted((tmp_path / "gguf").glob("*.gguf"))
    assert len(files) == 2 and all(f.name.endswith("-f32.gguf") for f in files)  # target and CLLM, once each
    stamps = [f.stat().st_mtime_ns for f in files]
    again = run_bench(BenchConfig(**{**SHIPPED_RUN, "max_prompts": 2}, methods=["llamacpp_ar"],
                                  gguf_dir=str(tmp_path / "gguf"), out=str(tmp_path / "bench2")), load_models(config))
    assert again.data["exactness"]["llamacpp_ar"]["ok"]
    assert [f.stat().st_mtime_ns for f in files] == stamps  # reused, not rewritten


@pytest.mark.llamacpp
def test_cllm_bench_runs_the_llamacpp_methods_from_the_command_line(tmp_path):
    out = tmp_path / "bench"
    args = ["bench", "--target", "stdlib-coder", "--cllm", "none", "--draft-model", "none", "--medusa", "none",
            "--prompts", "stdlib-val", "--max-prompts", "3", "--max-new-tokens", "32", "--repeats", "1",
            "--threads", "1", "--sweep-block-sizes", "", "--val-prompts", "0", "--methods",
            "llamacpp_ar,llamacpp_lookup", "--llamacpp-lookup-tokens", "4", "--gguf-dir", str(tmp_path / "g"),
            "--out", str(out)]
    assert main(args) == 0
    data = json.loads((out / "bench.json").read_text())
    assert list(data["methods"]) == ["target_ar", "llamacpp_ar", "llamacpp_lookup"]
    assert max(map(int, data["methods"]["llamacpp_lookup"]["accepted_histogram"])) <= 5  # 4 drafted + 1
    assert "llamacpp_lookup" in (out / "report.md").read_text()


def test_without_llama_cpp_the_methods_are_skipped_with_a_note_or_refused_by_name(monkeypatch):
    reason = "no llamacpp_* methods: llama-cpp-python is not usable here (ImportError; pip install 'cllm[llamacpp]')"
    monkeypatch.setattr(llamacpp_module, "unavailable", lambda: reason)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, max_position_embeddings=64)).eval()
    models = BenchModels(model, train_tokenizer(CODE_TEXTS, vocab_size=320, min_frequency=1))
    config = BenchConfig(cllm="none", draft_model="none", medusa="none", max_new_tokens=4)
    counters = {"target": ForwardCounter(model)}
    built = build_methods(config, models, counters)
    assert built and not any(m.name in LLAMACPP_METHODS for m in built)
    assert llamacpp_module.skipped_note([]) == [reason] == llamacpp_module.skipped_note(["llamacpp_ar"])
    assert llamacpp_module.skipped_note(["target_ar"]) == []  # not asked for: nothing to say
    with pytest.raises(UserError, match="llama-cpp-python"):
        build_methods(config, models, counters, ["target_ar", "llamacpp_ar"])


def test_a_projection_interpolates_the_step_cost_at_the_mean_fed_tokens_and_never_beyond():
    costs = {"1b": {"parameters": 1, "weights": "q8_0", "ms": {"1": 10.0, "4": 16.0, "8": 24.0}}}
    metrics = {"llamacpp_jacobi": {"tokens_per_forward": 3.0, "mean_fed_tokens": 6.0},
               "cllm_llamacpp_jacobi": {"tokens_per_forward": 4.0, "mean_fed_tokens": 9.0}}  # past k = 8
    llamacpp_module.project(costs, metrics)
    assert costs["1b"]["projection"] == {"llamacpp_jacobi": {"tokens_per_forward": 3.0, "mean_fed_tokens": 6.0,
                                                             "ms_per_step": 20.0, "speedup_vs_greedy": 1.5}}
    costs = {"1b": {"parameters": 1, "weights": "q8_0", "ms": {"4": 16.0, "8": 24.0}}}  # no one-token forward
    llamacpp_module.project(costs, metrics)
    assert costs["1b"]["projection"] == {}


def test_an_unknown_forward_quantize_type_is_refused_in_one_line():
    with pytest.raises(ValueError, match="--forward-quantize must be f32 or one of"):
        BenchConfig(forward_quantize="q9")


@pytest.mark.llamacpp
def test_cllm_bench_times_llama_cpp_on_another_model_shape_and_projects_the_engines_speed_there(tmp_path):
    out = tmp_path / "bench"
    args = ["bench", "--target", "stdlib-coder", "--cllm", "none", "--draft-model", "none", "--medusa", "none",
            "--prompts", "stdlib-val", "--max-prompts", "2", "--max-new-tokens", "32", "--repeats", "1",
            "--threads", "1", "--sweep-block-sizes", "", "--val-prompts", "0", "--methods", "llamacpp_jacobi",
            "--forward-tokens", "1,4,16,32", "--forward-batches", "1", "--forward-shapes", "small",
            "--forward-quantize", "q8_0", "--gguf-dir", str(tmp_path / "g"), "--out", str(out)]
    assert main(args) == 0
    data = json.loads((out / "bench.json").read_text())
    small = data["shape_cost"]["small"]
    assert small["parameters"] == sum(p.numel() for p in load_models(BenchConfig(**SHIPPED_RUN)).target.parameters())
    assert small["weights"] == "q8_0" and set(small["ms"]) == {"1", "4", "16", "32"}
    assert all(ms > 0 for ms in small["ms"].values())
    method, projected = data["methods"]["llamacpp_jacobi"], small["projection"]["llamacpp_jacobi"]
    assert projected["tokens_per_forward"] == method["tokens_per_forward"]
    assert projected["speedup_vs_greedy"] == pytest.approx(
        method["tokens_per_forward"] * small["ms"]["1"] / projected["ms_per_step"], rel=1e-2)
    assert "A projection, not a measurement" in (out / "report.md").read_text()
    assert not list((tmp_path / "g").glob("cllm-shape-*"))  # the shape's files are gone
