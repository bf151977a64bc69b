"""The adaptive fed width (`jacobi.width.Width`, `JacobiConfig.adaptive`): each row feeds the
width whose tokens made final per step cost are best, learned from what wide forwards accepted;
down to one token where drafts do not pay, wider where they do; the output stays greedy's."""

import math

import pytest
import torch

from cllm import RECOMMENDED, greedy_decode, jacobi_decode
from cllm.decoding.jacobi.width import PROBE_EVERY, PROBE_SHARE, Width, interpolate
from cllm.runtime import as_runtime
from tests.decoding.conftest import assert_same_tokens, random_prompt, tiny_model

# a compute-bound CPU's curve (a 135M model on two cores, llama.cpp): a wide forward costs dearly
STEEP = tuple(interpolate((1.0, 1.29, 1.5, 1.73, 2.0, 2.3, 2.56, 2.83), k) for k in range(1, 9)) + tuple(
    2.83 + (6.92 - 2.83) * (k - 8) / 16 for k in range(9, 25))
FLAT = tuple(1.0 + 0.01 * k for k in range(24))  # a GPU's: every width costs about one step


def test_a_row_whose_drafts_never_pay_falls_back_to_one_token_within_a_few_forwards():
    width = Width(STEEP, 24)
    chosen = []
    for _ in range(4):
        chosen.append(width.choose())
        width.observe(chosen[-1], [0])  # only the root: one token made final, whatever was fed
    assert chosen[0] > 1  # the first forward is wide: it informs every narrower width
    assert chosen[1:] == [1, 1, 1]


def test_a_row_at_one_token_probes_a_wider_width_now_and_then_and_takes_it_when_it_pays():
    width = Width(STEEP, 24)
    width.observe(width.choose(), [0])
    # probes are spaced so that, were they all wasted, they would cost PROBE_SHARE of the time
    interval = max(PROBE_EVERY, math.ceil((STEEP[1] - STEEP[0]) / PROBE_SHARE))
    chosen = []
    for _ in range(4 * interval):
        k = width.choose()
        chosen.append(k)
        width.observe(k, range(k))  # from now on every fed token is accepted
    assert chosen[0] == 1
    assert 2 in chosen[: interval + 1]  # the probe came
    assert chosen[:interval - 1] == [1] * (interval - 1)  # and not sooner
    assert chosen[-1] >= 2 and max(chosen[-interval:]) > 2  # the row widened, and tries wider still


def test_a_forward_tells_each_narrower_width_what_it_would_have_accepted():
    width = Width(FLAT, 8)
    # a tree of 6 nodes whose accepted path is nodes 0, 1 and 4 (a branch past the tail)
    width.observe(6, [0, 1, 4])
    assert [width.expected(k) for k in range(1, 7)] == [1, 2, 2, 2, 3, 3]
    assert width.expected(7) is None  # never fed that wide


def test_cheap_wide_forwards_keep_a_row_wide():
    width = Width(FLAT, 24)
    for _ in range(5):
        k = width.choose()
        width.observe(k, range(min(k, 3)))  # three tokens per forward, however wide
    assert width.choose() >= 3


@pytest.mark.parametrize("costs", [STEEP, FLAT], ids=["steep", "flat"])
def test_adaptive_decoding_equals_greedy(torch_arch, costs):
    model = tiny_model(torch_arch)
    runtime = as_runtime(model)
    runtime.step_costs = costs
    try:
        for seed, length in [(3, 5), (4, 17)]:
            prompt = random_prompt(seed, length)
            expected = greedy_decode(model, prompt, max_new_tokens=40).new_tokens[0]
            out = jacobi_decode(runtime, prompt, max_new_tokens=40, **RECOMMENDED,
                                generator=torch.Generator().manual_seed(seed))
            assert_same_tokens(model, prompt[0].tolist(), expected, out.new_tokens[0], f"{torch_arch} adaptive")
            assert out.forward_passes <= len(expected)
    finally:
        runtime.step_costs = None


def test_on_a_steep_curve_a_random_model_decodes_mostly_one_token_per_forward(torch_arch):
    model = tiny_model(torch_arch)
    runtime = as_runtime(model)
    prompt = random_prompt(5, 9)
    runtime.step_costs = STEEP
    try:
        out = jacobi_decode(runtime, prompt, max_new_tokens=60, **RECOMMENDED)
    finally:
        runtime.step_costs = None
    fixed = jacobi_decode(runtime, prompt, max_new_tokens=60, **RECOMMENDED)
    assert out.new_tokens == fixed.new_tokens
    # a random model's drafts rarely pay: the adaptive rows feed far fewer tokens than the budget's
    assert sum(out.stats.fed) < 0.5 * sum(fixed.stats.fed)


class Rounding:
    """A runtime that says its wide forwards round differently from one-token forwards
    (`batch_invariant` False, as llama.cpp on a quantized file); everything else is the wrapped one's."""

    batch_invariant = False

    def __init__(self, runtime):
        self.runtime = runtime
        self.widths: list[int] = []

    def __getattr__(self, name):
        return getattr(self.runtime, name)

    def session(self):
        session, widths = self.runtime.session(), self.widths

        class Noted:
            def __getattr__(self, name):
                return getattr(session, name)

            def feed(self, rows, tokens, **kwargs):
                widths.append(max(len(t) for t in tokens))
                return session.feed(rows, tokens, **kwargs)

        return Noted()


def test_exact_greedy_on_a_runtime_that_rounds_wide_forwards_otherwise_feeds_one_token_per_forward(torch_arch):
    model = tiny_model(torch_arch)
    runtime = Rounding(as_runtime(model))
    prompt = random_prompt(6, 12)
    out = jacobi_decode(runtime, prompt, max_new_tokens=30, **RECOMMENDED)
    assert out.new_tokens == greedy_decode(model, prompt, max_new_tokens=30).new_tokens
    assert set(runtime.widths) == {1} and out.forward_passes == 30  # the prefill and 29 one-token forwards
    runtime.widths.clear()
    relaxed = jacobi_decode(runtime, prompt, max_new_tokens=30, **{**RECOMMENDED, "exact": False})
    assert relaxed.new_tokens == out.new_tokens and max(runtime.widths) > 1  # --exact false: drafts again


def test_greedy_guesses_without_a_generator_are_the_same_every_call_whatever_ran_before(torch_arch):
    model = tiny_model(torch_arch)
    prompt = random_prompt(7, 10)
    first = jacobi_decode(model, prompt, max_new_tokens=30, block_size=6)
    torch.rand(100)  # the global RNG moves on
    jacobi_decode(model, random_prompt(8, 5), max_new_tokens=12, block_size=6)
    again = jacobi_decode(model, prompt, max_new_tokens=30, block_size=6)
    assert first.new_tokens == again.new_tokens
    assert first.stats.accepted == again.stats.accepted  # the same drafts verified, forward by forward
