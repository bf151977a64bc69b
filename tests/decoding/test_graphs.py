"""The lean runner's CUDA-graph path (`cllm.runtime.lean.graphs`): which forwards it takes, what it
keeps per cache, and that its output is the eager forward's.

On the CPU `graphs.EagerGraph` stands in for a CUDA graph: it runs the same static forward (the
static input buffers, the index writes into the cache, attention over the buffers' whole capacity
under the mask) at every replay, so everything but the capture itself is tested here; the
exactness suites run on this path too (`conftest.PATHS`, "@graphs"). The tests marked `cuda`
capture real graphs and run where torch sees a GPU.
"""

from __future__ import annotations

import gc

import pytest
import torch
import transformers as tf

from cllm.decoding import greedy_decode, jacobi_decode
from cllm.runtime import hf_cache as kv
from cllm.runtime.lean import graphs
from cllm.runtime.lean import runner as lean
from tests.decoding.conftest import graphs_standing_in

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (real CUDA graphs)")


def llama(seed: int = 0, device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(seed)
    config = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                            initializer_range=0.2)
    return tf.LlamaForCausalLM(config).to(device).eval()


def prompt(length: int, batch: int = 1, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    return torch.randint(2, 128, (batch, length), generator=torch.Generator().manual_seed(seed)).to(device)


def feed(model, rc, ids: torch.Tensor) -> torch.Tensor:
    """One forward of ids (B, L) on the cache, kept."""
    B, L = ids.shape
    with torch.inference_mode():
        logits = kv.feed(model, rc, ids, fed=[L] * B)
        kv.commit(rc, keep=[L] * B, fed=L)
    return logits


@pytest.fixture
def standing_in():
    with graphs_standing_in(True):
        yield


def test_a_shape_runs_eagerly_once_then_from_its_graph_with_the_eager_logits(monkeypatch):
    monkeypatch.setattr(graphs, "GRAPH_KIND", graphs.EagerGraph)  # CAPTURE_AT as shipped: the second time
    model = llama()
    ids = [prompt(3, seed=s) for s in range(4)]
    with torch.inference_mode():
        rc, _ = kv.prefill(model, prompt(20), torch.ones(1, 20, dtype=torch.long))
        with lean.graphs_enabled(False):
            eager_rc, _ = kv.prefill(model, prompt(20), torch.ones(1, 20, dtype=torch.long))
    for i, step in enumerate(ids):
        got = feed(model, rc, step)
        with lean.graphs_enabled(False):
            expected = feed(model, eager_rc, step)
        assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5), i
        assert set(rc.kv.graphs.graphs) == (set() if i == 0 else {(1, 3)})
    assert rc.kv.get_seq_length() == eager_rc.kv.get_seq_length() == 32
    assert torch.allclose(rc.kv.view(0, 1), eager_rc.kv.view(0, 1), atol=1e-5)  # the cache holds what eager wrote


def test_greedy_and_jacobi_on_graphs_give_transformers_greedy_tokens(standing_in):
    model = llama(1)
    ids = prompt(12, batch=3, seed=2)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # a left-padded row
    with lean.runner_enabled(False):
        expected = greedy_decode(model, ids, mask, max_new_tokens=24).new_tokens
    assert greedy_decode(model, ids, mask, max_new_tokens=24).new_tokens == expected
    for n in (1, 4, 16):
        assert jacobi_decode(model, ids, mask, max_new_tokens=24, block_size=n).new_tokens == expected, n


def test_a_grown_cache_drops_its_graphs_and_zeroes_what_the_new_buffers_hold_unused(standing_in):
    model = llama()
    with torch.inference_mode():
        rc, _ = kv.prefill(model, prompt(8), torch.ones(1, 8, dtype=torch.long))
    feed(model, rc, prompt(2, seed=1))
    first = rc.kv.graphs.graphs[1, 2]
    capacity = rc.kv.buffers[0][0].shape[2]
    rc.kv.reserve(1, capacity + 1)  # the buffers are reallocated: their unused slots hold anything
    for buffers in rc.kv.buffers:
        for buffer in buffers:
            buffer[:, :, rc.kv.get_seq_length():] = float("nan")
    logits = feed(model, rc, prompt(2, seed=2))
    assert rc.kv.graphs.graphs[1, 2] is not first  # captured again on the new buffers
    assert torch.isfinite(logits).all()
    used = rc.kv.get_seq_length()
    assert all(not b[:, :, used:].any() for buffers in rc.kv.buffers for b in buffers)


def test_a_replaced_weight_drops_the_graphs_and_is_read(standing_in):
    model = llama()
    with torch.inference_mode():
        rc, _ = kv.prefill(model, prompt(8), torch.ones(1, 8, dtype=torch.long))
        with lean.graphs_enabled(False):
            eager, _ = kv.prefill(model, prompt(8), torch.ones(1, 8, dtype=torch.long))
    feed(model, rc, prompt(1, seed=1))
    with lean.graphs_enabled(False):
        feed(model, eager, prompt(1, seed=1))
    before = rc.kv.graphs.graphs[1, 1]
    model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight))
    got = feed(model, rc, prompt(1, seed=3))
    with lean.graphs_enabled(False):
        assert torch.allclose(got, feed(model, eager, prompt(1, seed=3)), atol=1e-5)
    assert rc.kv.graphs.graphs[1, 1] is not before


def test_wide_forwards_and_shapes_past_the_graph_limit_run_eagerly(monkeypatch, standing_in):
    monkeypatch.setattr(graphs, "MAX_GRAPHS", 2)
    model = llama()
    with torch.inference_mode():
        rc, _ = kv.prefill(model, prompt(8), torch.ones(1, 8, dtype=torch.long))
    for L in (1, 2, 3, graphs.MAX_TOKENS + 1):
        feed(model, rc, prompt(L, seed=L))
    assert set(rc.kv.graphs.graphs) == {(1, 8), (1, 1)}  # the prefill's 8 tokens first


