"""The gates of a CLLM against its target, and the comparison they read."""

import pytest

from cllm.evaluation.gates import QualitySettings, compare_models, gates, gates_table, measures_line, pooled
from tests.training.test_train import build_world, tiny_llama


def fake_result(**cllm) -> dict:
    def model(**kw):
        base = dict(prompts=10, parse_rate=0.5, degenerate_rate=0.0, looping_rate=0.2,
                    tpf_not_looping={"16": 1.05, "32": 1.05})
        return base | kw

    return {"sets": {"a": {"target": model(), "cllm": model(**cllm)}}, "val_loss": {"target": 3.0, "cllm": 3.05}}


def test_gates_pass_and_fail_at_their_bars():
    ok = fake_result(looping_rate=0.24, degenerate_rate=0.03, parse_rate=0.48, tpf_not_looping={"16": 2.0, "32": 2.3})
    assert all(g.passed for g in gates(ok, "cllm"))
    bad = fake_result(looping_rate=0.26, degenerate_rate=0.04, parse_rate=0.46, tpf_not_looping={"16": 1.9, "32": 2.2})
    bad["val_loss"]["cllm"] = 3.1
    assert not any(g.passed for g in gates(bad, "cllm"))
    assert [g.name for g in gates(bad, "cllm")] == ["looping", "degenerate", "parses", "validation loss",
                                                   "TPF n=16, not looping", "TPF n=32, not looping"]


def test_pooling_weights_each_prompt_set_by_its_prompts():
    def model(prompts, looping, tpf, divergence):
        return dict(prompts=prompts, parse_rate=0.5, degenerate_rate=0.0, looping_rate=looping, target_nll=0.6,
                    first_divergence=divergence, token_agreement=None if divergence is None else 0.1,
                    tpf={"16": tpf}, tpf_not_looping={"16": tpf}, jacobi_exact={"16": 1.0})

    result = {"settings": {"block_sizes": [16]}, "val_loss": {},
              "sets": {"big": {"target": model(30, 0.1, 1.0, None), "cllm": model(30, 0.2, 2.0, 10.0)},
                       "small": {"target": model(10, 0.5, 1.0, None), "cllm": model(10, 0.6, 3.0, 2.0)}}}
    assert pooled(result, "cllm", "looping_rate") == pytest.approx(0.3)
    assert pooled(result, "cllm", "tpf_not_looping", "16") == pytest.approx(2.25)
    assert pooled(result, "target", "first_divergence") is None
    table = gates_table(result, ["target", "cllm"])
    assert "| looping | all sets (weighted by prompts) | 0.200 | 0.300 |" in table
    assert "| first divergence from target | all sets (weighted by prompts) | - | 8.000 |" in table
    tpf_row = "| Jacobi TPF n=16, all / not looping | all sets (weighted by prompts) | 1.00 / 1.00 | 2.25 / 2.25 |"
    assert tpf_row in table
    # one set: nothing to pool
    del result["sets"]["small"]
    assert "all sets" not in gates_table(result, ["target", "cllm"])
    assert {g.name: g.value for g in gates(result, "cllm")}["TPF n=16, not looping"] == pytest.approx(2.0)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return build_world(tmp_path_factory.mktemp("quality"))


def test_compare_models_measures_each_model_against_the_target(world):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(world.target).eval()
    models = {"target": target, "same": target, "random": tiny_llama(9).eval()}
    settings = QualitySettings(prompt_sets={str(world.val_prompts): 8}, block_sizes=[4, 8], max_new_tokens=16,
                               val_loss=False)
    result = compare_models(models, world.tokenizer, settings, pad_id=0)
    per_model = result["sets"][str(world.val_prompts)]
    same, rand = per_model["same"], per_model["random"]
    # the target judged against itself: identical text, its own NLL
    assert same["same_as_target"] == 1.0 and same["token_agreement"] == 1.0
    assert same["target_nll"] == pytest.approx(per_model["target"]["target_nll"])
    assert same["first_divergence"] == 16
    # a random model: other text, which the target finds far less likely
    assert rand["token_agreement"] < 0.5 and rand["target_nll"] > same["target_nll"] + 1
    for m in per_model.values():
        assert m["prompts"] == 8 and set(m["tpf"]) == {"4", "8"}
        assert all(v == 1.0 for v in m["jacobi_exact"].values())  # Jacobi reproduced greedy
        assert all(1.0 <= v <= 8 for v in m["tpf"].values())
    assert "| looping |" in gates_table(result, list(models))


def test_a_set_that_is_not_python_has_no_parse_gate_and_says_so():
    result = fake_result(looping_rate=0.2)
    for per_model in result["sets"]["a"].values():
        per_model["parse_rate"] = None
    assert "parses" not in [g.name for g in gates(result, "cllm")]
    line = measures_line(result)
    assert "a (10 prompts, not Python, no parse rate)" in line and "stdlib-val loss" in line
    # beside a Python set, the parse gate reads the Python set alone
    result["sets"]["py"] = {"target": dict(result["sets"]["a"]["target"], parse_rate=0.5),
                            "cllm": dict(result["sets"]["a"]["cllm"], parse_rate=0.4)}
    parse = {g.name: g for g in gates(result, "cllm")}["parses"]
    assert parse.value == pytest.approx(0.4) and not parse.passed


def test_failed_gates_are_named_with_their_numbers_and_one_advice_line_each():
    from cllm.evaluation.gates import gates_verdict

    mixed = fake_result(looping_rate=0.4, tpf_not_looping={"16": 1.5, "32": 2.5})
    results = gates(mixed, "cllm")
    lines = gates_verdict([g.__dict__ for g in results])  # as evaluation.json stores them
    failed = [g for g in results if not g.passed]
    assert [g.name for g in failed] == ["looping", "TPF n=16, not looping"]
    assert lines[0].startswith(f"gates: 2 of {len(results)} failed (looping, TPF n=16, not looping)")
    assert len(lines) == 3 and lines[1].startswith("  looping 0.400, needs <= 0.250") and "--lr" in lines[1]
    assert lines[2].startswith("  TPF n=16, not looping 1.500, needs >= 2.0") and "--block-size" in lines[2]
    ok = fake_result(tpf_not_looping={"16": 2.0, "32": 2.3})
    assert gates_verdict(gates(ok, "cllm")) == [f"gates: all {len(gates(ok, 'cllm'))} passed"]
