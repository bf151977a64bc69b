"""The step-cost curve the adaptive width is chosen by (`cllm.runtime.stepcost`): c(1) = 1, never
falling with k, measured once per model, setting and machine and then read from the cache."""

from cllm.runtime import as_runtime, stepcost
from tests.decoding.conftest import tiny_model


def test_the_curve_starts_at_one_and_never_falls():
    costs = stepcost.measure(as_runtime(tiny_model("llama")), ks=(1, 2, 4, 8), prefix=16, rounds=2)
    assert len(costs) == 8 and costs[0] == 1.0
    assert all(b >= a for a, b in zip(costs, costs[1:]))


def test_costs_are_measured_once_then_read_from_the_cache_and_again_for_another_model(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(stepcost, "measure", lambda runtime: calls.append(1) or (1.0, 1.5, 2.0))
    runtime = as_runtime(tiny_model("llama"))
    assert stepcost.cached_costs(runtime, "model-a", "2 threads", folder=tmp_path) == (1.0, 1.5, 2.0)
    assert stepcost.cached_costs(runtime, "model-a", "2 threads", folder=tmp_path) == (1.0, 1.5, 2.0)
    assert len(calls) == 1
    stepcost.cached_costs(runtime, "model-b", "2 threads", folder=tmp_path)  # a changed file: measured again
    stepcost.cached_costs(runtime, "model-a", "1 thread", folder=tmp_path)
    assert len(calls) == 3


def test_a_damaged_cache_file_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setattr(stepcost, "measure", lambda runtime: (1.0, 3.0))
    runtime = as_runtime(tiny_model("llama"))
    stepcost.cached_costs(runtime, "m", "s", folder=tmp_path)
    for file in tmp_path.iterdir():
        file.write_text("{not json")
    assert stepcost.cached_costs(runtime, "m", "s", folder=tmp_path) == (1.0, 3.0)
