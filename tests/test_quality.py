"""Quality measures of free-running text and the gates of a CLLM against its target."""

import pytest

from cllm.evaluation.quality import (
    QualitySettings,
    compare_models,
    ends_in_loop,
    first_divergence,
    gates,
    gates_table,
    is_degenerate,
    pooled,
    strip_eos,
)
from tests.test_train import build_world, tiny_llama


def test_degenerate_means_one_token_ten_times_in_a_row():
    assert is_degenerate([1, 2] + [3] * 10 + [4])
    assert not is_degenerate([3] * 9 + [4] + [3] * 9)


def test_ends_in_loop_sees_short_periodic_tails_only():
    assert ends_in_loop([9, 8] + [1, 2, 3] * 8)
    assert ends_in_loop([5] * 24)
    assert not ends_in_loop(list(range(40)))
    assert not ends_in_loop([1, 2] * 5)  # too short to tell
    assert not ends_in_loop(list(range(9)) * 3)  # period 9 > 8
    assert ends_in_loop([1, 2, 3] * 6, min_length=16)  # the collector's shorter window


def test_first_divergence_and_eos_stripping():
    assert first_divergence([1, 2, 3], [1, 2, 4]) == 2
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    assert first_divergence([], [1]) == 0
    assert strip_eos([4, 5, 0, 7], 0) == ([4, 5], True)
    assert strip_eos([4, 5], 0) == ([4, 5], False)


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