def test_outside_inference_mode_and_when_switched_off_nothing_is_captured(standing_in):
    model = llama()
    with torch.no_grad():
        rc, _ = kv.prefill(model, prompt(8), torch.ones(1, 8, dtype=torch.long))
    with torch.no_grad():
        kv.feed(model, rc, prompt(1), fed=[1])
    with lean.graphs_enabled(False), torch.inference_mode():
        kv.feed(model, rc, prompt(1), fed=[1])
    assert rc.kv.graphs.graphs == {}


def test_on_a_cpu_no_graphs_and_the_verbose_line_says_so():
    model = llama()
    runner = lean.runner_for(model)
    assert graphs.why_not_graphs(runner, model.lm_head.weight) == "CUDA graphs run on a GPU only"
    assert "graphs" not in lean.describe(model)
    with torch.inference_mode():
        rc, _ = kv.prefill(model, prompt(8), torch.ones(1, 8, dtype=torch.long))
    feed(model, rc, prompt(1))
    feed(model, rc, prompt(1, seed=1))
    assert rc.kv.graphs is None


@cuda
def test_real_cuda_graphs_decode_the_eager_tokens_in_float32():
    model = llama(2, device="cuda")
    ids = prompt(16, batch=2, seed=5, device="cuda")
    with lean.graphs_enabled(False):
        expected = greedy_decode(model, ids, max_new_tokens=32).new_tokens
        expected_jacobi = jacobi_decode(model, ids, max_new_tokens=32, block_size=8).new_tokens
    assert "CUDA graphs" in lean.describe(model)
    assert greedy_decode(model, ids, max_new_tokens=32).new_tokens == expected
    assert jacobi_decode(model, ids, max_new_tokens=32, block_size=8).new_tokens == expected_jacobi == expected
    with lean.runner_enabled(False):
        assert greedy_decode(model, ids, max_new_tokens=32).new_tokens == expected


@cuda
def test_real_cuda_graphs_replay_the_eager_logits():
    model = llama(3, device="cuda")
    with torch.inference_mode():
        rc, _ = kv.prefill(model, prompt(30, device="cuda"), torch.ones(1, 30, dtype=torch.long, device="cuda"))
        with lean.graphs_enabled(False):
            eager, _ = kv.prefill(model, prompt(30, device="cuda"), torch.ones(1, 30, dtype=torch.long, device="cuda"))
    for s in range(5):
        step = prompt(4, seed=s, device="cuda")
        got = feed(model, rc, step)
        with lean.graphs_enabled(False):
            assert torch.allclose(got, feed(model, eager, step), atol=1e-4, rtol=1e-4), s
    assert set(rc.kv.graphs.graphs) == {(1, 4)}


def test_a_freed_caches_buffers_and_graphs_serve_the_next_cache_of_its_shape(standing_in):
    model = llama()
    with torch.inference_mode():
        rc, _ = kv.prefill(model, prompt(20), torch.ones(1, 20, dtype=torch.long))
        feed(model, rc, prompt(1, seed=1))
        buffers, graph_set = rc.kv.buffers, rc.kv.graphs
        captured = graph_set.graphs[1, 1]
        del rc
        gc.collect()
        rc, _ = kv.prefill(model, prompt(30, seed=2), torch.ones(1, 30, dtype=torch.long))
        assert rc.kv.buffers is buffers and rc.kv.graphs is graph_set
        with lean.graphs_enabled(False):
            eager, _ = kv.prefill(model, prompt(30, seed=2), torch.ones(1, 30, dtype=torch.long))
    step = prompt(1, seed=3)
    got = feed(model, rc, step)
    assert graph_set.graphs[1, 1] is captured  # replayed, not captured again
    with lean.graphs_enabled(False):
        assert torch.allclose(got, feed(model, eager, step), atol=1e-5)
    with torch.inference_mode():
        other, _ = kv.prefill(model, prompt(30, batch=2), torch.ones(2, 30, dtype=torch.long))
    assert other.kv.buffers is not buffers  # two rows: buffers of their own


def test_a_failed_capture_leaves_the_runner_eager_and_exact(monkeypatch, standing_in, caplog):
    def fail(self, forward):
        raise RuntimeError("capture refused\nsecond line")

    monkeypatch.setattr(graphs.EagerGraph, "capture", fail)
    model = llama(4)
    ids = prompt(10, seed=4)
    with lean.runner_enabled(False):
        expected = greedy_decode(model, ids, max_new_tokens=12).new_tokens
    assert greedy_decode(model, ids, max_new_tokens=12).new_tokens == expected
    runner = lean.runner_for(model)
    assert runner.graphs_failed == "a CUDA graph capture failed (capture refused)"
    assert "decoding forwards run eagerly from now on" in caplog.text
    with torch.inference_mode():
        rc, _ = kv.prefill(model, ids, torch.ones_like(ids))
    assert rc.kv.graphs is None  # later caches are plain
    assert greedy_decode(model, ids, max_new_tokens=12).new_tokens == expected


def test_the_runner_keeps_the_last_few_freed_caches_only(standing_in):
    model = llama()
    for b in range(1, 7):  # caches of 1, 2, ... 6 rows, each freed before the next
        with torch.inference_mode():
            rc, _ = kv.prefill(model, prompt(8, batch=b), torch.ones(b, 8, dtype=torch.long))
        del rc
        gc.collect()
    kept = lean.runner_for(model).spares.kept
    assert [key for key, _, _ in kept] == [(b, 512) for b in range(7 - graphs.SPARES_KEPT, 7)]
