"""The bench's vLLM methods: which speculation each gets, the refusals without vLLM or
arctic-inference, the forwards counted from the engine's steps; and, with marker `vllm` (in
.venv-vllm), a bench run of all four on the shipped model, every output checked against
greedy by the bench itself."""

import importlib.util
from types import SimpleNamespace

import pytest

from cllm.bench.config import EXACT_AGAINST, METHODS, BenchConfig
from cllm.bench.models import load_models
from cllm.bench.run import run_bench
from cllm.bench.vllm import VLLM_METHODS, step_through, vllm_methods, vllm_speculation
from cllm.core.errors import UserError
from cllm.models import SHIPPED
from cllm.serving import vllm as engine

MODEL = SHIPPED["stdlib-coder"]


def test_every_vllm_method_is_a_bench_method_checked_against_greedy():
    assert set(VLLM_METHODS) <= set(METHODS)
    assert all(EXACT_AGAINST[m] == "target_ar" for m in VLLM_METHODS)


def test_each_method_gets_its_speculation(monkeypatch):
    config = BenchConfig(vllm_tokens=4)
    assert vllm_speculation("vllm_ar", config, str(MODEL)) is None
    assert vllm_speculation("vllm_ngram", config, str(MODEL)) == {"method": "ngram", "num_speculative_tokens": 4,
                                                                  "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    ours = vllm_speculation("vllm_cllm", BenchConfig(vllm_tokens=4, vllm_jacobi_tail=True), str(MODEL))
    assert ours == {"method": "custom_class", "model": "cllm.serving.vllm.CllmJacobiProposer",
                    "num_speculative_tokens": 4}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match="vllm_suffix needs arctic-inference"):
        vllm_speculation("vllm_suffix", config, str(MODEL))
    with pytest.raises(ValueError, match="--vllm-tokens"):
        BenchConfig(vllm_tokens=0)


def test_the_methods_are_built_only_when_named_and_refused_without_vllm(monkeypatch):
    assert vllm_methods(BenchConfig(), SimpleNamespace(), ["target_ar", "cllm_jacobi"]) == {}
    monkeypatch.setattr(engine, "vllm_installed", lambda: False)
    with pytest.raises(UserError, match="bench method.s. vllm_ar, vllm_cllm needs vLLM.*make vllm"):
        vllm_methods(BenchConfig(), SimpleNamespace(), ["target_ar", "vllm_cllm", "vllm_ar"])


def test_forwards_are_the_engine_steps_that_gave_the_request_tokens():
    def out(request, tokens):
        return SimpleNamespace(request_id=request, outputs=[SimpleNamespace(token_ids=tokens)])

    steps = [[out("r", [5])], [out("other", [1]), out("r", [5, 6, 7])], [], [out("r", [5, 6, 7, 8])]]
    core = SimpleNamespace(has_unfinished_requests=lambda: bool(steps), step=lambda: steps.pop(0))
    assert step_through(core, "r") == ([5, 6, 7, 8], [1, 2, 1])


@pytest.mark.vllm
def test_a_bench_of_the_vllm_methods_is_exact_on_the_shipped_model(tmp_path):
    methods = [m for m in VLLM_METHODS if m != "vllm_suffix" or importlib.util.find_spec("arctic_inference")]
    config = BenchConfig(target=str(MODEL), cllm="none", draft_model="none", medusa="none", methods=methods,
                         prompts="humaneval", max_prompts=3, max_new_tokens=48, repeats=1, warmup=0,
                         sweep_block_sizes=[], val_prompts=0, threads=1, out=str(tmp_path / "bench"))
    result = run_bench(config, load_models(config))
    assert result.violations == []
    measured = result.data["methods"]
    for name in methods:
        assert measured[name]["exact_match_own_ar"] == 1.0, name
        assert result.outputs[name] == result.outputs["target_ar"], name
    assert measured["vllm_ar"]["tokens_per_forward"] == 1.0  # every step counted: one token each
    assert measured["vllm_cllm"]["tokens_per_forward"] > 1.0
