"""The lean runtime's CUDA-graph path (`cllm.runtime.lean.graphs`): which forwards it takes, what
it keeps per cache, and that its output is the eager forward's.

On the CPU `graphs.EagerGraph` stands in for a CUDA graph: it runs the same static forward (the
static input buffers, the index writes into the cache, attention over the buffers' whole capacity
under the mask) at every replay, so everything but the capture itself is tested here; the
exactness suites run on this path too (`tests/decoding/conftest.py`, "@graphs"). The tests
marked `cuda` capture real graphs and run where torch sees a GPU.
"""

from __future__ import annotations

import gc

import pytest
import torch
import transformers as tf

from cllm.decoding import greedy_decode, jacobi_decode
from cllm.runtime import open_runtime
from cllm.runtime.lean import graphs
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


def opened(runtime, ids: torch.Tensor):
    """A session of `runtime` with the rows of ids (B, T) open."""
    session = runtime.session()
    with torch.inference_mode():
        rows, _ = session.open(ids.tolist())
    return session, rows


def feed(session, rows, ids: torch.Tensor, *, inference: bool = True) -> torch.Tensor:
    """One forward of ids (B, L) on the session, kept."""
    B, L = ids.shape
    with torch.inference_mode(inference), torch.no_grad():
        logits = session.feed(rows, ids.tolist()).logits
        session.keep(rows, [range(L)] * B)
    return logits


def kv(session):
    return session.batch.storage


@pytest.fixture
def standing_in():
    with graphs_standing_in(True):
        yield


def test_a_shape_runs_eagerly_once_then_from_its_graph_with_the_eager_logits(monkeypatch):
    monkeypatch.setattr(graphs, "GRAPH_KIND", graphs.EagerGraph)  # CAPTURE_AT as shipped: the second time
    model = llama()
    ids = [prompt(3, seed=s) for s in range(4)]
    session, rows = opened(open_runtime(model, "lean"), prompt(20))
    eager, eager_rows = opened(open_runtime(model, "lean", graphs=False), prompt(20))
    for i, step in enumerate(ids):
        got = feed(session, rows, step)
        assert torch.allclose(got, feed(eager, eager_rows, step), atol=1e-5, rtol=1e-5), i
        assert set(kv(session).graphs.graphs) == (set() if i == 0 else {(1, 3)})
    assert kv(session).get_seq_length() == kv(eager).get_seq_length() == 32
    assert torch.allclose(kv(session).view(0, 1), kv(eager).view(0, 1), atol=1e-5)  # the cache holds what eager wrote


def test_greedy_and_jacobi_on_graphs_give_transformers_greedy_tokens(standing_in):
    model = llama(1)
    ids = prompt(12, batch=3, seed=2)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # a left-padded row
    expected = greedy_decode(open_runtime(model, "transformers"), ids, mask, max_new_tokens=24).new_tokens
    runtime = open_runtime(model, "lean")
    assert greedy_decode(runtime, ids, mask, max_new_tokens=24).new_tokens == expected
    for n in (1, 4, 16):
        assert jacobi_decode(runtime, ids, mask, max_new_tokens=24, block_size=n).new_tokens == expected, n


def test_a_grown_cache_drops_its_graphs_and_zeroes_what_the_new_buffers_hold_unused(standing_in):
    session, rows = opened(open_runtime(llama(), "lean"), prompt(8))
    feed(session, rows, prompt(2, seed=1))
    first = kv(session).graphs.graphs[1, 2]
    capacity = kv(session).buffers[0][0].shape[2]
    kv(session).reserve(1, capacity + 1)  # the buffers are reallocated: their unused slots hold anything
    for buffers in kv(session).buffers:
        for buffer in buffers:
            buffer[:, :, kv(session).get_seq_length():] = float("nan")
    logits = feed(session, rows, prompt(2, seed=2))
    assert kv(session).graphs.graphs[1, 2] is not first  # captured again on the new buffers
    assert torch.isfinite(logits).all()
    used = kv(session).get_seq_length()
    assert all(not b[:, :, used:].any() for buffers in kv(session).buffers for b in buffers)


def test_a_replaced_weight_drops_the_graphs_and_is_read(standing_in):
    model = llama()
    session, rows = opened(open_runtime(model, "lean"), prompt(8))
    eager, eager_rows = opened(open_runtime(model, "lean", graphs=False), prompt(8))
    feed(session, rows, prompt(1, seed=1))
    feed(eager, eager_rows, prompt(1, seed=1))
    before = kv(session).graphs.graphs[1, 1]
    model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight))
    got = feed(session, rows, prompt(1, seed=3))
    assert torch.allclose(got, feed(eager, eager_rows, prompt(1, seed=3)), atol=1e-5)
    assert kv(session).graphs.graphs[1, 1] is not before


def test_wide_forwards_and_shapes_past_the_graph_limit_run_eagerly(monkeypatch, standing_in):
    monkeypatch.setattr(graphs, "MAX_GRAPHS", 2)
    session, rows = opened(open_runtime(llama(), "lean"), prompt(8))
    for L in (1, 2, 3, graphs.MAX_TOKENS + 1):
        feed(session, rows, prompt(L, seed=L))
    assert set(kv(session).graphs.graphs) == {(1, 8), (1, 1)}  # the prefill's 8 tokens first


