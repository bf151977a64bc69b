"""The choice among the lean runtime's float32 CPU layouts (`cllm.runtime.lean.cpu_paths`): the plan
made from timings, the timing itself (on a clock that charges each path a known cost), and
decoding exactly when a plan switches path from one width to the next."""

import pytest
import torch
import transformers as tf

from cllm import greedy_decode, jacobi_decode
from cllm.runtime import open_runtime
from cllm.runtime.lean import LeanRuntime, cpu_paths
from cllm.runtime.lean.cpu_paths import Plan
from tests.decoding.conftest import VOCAB, random_prompt

WIDTHS = (1, 2, 4, 8)


def times(**per_path):
    return {path: dict(zip(WIDTHS, ms, strict=True)) for path, ms in per_path.items()}


def test_the_plan_takes_the_fastest_path_overall_and_another_only_where_it_is_clearly_faster():
    plan = Plan.from_times(times(packed=[2.0, 2.0, 2.0, 2.0], gemm=[1.0, 1.95, 2.5, 3.0], rows=[1.5, 1.5, 1.5, 2.1]))
    assert plan.paths == ("gemm", "rows", "rows", "rows")  # rows is fastest overall; gemm 33% faster at 1
    assert [plan.path(t) for t in (1, 2, 3, 4, 5, 8, 9, 500)] == ["gemm", "rows", "rows", "rows", "rows", "rows",
                                                                 "rows", "rows"]
    assert plan.describe() == "gemm at 1, rows at 2+ fed tokens"
    close = Plan.from_times(times(packed=[2.0, 2.0, 2.0, 2.0], rows=[1.9, 2.1, 1.85, 2.05]))
    assert close.paths == ("rows",) * 4  # packed is never 10% faster: no switching on noise
    split = Plan.from_times(times(packed=[3.0, 3.0, 1.0, 1.0], rows=[1.0, 1.0, 3.0, 3.0]))
    assert split.describe() == "rows at 1-2, packed at 3+ fed tokens"
    assert [split.path(t) for t in (1, 2, 3, 4, 9)] == ["rows", "rows", "packed", "packed", "packed"]


def test_an_unknown_path_is_refused():
    with pytest.raises(ValueError, match="unknown CPU forward 'fast'"):
        LeanRuntime(small_llama(), path="fast")


def small_llama(seed=3):
    torch.manual_seed(seed)
    with torch.inference_mode(False):
        return tf.LlamaForCausalLM(tf.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, initializer_range=0.2, bos_token_id=0, eos_token_id=1, pad_token_id=0)).eval()


def test_measure_times_every_path_at_every_width_and_leaves_no_trace():
    """A clock that charges each forward what its path costs at its width (rows cheap at 1-2
    tokens, gemm at 4-8): the plan follows the charges, and the runner's cache is left alone."""
    runner = LeanRuntime(small_llama()).runner
    cost = {"packed": [5, 5, 5, 5], "gemm": [9, 9, 1, 1], "rows": [1, 1, 9, 9]}
    fed, paths = [], []
    forward = runner.forward

    def noting(kv, input_ids, *args, **kwargs):  # the width and the path of every forward measured
        fed.append(input_ids.shape[1])
        paths.append(runner.path)
        return forward(kv, input_ids, *args, **kwargs)

    runner.forward = noting
    now, calls = [0.0], [0]

    def clock():
        calls[0] += 1
        if calls[0] % 2 == 0:  # a forward's end: charge it what its path costs at its width
            now[0] += cost[paths[-1]][WIDTHS.index(fed[-1])] / 1000
        return now[0]

    plan = cpu_paths.measure(runner, ["packed", "gemm", "rows"], widths=WIDTHS, prefix=8, rounds=2, clock=clock)
    assert plan.paths == ("rows", "rows", "gemm", "gemm")
    assert plan.ms == {p: pytest.approx(cost[p]) for p in cost}
    assert sorted(fed[1:]) == sorted(WIDTHS * 3 * (2 + 1) * cpu_paths.REPEATS)  # after the prefill: every one
    assert runner.path is None  # the runner takes its plan again


@pytest.mark.parametrize("settings", [dict(block_size=1), dict(block_size=4), dict(block_size=16),
                                      dict(block_size=4, recycle=8, recycle_budget=24)])
@torch.inference_mode()
def test_decoding_is_exact_when_the_plan_switches_path_from_width_to_width(settings):
    model = small_llama(4)
    runtime = LeanRuntime(model)
    ids = random_prompt(11, 9)
    expected = greedy_decode(open_runtime(model, "transformers"), ids, max_new_tokens=40).new_tokens
    widths = (1, 2, 4, 8, 16, 32)
    runtime.runner.plan = Plan(widths, ("rows", "gemm", "packed", "rows", "gemm", "packed"), {})
    runtime.runner.head_plan = Plan(widths, ("packed", "rows", "packed", "rows", "packed", "rows"), {})
    assert jacobi_decode(runtime, ids, max_new_tokens=40, **settings).new_tokens == expected


def test_prepare_measures_a_plan_that_describe_names():
    runtime = LeanRuntime(small_llama(5))
    runtime.prepare()
    runner = runtime.runner
    assert runner.plan is not None and set(runner.plan.paths) <= set(cpu_paths.PATHS)
    assert runner.plan.widths == cpu_paths.WIDTHS
    assert all(len(ms) == len(cpu_paths.WIDTHS) for ms in runner.plan.ms.values())
    assert f"the layout measured fastest here: {runner.plan.describe()}" in runtime.describe()