def test_outside_inference_mode_and_when_switched_off_nothing_is_captured(standing_in):
    model = llama()
    session = open_runtime(model, "lean").session()
    with torch.no_grad():
        rows, _ = session.open(prompt(8).tolist())
    feed(session, rows, prompt(1), inference=False)
    off, off_rows = opened(open_runtime(model, "lean", graphs=False), prompt(8))
    feed(off, off_rows, prompt(1))
    assert kv(session).graphs.graphs == {} and kv(off).graphs is None


def test_on_a_cpu_no_graphs_and_the_verbose_line_says_so():
    runtime = open_runtime(llama(), "lean")
    assert runtime.runner.why_not_graphs() == "CUDA graphs run on a GPU only"
    assert "graphs" not in runtime.describe()
    session, rows = opened(runtime, prompt(8))
    feed(session, rows, prompt(1))
    feed(session, rows, prompt(1, seed=1))
    assert kv(session).graphs is None


@cuda
def test_real_cuda_graphs_decode_the_eager_tokens_in_float32():
    model = llama(2, device="cuda")
    ids = prompt(16, batch=2, seed=5, device="cuda")
    eager = open_runtime(model, "lean", graphs=False)
    expected = greedy_decode(eager, ids, max_new_tokens=32).new_tokens
    expected_jacobi = jacobi_decode(eager, ids, max_new_tokens=32, block_size=8).new_tokens
    runtime = open_runtime(model, "lean")
    assert "CUDA graphs" in runtime.describe()
    assert greedy_decode(runtime, ids, max_new_tokens=32).new_tokens == expected
    assert jacobi_decode(runtime, ids, max_new_tokens=32, block_size=8).new_tokens == expected_jacobi == expected
    assert greedy_decode(open_runtime(model, "transformers"), ids, max_new_tokens=32).new_tokens == expected


@cuda
def test_real_cuda_graphs_replay_the_eager_logits():
    model = llama(3, device="cuda")
    session, rows = opened(open_runtime(model, "lean"), prompt(30, device="cuda"))
    eager, eager_rows = opened(open_runtime(model, "lean", graphs=False), prompt(30, device="cuda"))
    for s in range(5):
        step = prompt(4, seed=s, device="cuda")
        got = feed(session, rows, step)
        assert torch.allclose(got, feed(eager, eager_rows, step), atol=1e-4, rtol=1e-4), s
    assert set(kv(session).graphs.graphs) == {(1, 4)}


def test_a_freed_caches_buffers_and_graphs_serve_the_next_cache_of_its_shape(standing_in):
    model = llama()
    runtime = open_runtime(model, "lean")
    session, rows = opened(runtime, prompt(20))
    feed(session, rows, prompt(1, seed=1))
    buffers, graph_set = kv(session).buffers, kv(session).graphs
    captured = graph_set.graphs[1, 1]
    session.close(rows)
    gc.collect()
    session, rows = opened(runtime, prompt(30, seed=2))
    assert kv(session).buffers is buffers and kv(session).graphs is graph_set
    eager, eager_rows = opened(open_runtime(model, "lean", graphs=False), prompt(30, seed=2))
    step = prompt(1, seed=3)
    got = feed(session, rows, step)
    assert graph_set.graphs[1, 1] is captured  # replayed, not captured again
    assert torch.allclose(got, feed(eager, eager_rows, step), atol=1e-5)
    other, _ = opened(runtime, prompt(30, batch=2))
    assert kv(other).buffers is not buffers  # two rows: buffers of their own


def test_a_failed_capture_leaves_the_runtime_eager_and_exact(monkeypatch, standing_in, caplog):
    def fail(self, forward):
        raise RuntimeError("capture refused\nsecond line")

    monkeypatch.setattr(graphs.EagerGraph, "capture", fail)
    model = llama(4)
    ids = prompt(10, seed=4)
    expected = greedy_decode(open_runtime(model, "transformers"), ids, max_new_tokens=12).new_tokens
    runtime = open_runtime(model, "lean")
    assert greedy_decode(runtime, ids, max_new_tokens=12).new_tokens == expected
    assert runtime.runner.graphs_failed == "a CUDA graph capture failed (capture refused)"
    assert "decoding forwards run eagerly from now on" in caplog.text
    session, _ = opened(runtime, ids)
    assert kv(session).graphs is None  # later caches are plain
    assert greedy_decode(runtime, ids, max_new_tokens=12).new_tokens == expected


def test_the_runtime_keeps_the_last_few_freed_caches_only(standing_in):
    runtime = open_runtime(llama(), "lean")
    for b in range(1, 7):  # caches of 1, 2, ... 6 rows, each freed before the next
        session, rows = opened(runtime, prompt(8, batch=b))
        session.close(rows)
        gc.collect()
    kept = runtime.runner.spares.kept
    assert [key for key, _, _ in kept] == [(b, 512) for b in range(7 - graphs.SPARES_KEPT, 7)]
